"""Argument checks of the CPU attention ops: layouts (cached per layout) and indices (host reads)."""

from __future__ import annotations

import torch

from kvarn.kernels._checks import (
    INDEX_DTYPES,
    KernelArgumentError,
    check_pages,
    check_rows,
    check_sink_given,
)
from kvarn.kernels.api import PagedContext

CPU = torch.device("cpu")


def check_indices(p: PagedContext) -> None:
    """The data-dependent checks (host reads): tile counts, slots. The native kernel does its own."""
    block_table, num_tiles = p.block_table, p.num_tiles
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


def _signature(ctx: PagedContext, extra: tuple[int, int, int]) -> tuple[object, ...]:
    tensors = (
        ctx.cache, ctx.block_table, ctx.num_tiles, ctx.tail_k, ctx.tail_v, ctx.tail_lens, ctx.tail_slot,
        ctx.sink_k, ctx.sink_v, ctx.sink_lens, ctx.sink_slot,
    )  # fmt: skip
    return (ctx.scheme, extra, *((None if t is None else (t.shape, t.dtype, t.stride(), t.device)) for t in tensors))


def check_context(ctx: PagedContext, bsz: int, hq: int, d: int, *, indices: bool = True) -> None:
    """Check every field of ``ctx`` for ``bsz`` sequences of ``hq`` query heads of ``head_dim`` ``d``;
    raise :class:`KernelArgumentError` naming the bad one.

    Shape, dtype and layout checks run once per argument layout (cached); with ``indices`` also
    :func:`check_indices` (data-dependent, every call).
    """
    sig = _signature(ctx, (bsz, hq, d))
    if sig not in _CHECKED:
        _check_layout(ctx, bsz, hq, d)
        if len(_CHECKED) > 1024:
            _CHECKED.clear()
        _CHECKED[sig] = True
    if indices:
        check_indices(ctx)


def _check_layout(ctx: PagedContext, bsz: int, hq: int, d: int) -> None:
    scheme = ctx.scheme
    hkv = check_pages(ctx, bsz, hq, d, CPU)
    tail_k, tail_v, tail_lens, tail_slot = ctx.tail_k, ctx.tail_v, ctx.tail_lens, ctx.tail_slot
    check_rows("tail", tail_k, tail_v, tail_lens, tail_slot, (bsz, hkv, d), CPU, INDEX_DTYPES)
    if tail_k.shape[2] != scheme.group_size:
        raise KernelArgumentError(f"tail_k must hold group_size={scheme.group_size} rows, got {tail_k.shape[2]}")
    sink_k, sink_v, sink_lens, sink_slot = ctx.sink_k, ctx.sink_v, ctx.sink_lens, ctx.sink_slot
    check_sink_given(ctx)
    if sink_k is not None and sink_v is not None and sink_lens is not None:
        check_rows("sink", sink_k, sink_v, sink_lens, sink_slot, (bsz, hkv, d), CPU, INDEX_DTYPES)
        if sink_k.shape[2] < scheme.sink_len:
            raise KernelArgumentError(
                f"sink_k holds {sink_k.shape[2]} rows; scheme {scheme.name} needs at least {scheme.sink_len}"
            )
