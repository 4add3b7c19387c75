"""The arguments every Triton attention launcher shares: checks of the tail and sink, and the
kernels' ``context`` argument and its constexprs (:func:`context_args`)."""

from __future__ import annotations

from typing import NamedTuple

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


class ContextConstants(NamedTuple):
    """The constexprs of a context, one ``tl.constexpr`` argument ``C`` of the attention kernels
    (read as ``C.D``, ``C.ROTATE``, ...; every field is part of the compiled variant's key)."""

    KB: int  # key bits
    VB: int  # value bits
    T: int  # tokens per tile (group_size)
    D: int  # head_dim
    BT: int  # tile tokens per sub-block
    PT: int  # plain (sink, tail, new) tokens per block
    RK: int  # query channels per rotation or score chunk
    LOG8: bool  # scales and factors stored as log8 bytes (else fp16)
    ROTATE: bool  # the scheme rotates (the kernels attend tiles in the rotated domain)
    HAS_SINK: bool  # a sink is passed
    SINK_TOKENS: int  # exact copies of tile 0's first tokens (0: none, or a sink tile)
    SCAP: int  # sink rows per slot
    TAIL_SLOT: bool  # the tail is a pool read at tail_slot
    SINK_SLOT: bool  # the sink is a pool read at sink_slot
    KC: int  # byte offsets of the record's sections (kvarn.codec.tiles.layout)
    VC: int
    KS: int
    KO: int
    KF: int
    VS: int
    VO: int
    VF: int


def context_args(ctx: PagedContext, bsz: int, d: int, block_t: int) -> tuple[tuple[object, ...], ContextConstants]:
    """Checks the tail and sink (per sequence or pools) and returns the kernels' ``context``
    argument and its constexprs ``C``.

    ``context``: ``(cache, stride_cb, stride_ch, block_table, stride_btb, num_tiles, tail, sink,
    rotation, log8 table)`` with ``tail`` and ``sink`` as ``(k, v, stride_slot, stride_h, stride_t,
    lens, slot)``. Missing sink or slot tensors are replaced by any valid pointer (unread).
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
    tail = (tail_k, tail_v, *tail_k.stride()[:3], tail_lens, tail_slot if tail_slot is not None else tail_lens)
    sink = (sk, sv, *sk.stride()[:3], sl, sink_slot if sink_slot is not None else sl)
    context = (
        cache, cache.stride(0), cache.stride(1), block_table, block_table.stride(0), num_tiles, tail, sink,
        rotation(scheme.rotation, d, dev), log8_table(dev),
    )  # fmt: skip
    consts = ContextConstants(
        KB=scheme.key_bits, VB=scheme.value_bits, T=t, D=d,
        BT=min(block_t, t), PT=32 if d <= 64 else 16, RK=ROT_CHUNK,
        LOG8=scheme.scale_dtype == "log8", ROTATE=scheme.rotation != "none",
        HAS_SINK=sink_k is not None, SINK_TOKENS=scheme.sink_tokens, SCAP=sk.shape[2],
        TAIL_SLOT=tail_slot is not None, SINK_SLOT=sink_slot is not None,
        KC=lay.key_codes, VC=lay.value_codes, KS=lay.key_scale, KO=lay.key_offset, KF=lay.key_factor,
        VS=lay.value_scale, VO=lay.value_offset, VF=lay.value_factor,
    )  # fmt: skip
    return context, consts
