"""The arguments every Triton attention launcher shares: checks of the tail and sink, and the
kernel's positional arguments and constexprs (:func:`context_args`)."""

from __future__ import annotations

import torch

from kvarn.codec.tiles import layout
from kvarn.kernels._checks import KernelArgumentError, check_rows, check_sink_given, log8_table, rotation
from kvarn.kernels.api import PagedContext


def check_staging(
    name: str,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    slot: torch.Tensor | None,
    bsz: int,
    hkv: int,
    d: int,
    dev: torch.device,
    rows: tuple[int, int],
) -> None:
    """Check a tail or sink: per sequence ``[B, Hkv, R, D]``, or a pool ``[slots, Hkv, R, D]`` with ``slot``.

    ``rows`` is the allowed range of ``R`` (inclusive); ``lens`` and ``slot`` are ``[B]`` int32.
    """
    check_rows(name, k, v, lens, slot, (bsz, hkv, d), dev, (torch.int32,))
    if slot is not None and k.shape[0] == 0 and bsz:
        raise KernelArgumentError(f"{name}_k is an empty pool (0 slots) but {bsz} sequences read it")
    lo, hi = rows
    if not lo <= k.shape[2] <= hi:
        want = str(lo) if lo == hi else f"{lo}..{hi}"
        raise KernelArgumentError(f"{name}_k holds {k.shape[2]} tokens per slot (axis 2); allowed: {want}")
    if k.stride() != v.stride():
        raise KernelArgumentError(
            f"{name}_k and {name}_v must have the same strides, got {k.stride()} and {v.stride()}"
        )


ROT_CHUNK = 16  # query rotation: channels of R per step (a [16, D] float32 slice of R at a time)


def context_args(ctx: PagedContext, bsz: int, d: int, block_t: int) -> tuple[list[object], dict[str, object]]:
    """Checks the tail and sink (per sequence or pools) and returns the shared kernel arguments.

    Positional: cache, block table, tiles, tail pool, sink pool, rotation, log8 table; keywords: the
    scheme's constexprs. Missing sink or slot tensors are replaced by any valid pointer (unread).
    """
    scheme, cache, block_table, num_tiles = ctx.scheme, ctx.cache, ctx.block_table, ctx.num_tiles
    dev, t, hkv = cache.device, scheme.group_size, cache.shape[1]
    tail_k, tail_v, tail_lens, tail_slot = ctx.tail_k, ctx.tail_v, ctx.tail_lens, ctx.tail_slot
    sink_k, sink_v, sink_lens, sink_slot = ctx.sink_k, ctx.sink_v, ctx.sink_lens, ctx.sink_slot
    check_staging("tail", tail_k, tail_v, tail_lens, tail_slot, bsz, hkv, d, dev, (t, t))
    if sink_k is not None and not scheme.sink_len:
        raise KernelArgumentError(f"scheme {scheme.name} keeps no sink: pass no sink_k, sink_v, sink_lens")
    check_sink_given(ctx)
    if sink_k is not None and sink_v is not None and sink_lens is not None:
        rows = (t, t) if scheme.sink_tile else (max(scheme.sink_tokens, 1), t)
        check_staging("sink", sink_k, sink_v, sink_lens, sink_slot, bsz, hkv, d, dev, rows)
        sk, sv, sl = sink_k, sink_v, sink_lens
    else:  # the kernel ignores these (HAS_SINK=False); any valid pointers do
        sk, sv, sl = tail_k, tail_v, tail_lens
    if cache.data_ptr() % 4:
        raise KernelArgumentError("cache must start on a 4-byte boundary (codes are read as int32 words)")
    lay = layout(scheme, d)
    args: list[object] = [
        cache, cache.stride(0), cache.stride(1), block_table, block_table.stride(0), num_tiles,
        tail_k, tail_v, tail_k.stride(0), tail_k.stride(1), tail_k.stride(2), tail_lens,
        tail_slot if tail_slot is not None else tail_lens,
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), sl, sink_slot if sink_slot is not None else sl,
        rotation(scheme.rotation, d, dev), log8_table(dev),
    ]  # fmt: skip
    consts: dict[str, object] = dict(
        KB=scheme.key_bits, VB=scheme.value_bits, T=t, D=d,
        BT=min(block_t, t), PT=32 if d <= 64 else 16, RK=ROT_CHUNK,
        LOG8=scheme.scale_dtype == "log8", ROTATE=scheme.rotation != "none",
        HAS_SINK=sink_k is not None, SINK_TOKENS=scheme.sink_tokens, SCAP=sk.shape[2],
        TAIL_SLOT=tail_slot is not None, SINK_SLOT=sink_slot is not None,
        KC=lay.key_codes, VC=lay.value_codes, KS=lay.key_scale, KO=lay.key_offset, KF=lay.key_factor,
        VS=lay.value_scale, VO=lay.value_offset, VF=lay.value_factor,
    )  # fmt: skip
    return args, consts
