# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton body of prefill and chunked prefill: causal attention of new query tokens over the packed
context, the staged tokens and themselves, dequantizing tiles inside the attention loop.

One program serves ``BLOCK_M // GP`` consecutive new tokens of one sequence times the ``G`` query
heads of one KV head (``GP`` = ``G`` rounded up to a power of two; row ``r`` is token ``r // GP``,
head ``r % GP``), so each tile is read once per block of tokens for the whole group. The cached
context is attended exactly as in decode (:func:`._attend.attend_context`, one split): packed tiles
stream in sub-blocks of ``BT`` tokens, no tile is ever dequantized whole, no workspace is written.
Sequence ``b``'s context, in token order: a sink tile (``scheme.sink_tile``), its packed tiles, its
tail, its new tokens; query token ``i`` of ``q_len`` sits at position ``cached + i`` and sees every
cached token and new tokens ``0 .. i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.triton._attend import attend_context, attend_plain, store_result


@triton.jit
def prefill_kernel(
    q_ptr, stride_qt, stride_qh,  # [N, Hq, D] unrotated
    k_ptr, v_ptr, stride_kt, stride_kh,  # [N, Hkv, D] new keys and values, unrotated
    cu_q_ptr,  # [B + 1] int32 query start offsets
    context,  # cache, block table, tiles, tail and sink pools, rotation, log8 table (_args.context_args)
    out_ptr, stride_ot, stride_oh,  # [N, Hq, D] (not ROTATE)
    part_ptr, ml_ptr,  # ROTATE: [N * Hq, 1, 2, D], [N * Hq, 1, 2] float32
    qk_scale,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    MT: tl.constexpr = BLOCK_M // GP  # new tokens per program
    mb = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mb * MT < q_len:
        r = tl.arange(0, BLOCK_M)
        tok = mb * MT + r // GP
        gh = r % GP
        rmask = (tok < q_len) & (gh < G)
        tok_idx = (q_start + tl.minimum(tok, q_len - 1)).to(tl.int64)  # clamped: padded rows stay in bounds
        q_rows = q_ptr + tok_idx[:, None] * stride_qt + (hk * G + gh)[:, None] * stride_qh
        m, lsum, acc_r, acc_p = attend_context(context, b, hk, 0, q_rows, rmask[:, None], qk_scale, BLOCK_M, 1, C)
        new = q_start.to(tl.int64) * stride_kt + hk * stride_kh
        m, lsum, acc_r, acc_p = attend_plain(
            k_ptr + new, v_ptr + new, stride_kt, tl.minimum(q_len, (mb + 1) * MT), tok, q_rows, rmask[:, None],
            qk_scale, m, lsum, acc_r, acc_p, BLOCK_M, C,
        )  # fmt: skip
        hq = hk * G + gh
        row = (q_start + tok).to(tl.int64) * (tl.num_programs(2) * G) + hq  # ROTATE: un-rotated by merge_kernel
        o_rows = out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot + hq[:, None] * stride_oh
        store_result(o_rows, part_ptr, ml_ptr, row, m, lsum, acc_r, acc_p, rmask, rmask, C.ROTATE, 2, C.D)
