"""Sizes of the staging and sink pools, and their accounting against the KV cache memory.

Each layer's pools (the attention impls of :mod:`kvarn.vllm.backend` and :mod:`kvarn.vllm.mla`
allocate them when the model is built) hold ``max_num_seqs`` slots of ``group_size`` staged tokens (:mod:`kvarn.vllm.staging`) and,
for schemes with a sink, of ``sink_capacity`` exact first tokens (:mod:`kvarn.vllm.sinks`), keys and
values in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig

from kvarn.schemes import Scheme


def sink_capacity(scheme: Scheme) -> int:
    """Exact rows per sink slot: the whole first tile for a sink tile, else ``sink_tokens`` (0: no pool)."""
    return scheme.group_size if scheme.sink_tile else scheme.sink_tokens


def pool_bytes(
    scheme: Scheme, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_slots: int, *, staging: bool = True
) -> int:
    """Bytes of one layer's pools: keys and values, ``num_slots`` slots each, of the sink pool and,
    with ``staging`` (MLA and hybrid models; others keep partial tiles in tail blocks), the staging pool."""
    rows = (scheme.group_size if staging else 0) + sink_capacity(scheme)
    return 2 * num_slots * num_kv_heads * rows * head_dim * dtype.itemsize


@dataclass
class PoolTotals:
    """Bytes and layers of the pools this process allocated (for the start-up log)."""

    bytes: int = 0
    layers: int = 0


POOLS = PoolTotals()


def reserve(config: VllmConfig, nbytes: int) -> None:
    """Count ``nbytes`` of pools against the KV cache memory: an explicit ``kv_cache_memory_bytes``
    shrinks by it (vLLM's profiling counts the allocated pools by itself otherwise)."""
    POOLS.bytes += nbytes
    POOLS.layers += 1
    cache = config.cache_config
    if cache.kv_cache_memory_bytes is None:
        return
    left = int(cache.kv_cache_memory_bytes) - nbytes
    if left <= 0:
        raise ValueError(
            f"kv_cache_dtype={cache.cache_dtype!r}: the staging/sink pools for max_num_seqs="
            f"{config.scheduler_config.max_num_seqs} need {POOLS.bytes / 2**20:.1f} MiB so far, more than "
            f"the KV cache memory left ({(left + nbytes) / 2**20:.1f} MiB); lower max_num_seqs or give more KV memory"
        )
    cache.kv_cache_memory_bytes = left
