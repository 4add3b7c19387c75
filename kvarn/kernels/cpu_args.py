"""Argument checks of the CPU attention ops, and the paged context they describe (:class:`Paged`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, KernelArgumentError, check_tensor
from kvarn.schemes.scheme import Scheme

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Paged:
    """One layer's paged, packed context and its unquantized rows, checked.

    ``tail_k/v`` are per sequence ``[B, H, T, D]`` (``tail_slot`` None) or a staging pool
    ``[num_slots, H, T, D]`` read at ``tail_slot[b]``; the same for ``sink_k/v`` with capacity ``S``.
    """

    cache: torch.Tensor  # [num_blocks, H, tile_bytes] uint8, last axis contiguous
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    tail_lens: torch.Tensor  # [B] int32
    tail_slot: torch.Tensor | None  # [B] int32/int64
    sink_k: torch.Tensor | None
    sink_v: torch.Tensor | None
    sink_lens: torch.Tensor | None
    sink_slot: torch.Tensor | None
    scheme: Scheme
    sm_scale: float

    def sink_count(self, num_tiles: torch.Tensor) -> torch.Tensor:
        """Sink rows each sequence reads, ``[B]`` int64: clamped to the pool's capacity; with
        ``sink_tokens`` also to ``S`` and 0 until tile 0 is packed (its tokens are still in the tail)."""
        if self.sink_k is None or self.sink_lens is None:
            return torch.zeros(num_tiles.shape[0], dtype=torch.long)
        cap = self.sink_k.shape[2]
        if self.scheme.sink_tokens:
            cap = min(cap, self.scheme.sink_tokens)
        n = self.sink_lens.long().clamp(0, cap)
        return torch.where(num_tiles > 0, n, 0) if self.scheme.sink_tokens else n


def _check_rows(
    name: str,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    slot: torch.Tensor | None,
    bsz: int,
    hkv: int,
    d: int,
) -> None:
    """Tail or sink rows: per sequence ``[B, H, rows, D]``, or a pool ``[slots, H, rows, D]`` with ``slot`` ``[B]``."""
    check_tensor(f"{name}_k", k, (bsz if slot is None else None, hkv, None, d), FLOAT_DTYPES, CPU)
    check_tensor(f"{name}_v", v, tuple(k.shape), (k.dtype,), CPU)
    check_tensor(f"{name}_lens", lens, (bsz,), (torch.int32,), CPU)
    if slot is not None:
        check_tensor(f"{name}_slot", slot, (bsz,), INDEX_DTYPES, CPU)
        if slot.numel() and not bool(((slot >= 0) & (slot < k.shape[0])).all()):
            raise KernelArgumentError(f"{name}_slot must hold indices in 0..{k.shape[0] - 1}, got {slot.tolist()}")


def check_paged(
    scheme: Scheme,
    bsz: int,
    hq: int,
    d: int,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    sink: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    sm_scale: float | None,
) -> Paged:
    """Check every argument the two ops share; raise :class:`KernelArgumentError` naming the bad one."""
    if scheme.overrides:
        raise KernelArgumentError(
            f"scheme {scheme.name} has per-layer overrides; pass scheme.for_layer(layer) (a scheme without overrides)"
        )
    tile_bytes = scheme.tile_bytes(d)  # raises on a head_dim the codec does not support
    if cache.dim() != 3:
        raise KernelArgumentError(f"cache must be [num_blocks, num_kv_heads, tile_bytes], got {list(cache.shape)}")
    hkv = cache.shape[1]
    if hkv == 0 or hq % hkv:
        raise KernelArgumentError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    check_tensor("cache", cache, (None, hkv, tile_bytes), (torch.uint8,), CPU)
    check_tensor("block_table", block_table, (bsz, None), (torch.int32,), CPU)
    check_tensor("num_tiles", num_tiles, (bsz,), (torch.int32,), CPU)
    if bsz and int(num_tiles.max()) > block_table.shape[1]:
        raise KernelArgumentError(f"num_tiles {num_tiles.tolist()} exceed block_table width {block_table.shape[1]}")
    tail_k, tail_v, tail_lens, tail_slot = tail
    _check_rows("tail", tail_k, tail_v, tail_lens, tail_slot, bsz, hkv, d)
    if tail_k.shape[2] != scheme.group_size:
        raise KernelArgumentError(f"tail_k must hold group_size={scheme.group_size} rows, got {tail_k.shape[2]}")
    sink_k, sink_v, sink_lens, sink_slot = sink
    if sink_k is None and scheme.sink_len:
        kept = "a sink tile" if scheme.sink_tile else f"its first {scheme.sink_tokens} tokens exactly"
        raise KernelArgumentError(f"scheme {scheme.name} keeps {kept}: pass sink_k, sink_v and sink_lens")
    if (sink_k is None) != (sink_v is None) or (sink_k is None) != (sink_lens is None):
        raise KernelArgumentError("sink_k, sink_v and sink_lens go together")
    if sink_k is None and sink_slot is not None:
        raise KernelArgumentError("sink_slot given without sink_k, sink_v and sink_lens")
    if sink_k is not None and sink_v is not None and sink_lens is not None:
        _check_rows("sink", sink_k, sink_v, sink_lens, sink_slot, bsz, hkv, d)
        if sink_k.shape[2] < scheme.sink_len:
            raise KernelArgumentError(
                f"sink_k holds {sink_k.shape[2]} rows; scheme {scheme.name} needs at least {scheme.sink_len}"
            )
    scale = sm_scale if sm_scale is not None else d**-0.5
    return Paged(cache, tail_k, tail_v, tail_lens, tail_slot, sink_k, sink_v, sink_lens, sink_slot, scheme, scale)
