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


def check_indices(p: Paged, block_table: torch.Tensor, num_tiles: torch.Tensor) -> None:
    """The data-dependent checks (host reads): tile counts, slots. The native kernel does its own."""
    if not num_tiles.numel():
        return
    if int(num_tiles.min()) < 0 or int(num_tiles.max()) > block_table.shape[1]:
        raise KernelArgumentError(
            f"num_tiles {num_tiles.tolist()} must be in 0..{block_table.shape[1]} (block_table width)"
        )
    read = torch.arange(block_table.shape[1])[None, :] < num_tiles[:, None]
    ids = block_table[read]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= p.cache.shape[0]):
        raise KernelArgumentError(f"block_table entries read must be block ids in 0..{p.cache.shape[0] - 1}")
    if int(p.tail_lens.min()) < 0 or int(p.tail_lens.max()) > p.tail_k.shape[2]:
        raise KernelArgumentError(f"tail_lens {p.tail_lens.tolist()} must be in 0..{p.tail_k.shape[2]}")
    for name, slot, pool in (("tail", p.tail_slot, p.tail_k), ("sink", p.sink_slot, p.sink_k)):
        if slot is None or pool is None or not slot.numel():
            continue
        if int(slot.min()) < 0 or int(slot.max()) >= pool.shape[0]:
            raise KernelArgumentError(f"{name}_slot must hold indices in 0..{pool.shape[0] - 1}, got {slot.tolist()}")


# argument layouts already checked: (scheme, shapes, dtypes, strides) -> True; checks cost ~0.1 ms a call
_CHECKED: dict[tuple[object, ...], bool] = {}


def _signature(
    scheme: Scheme, tensors: tuple[torch.Tensor | None, ...], extra: tuple[object, ...]
) -> tuple[object, ...]:
    return (scheme, extra, *((None if t is None else (t.shape, t.dtype, t.stride(), t.device)) for t in tensors))


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
    *,
    indices: bool = True,
) -> Paged:
    """Check every argument the two ops share; raise :class:`KernelArgumentError` naming the bad one.

    Shape, dtype and layout checks run once per argument layout (cached); with ``indices`` also
    :func:`check_indices` (data-dependent, every call).
    """
    sig = _signature(scheme, (cache, block_table, num_tiles, *tail, *sink), (bsz, hq, d))
    if sig not in _CHECKED:
        _check_layout(scheme, bsz, hq, d, cache, block_table, num_tiles, tail, sink)
        if len(_CHECKED) > 1024:
            _CHECKED.clear()
        _CHECKED[sig] = True
    scale = sm_scale if sm_scale is not None else d**-0.5
    p = Paged(cache, *tail, *sink, scheme, scale)
    if indices:
        check_indices(p, block_table, num_tiles)
    return p


def _check_layout(
    scheme: Scheme,
    bsz: int,
    hq: int,
    d: int,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    sink: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
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
