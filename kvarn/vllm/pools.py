"""The size of the sink pool, and where it is allocated.

Each layer's sink pool holds ``slots`` slots (``max(max_num_seqs, KVARN_STAGING_SLOTS)``) of
``sink_capacity`` exact first tokens (:mod:`kvarn.vllm.sinks`), keys and values in the model dtype,
for schemes with a sink. (Partial tiles wait in the requests' own tail blocks, :mod:`kvarn.vllm.tail`,
not in a pool.) The attention impls of :mod:`kvarn.vllm.backend` and :mod:`kvarn.vllm.mla`
allocate the sink pool once their layer's weights are loaded (``process_weights_after_loading``),
before vLLM measures memory for the KV cache, and count it against it
(:meth:`kvarn.vllm.context.EngineState.reserve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.schemes import Scheme

Pool = tuple[torch.Tensor, torch.Tensor]  # keys, values: [num_slots, H, rows, D] model dtype


def sink_capacity(scheme: Scheme) -> int:
    """Exact rows per sink slot: the whole first tile for a sink tile, else ``sink_tokens`` (0: no pool)."""
    return scheme.group_size if scheme.sink_tile else scheme.sink_tokens


def pool_bytes(scheme: Scheme, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_slots: int) -> int:
    """Bytes of one layer's sink pool: keys and values, ``num_slots`` slots of ``sink_capacity`` rows
    (0 for a scheme without a sink)."""
    return 2 * num_slots * num_kv_heads * sink_capacity(scheme) * head_dim * dtype.itemsize


def zeros_pool(slots: int, num_kv_heads: int, rows: int, head_dim: int, dtype: torch.dtype, device: Any) -> Pool:
    """Keys and values ``[slots, num_kv_heads, rows, head_dim]`` of ``dtype`` on ``device``, zeroed."""
    shape = (slots, num_kv_heads, rows, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class PoolTotals:
    """Bytes and layers of the pools one engine's layers allocated (for the start-up log)."""

    bytes: int = 0
    layers: int = 0
