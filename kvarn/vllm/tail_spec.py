"""vLLM's side of the tail (:mod:`kvarn.vllm.tail`): the KV-cache specs whose requests hold lookahead
blocks beyond their tiles, and the KV-cache manager that allocates them and keeps prefixes whose
sink rows were reclaimed out of the prefix cache (:mod:`kvarn.vllm.lost_sinks`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, fields, replace
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvarn.vllm.lost_sinks import LostSinks, channel_path
from kvarn.vllm.tail import TailLayout

logger = logging.getLogger("kvarn.vllm")


class _Tail:
    """What a tail spec adds to its vLLM spec.

    ``tail_blocks``: the vLLM blocks a request holds beyond its tiles (``L``, also in the block
    table's width and in merges); ``tail_forward``: the forward order of :mod:`kvarn.vllm.tail`, in
    which they are beyond its complete tiles (its partial tile's block is the first of them), else
    beyond every tile it touches;
    ``counted``: whether vLLM's per-request memory (``max_memory_usage_bytes``, behind the
    "Maximum concurrency" it logs and its check that ``max_model_len`` fits) counts the tail;
    ``lost_sinks``: the engine's flag file of reclaimed sink rows (:mod:`kvarn.vllm.lost_sinks`;
    ``""`` for none), which the scheduler's :class:`TailManager` creates and reads.
    """

    tail_blocks: int
    tail_forward: bool
    counted: bool
    lost_sinks: str

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        return int(super().max_num_blocks_per_req(vllm_config, max_len)) + self.tail_blocks  # type: ignore[misc]

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        base = int(super().max_memory_usage_bytes(vllm_config))  # type: ignore[misc]
        if not self.counted:
            return base
        tokens = int(vllm_config.model_config.max_model_len)
        blocks = -(-request_tokens(self, tokens) // int(self.block_size))  # type: ignore[attr-defined]
        return blocks * int(self.page_size_bytes)  # type: ignore[attr-defined]

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        merged = super().merge(specs)  # type: ignore[misc]
        first = specs[0]
        return replace(
            merged, tail_blocks=max(s.tail_blocks for s in specs), tail_forward=first.tail_forward,
            counted=first.counted, lost_sinks=first.lost_sinks,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TailSpec(_Tail, FullAttentionSpec):
    """A full-attention spec whose requests hold ``tail_blocks`` blocks beyond their tokens' tiles.

    Every layer of the kvarn group has it (16-bit layers of the group too, so that the group is of one
    type and its block table of one width); :class:`TailManager` allocates by it. The memory vLLM
    counts per request (``max_memory_usage_bytes``, behind the "Maximum concurrency" it logs)
    includes the tail blocks a request of ``max_model_len`` tokens holds where ``counted``: a
    model whose attention layers are all full attention. A hybrid or sliding-window model's groups
    are planned from the same figure (counting the tail there takes page bytes from the packed
    layers, docs/capacity.md), so there it stays the tiles', and kvarn's start-up line gives the
    tail's cost (:func:`kvarn.vllm.tail_cost.describe`).
    """

    tail_blocks: int = 0
    tail_forward: bool = False
    counted: bool = False
    lost_sinks: str = ""


@dataclass(frozen=True, kw_only=True)
class TailMLASpec(_Tail, MLAAttentionSpec):
    """:class:`TailSpec` for an MLA model's latent layers (vLLM's ``MLAAttentionSpec``)."""

    tail_blocks: int = 0
    tail_forward: bool = False
    counted: bool = False
    lost_sinks: str = ""


def _tile(spec: Any) -> int:
    """Tokens per kernel block of ``spec``: ``tokens_per_state`` of a packed spec whose vLLM blocks hold
    several tiles (a hybrid model), else the block."""
    return int(spec.tokens_per_state) if getattr(spec, "tokens_per_state", 1) > 1 else int(spec.block_size)


def with_tail(spec: Any, layout: TailLayout, vllm_config: Any = None, counted: bool = False) -> Any:
    """``spec`` (a plain :class:`FullAttentionSpec` or ``MLAAttentionSpec``) as a tail spec whose requests
    hold the tail blocks of ``layout``: ``ceil(L x tile / block_size)`` of vLLM's blocks (a hybrid
    model's blocks hold several tiles; the tile is ``tokens_per_state`` of a packed spec, else the
    block), in its order (:class:`_Tail`). ``vllm_config``: the engine's, which
    names its flag file of reclaimed sink rows (:func:`kvarn.vllm.lost_sinks.channel_path`; none
    without it); ``counted``: vLLM's per-request memory counts the tail (:class:`TailSpec`)."""
    kind = {FullAttentionSpec: TailSpec, MLAAttentionSpec: TailMLASpec}.get(type(spec))
    if kind is None:
        return spec
    kwargs = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    lost = channel_path(vllm_config) if vllm_config is not None else ""
    return kind(
        **kwargs, tail_blocks=-(-layout.blocks * _tile(spec) // spec.block_size),
        tail_forward=layout.forward, counted=counted, lost_sinks=lost,
    )  # fmt: skip


def request_tokens(spec: Any, tokens: int) -> int:
    """The tokens' worth of vLLM blocks a request of ``tokens`` tokens holds with its tail under ``spec``
    (a tail spec): its tail blocks beyond its complete tiles (forward order) or beyond every tile it
    touches, or 0 before it holds a token."""
    if tokens <= 0:
        return 0
    tail = int(getattr(spec, "tail_blocks", 0)) * int(spec.block_size)
    if getattr(spec, "tail_forward", False):
        return tokens // _tile(spec) * _tile(spec) + tail
    return tokens + tail


# a scheduler's block pool -> its flag file of reclaimed sink rows and kernel blocks per block
_LOST: weakref.WeakKeyDictionary[Any, tuple[LostSinks, int]] = weakref.WeakKeyDictionary()


class TailManager(FullAttentionManager):
    """vLLM's full-attention manager, allocating with every request's tiles the blocks its 16-bit tail
    lives in (:func:`request_tokens`), from its first step.

    With prefix caching and sink rows it also makes the engine's flag file of reclaimed sink rows
    (:mod:`kvarn.vllm.lost_sinks`) and, before every prefix-cache lookup, evicts the first blocks the
    workers flagged there: vLLM's lookup is a class method given the block pool, so the channel is
    found by the block pool (:data:`_LOST`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = getattr(self.kv_cache_spec, "lost_sinks", "")
        if self.enable_caching and path and self.block_pool not in _LOST:
            stride = max(1, int(self.kv_cache_spec.block_size) // _tile(self.kv_cache_spec))
            try:
                _LOST[self.block_pool] = (LostSinks.create(path, self.block_pool.num_gpu_blocks * stride), stride)
            except OSError as e:
                logger.warning("kvarn: cannot create %s (%s): a prefix-cache hit on a sequence whose sink rows "
                               "were reclaimed reads its tile 0 quantized", path, e)  # fmt: skip

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Any, max_length: int, kv_cache_group_ids: list[int], block_pool: Any, *args: Any,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        held = _LOST.get(block_pool)
        if held is not None:
            lost, stride = held
            if gone := {key // stride for key in lost.take()}:
                block_pool.evict_blocks(gone)
        return super().find_longest_cache_hit(block_hashes, max_length, kv_cache_group_ids, block_pool, *args, **kwargs)

    def _ahead(self, num_tokens: int) -> int:
        return request_tokens(self.kv_cache_spec, num_tokens)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        return int(super().get_num_blocks_to_allocate(request_id, self._ahead(num_tokens), *args, **kwargs))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        return super().allocate_new_blocks(request_id, self._ahead(num_tokens), *args, **kwargs)


def register_spec() -> None:
    """Register :class:`TailSpec` with vLLM's KV-cache spec registry (its manager: :class:`TailManager`,
    grouped with full attention)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry.register(TailSpec, TailManager, uniform_type_base_spec=FullAttentionSpec)
    KVCacheSpecRegistry.register(TailMLASpec, TailManager, uniform_type_base_spec=FullAttentionSpec)
