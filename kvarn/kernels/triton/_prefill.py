# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton body of prefill and chunked prefill: causal attention of new query tokens over the packed
context, the staged tokens and themselves, dequantizing tiles inside the attention loop.

One program serves ``BLOCK_M // GP`` consecutive new tokens of one sequence times the ``G`` query
heads of one KV head (``GP`` = ``G`` rounded up to a power of two; row ``r`` is token ``r // GP``,
head ``r % GP``), so each tile is read once per block of tokens for the whole group. Packed tiles
stream in sub-blocks of ``BT`` tokens exactly as in decode (:func:`attend_tiles`): no tile is ever
dequantized whole, no workspace is written. Sequence ``b``'s context, in token order: a sink tile
(``scheme.sink_tile``), its packed tiles, its tail, its new tokens; query token ``i`` of ``q_len``
sits at position ``cached + i`` and sees every cached token and new tokens ``0 .. i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.triton._decode import NEVER, attend_plain, attend_tiles, rotated_query, slot_of


@triton.jit
def prefill_kernel(
    q_ptr, stride_qt, stride_qh,  # [N, Hq, D] unrotated
    k_ptr, v_ptr, stride_kt, stride_kh,  # [N, Hkv, D] new keys and values, unrotated
    cu_q_ptr,  # [B + 1] int32 query start offsets
    cache_ptr, stride_cb, stride_ch,  # [num_blocks, Hkv, tile_bytes] uint8
    bt_ptr, stride_btb, ntiles_ptr,
    tail_k_ptr, tail_v_ptr, stride_tb, stride_th, stride_tt, tail_len_ptr, tail_slot_ptr,
    sink_k_ptr, sink_v_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr, sink_slot_ptr,
    rot_ptr, lut_ptr,
    out_ptr, stride_ot, stride_oh,  # [N, Hq, D] (not PARTIAL)
    part_ptr, ml_ptr,  # PARTIAL (ROTATE): [N * Hq, 1, 2, D], [N * Hq, 1, 2] float32
    qk_scale,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
    KB: tl.constexpr, VB: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    BT: tl.constexpr, PT: tl.constexpr, RK: tl.constexpr,
    LOG8: tl.constexpr, ROTATE: tl.constexpr,
    HAS_SINK: tl.constexpr, SINK_TOKENS: tl.constexpr, SCAP: tl.constexpr,
    TAIL_SLOT: tl.constexpr, SINK_SLOT: tl.constexpr,
    KC: tl.constexpr, VC: tl.constexpr, KS: tl.constexpr, KO: tl.constexpr, KF: tl.constexpr,
    VS: tl.constexpr, VO: tl.constexpr, VF: tl.constexpr,
):  # fmt: skip
    MT: tl.constexpr = BLOCK_M // GP  # new tokens per program
    mb = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mb * MT < q_len:
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        tok = mb * MT + r // GP
        gh = r % GP
        rmask = (tok < q_len) & (gh < G)
        tok_idx = (q_start + tl.minimum(tok, q_len - 1)).to(tl.int64)  # clamped: padded rows stay in bounds
        q_rows = q_ptr + tok_idx[:, None] * stride_qt + (hk * G + gh)[:, None] * stride_qh
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        lsum = tl.zeros((BLOCK_M,), tl.float32)
        acc_r = tl.zeros((BLOCK_M, D), tl.float32)

        ntiles = tl.load(ntiles_ptr + b)
        n_sink = 0
        if HAS_SINK:
            n_sink = tl.minimum(tl.maximum(tl.load(sink_len_ptr + b), 0), SCAP)
            if SINK_TOKENS > 0:
                n_sink = tl.where(ntiles > 0, tl.minimum(n_sink, SINK_TOKENS), 0)

        if ROTATE:
            qr = rotated_query(q_rows, rmask[:, None], rot_ptr, qk_scale, BLOCK_M, D, RK)
        else:
            qr = tl.load(q_rows + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
        m, lsum, acc_r = attend_tiles(
            cache_ptr, stride_cb, stride_ch, bt_ptr + b.to(tl.int64) * stride_btb, hk.to(tl.int64), 0, ntiles,
            n_sink, qr, m, lsum, acc_r, lut_ptr,
            KB, VB, T, D, BT, LOG8, SINK_TOKENS, KC, VC, KS, KO, KF, VS, VO, VF,
        )  # fmt: skip
        acc_p = tl.zeros((BLOCK_M, D), tl.float32)  # plain-token values, born after the tile loop

        no_limit = tl.full((BLOCK_M,), NEVER, tl.int32)
        if HAS_SINK:
            sslot = slot_of(sink_slot_ptr, b, SINK_SLOT)
            sink = sslot * stride_sb + hk * stride_sh
            m, lsum, acc_r, acc_p = attend_plain(
                sink_k_ptr + sink, sink_v_ptr + sink, stride_st, n_sink, no_limit, q_rows, rmask[:, None], qk_scale,
                m, lsum, acc_r, acc_p, BLOCK_M, PT, D, RK, ROTATE,
            )  # fmt: skip
        tslot = slot_of(tail_slot_ptr, b, TAIL_SLOT)
        tail = tslot * stride_tb + hk * stride_th
        n_tail = tl.minimum(tl.maximum(tl.load(tail_len_ptr + b), 0), T)
        m, lsum, acc_r, acc_p = attend_plain(
            tail_k_ptr + tail, tail_v_ptr + tail, stride_tt, n_tail, no_limit, q_rows, rmask[:, None], qk_scale,
            m, lsum, acc_r, acc_p, BLOCK_M, PT, D, RK, ROTATE,
        )  # fmt: skip
        new = q_start.to(tl.int64) * stride_kt + hk * stride_kh
        m, lsum, acc_r, acc_p = attend_plain(
            k_ptr + new, v_ptr + new, stride_kt, tl.minimum(q_len, (mb + 1) * MT), tok, q_rows, rmask[:, None],
            qk_scale, m, lsum, acc_r, acc_p, BLOCK_M, PT, D, RK, ROTATE,
        )  # fmt: skip

        hq = hk * G + gh
        if ROTATE:  # un-rotated by merge_kernel (one split)
            row = (q_start + tok).to(tl.int64) * (tl.num_programs(2) * G) + hq
            tl.store(part_ptr + (row * 2)[:, None] * D + d[None, :], acc_r, mask=rmask[:, None])
            tl.store(part_ptr + (row * 2 + 1)[:, None] * D + d[None, :], acc_p, mask=rmask[:, None])
            tl.store(ml_ptr + row * 2, m, mask=rmask)
            tl.store(ml_ptr + row * 2 + 1, lsum, mask=rmask)
        else:
            out = acc_r / tl.where(lsum > 0, lsum, 1.0)[:, None]
            o_rows = (q_start + tok).to(tl.int64)[:, None] * stride_ot + hq[:, None] * stride_oh
            tl.store(out_ptr + o_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
