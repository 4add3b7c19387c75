# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton bodies of fused paged decode attention (optionally split-K) and its split reduction.

One program serves one (sequence, KV head, split): the query heads of that KV head (GQA) are one
``[BLOCK_G, D]`` block, so every packed tile is read once for all of them. Tiles are unpacked and
dequantized in registers, never written back. With ``k = (code * ks + ko) * kf`` (keys: scale and
zero point per channel, factor per token) the scores are
``kf[t] * ((q * ks) . code[t] + q . ko)``; with ``v = (code * vs + vo) * vf`` the output update is
``vf * ((p * vs) @ code + p . vo)``: two small matrix products on raw codes per tile.
Scores use base 2 (``sm_scale * log2(e)`` is folded into the query). The packed part of the
context is attended in the rotated domain; the unquantized sink and tail tokens in the plain one;
the two accumulators are merged after un-rotating the first.

With in-tile sink tokens (``SINK_TOKENS > 0``) the exact copies are attended like a sink tile (in
split 0), and the scores of the same positions in tile 0 (also in split 0) are masked to -inf, so
their dequantized values weigh nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_codes(rec, tt, dd, BITS: tl.constexpr, T: tl.constexpr, D: tl.constexpr):
    """Unpack codes at token ``tt`` / channel ``dd`` (broadcastable int tensors) -> int32."""
    W0: tl.constexpr = 8 if BITS == 8 else (4 if BITS == 4 else 2)
    PER0: tl.constexpr = 8 // W0
    byte = tl.load(rec + tt * (D // PER0) + dd // PER0).to(tl.int32)
    code = (byte >> ((dd % PER0) * W0)) & ((1 << W0) - 1)
    if BITS == 3:  # second plane: the high bit, 8 channels per byte
        hi = tl.load(rec + T * D // 4 + tt * (D // 8) + dd // 8).to(tl.int32)
        code = code | (((hi >> (dd % 8)) & 1) << 2)
    return code


@triton.jit
def load_positive(rec, idx, lut_ptr, LOG8: tl.constexpr):
    """Stored scales or factors at ``rec`` (fp16, or log8 bytes through the table) -> float32."""
    if LOG8:
        return tl.load(lut_ptr + tl.load(rec + idx).to(tl.int32))
    return tl.load(rec.to(tl.pointer_type(tl.float16)) + idx).to(tl.float32)


@triton.jit
def load_offset(rec, idx, scale, LOG8: tl.constexpr):
    """Stored zero points: fp16 minimum, or signed byte times the decoded scale -> float32."""
    if LOG8:
        return tl.load(rec + idx).to(tl.int8, bitcast=True).to(tl.float32) * scale
    return tl.load(rec.to(tl.pointer_type(tl.float16)) + idx).to(tl.float32)


@triton.jit
def _softmax_step(s, m, lsum, acc_rot, acc_plain):
    """Online softmax: fold scores ``s`` [BLOCK_G, N] (base 2, -inf = masked) into (m, lsum, accs)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep every weight 0
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    return p, m_new, lsum, acc_rot * alpha[:, None], acc_plain * alpha[:, None]


@triton.jit
def _plain_tokens(kv_k, kv_v, n_valid, qs, m, lsum, acc_rot, acc_plain, stride_t, T: tl.constexpr, D: tl.constexpr):
    """Attend ``n_valid`` unquantized, unrotated tokens (sink or tail) at ``kv_k``/``kv_v``."""
    t = tl.arange(0, T)
    d = tl.arange(0, D)
    valid = t < n_valid
    kt = tl.load(kv_k + t[None, :] * stride_t + d[:, None], mask=valid[None, :], other=0.0).to(tl.float32)
    s = tl.dot(qs, kt)
    s = tl.where(valid[None, :], s, float("-inf"))
    p, m, lsum, acc_rot, acc_plain = _softmax_step(s, m, lsum, acc_rot, acc_plain)
    v = tl.load(kv_v + t[:, None] * stride_t + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    acc_plain += tl.dot(p, v)
    return m, lsum, acc_rot, acc_plain


@triton.jit
def decode_kernel(
    q_ptr,  # [B, Hq, D] unrotated
    stride_qb,
    stride_qh,
    cache_ptr,  # [num_blocks, Hkv, tile_bytes] uint8
    stride_cb,
    stride_ch,
    bt_ptr,  # [B, max_blocks] int32
    stride_btb,
    ntiles_ptr,  # [B] int32
    tail_k_ptr,  # [B, Hkv, T, D]
    tail_v_ptr,
    stride_tb,
    stride_th,
    stride_tt,
    tail_len_ptr,  # [B] int32
    sink_k_ptr,  # [B, Hkv, T, D] (ignored without HAS_SINK; SINK_TOKENS: copies of tile 0's first tokens)
    sink_v_ptr,
    stride_sb,
    stride_sh,
    stride_st,
    sink_len_ptr,
    rot_ptr,  # [D, D] float32
    lut_ptr,  # [256] float32
    out_ptr,  # SPLIT: [B, Hq, S, D] float32; else [B, Hq, D]
    ml_ptr,  # SPLIT: [B, Hq, S, 2] float32 (m, l); else unused
    stride_ob,
    stride_oh,
    qk_scale,  # sm_scale * log2(e)
    G: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,
    S: tl.constexpr,  # number of splits
    KB: tl.constexpr,
    VB: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    LOG8: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SINK_TOKENS: tl.constexpr,  # > 0: the sink copies replace tile 0's first tokens (needs HAS_SINK)
    KC: tl.constexpr,  # record section offsets
    VC: tl.constexpr,
    KS: tl.constexpr,
    KO: tl.constexpr,
    KF: tl.constexpr,
    VS: tl.constexpr,
    VO: tl.constexpr,
    VF: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    t = tl.arange(0, T)
    gmask = g < G
    q = tl.load(q_ptr + b * stride_qb + (hk * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    qs = q.to(tl.float32) * qk_scale
    if ROTATE:  # noqa: SIM108  (constexpr branches, not a runtime choice)
        qr = tl.dot(qs, tl.load(rot_ptr + d[:, None] * D + d[None, :]))
    else:
        qr = qs
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_G,), tl.float32)
    acc_rot = tl.zeros((BLOCK_G, D), tl.float32)
    acc_plain = tl.zeros((BLOCK_G, D), tl.float32)

    ntiles = tl.load(ntiles_ptr + b)
    if HAS_SINK:
        n_sink = tl.load(sink_len_ptr + b)
        if SINK_TOKENS > 0:  # before tile 0 is packed its tokens are in the tail: no copies then
            n_sink = tl.where(ntiles > 0, tl.minimum(tl.maximum(n_sink, 0), SINK_TOKENS), 0)
        if split == 0:
            sink = b.to(tl.int64) * stride_sb + hk * stride_sh
            m, lsum, acc_rot, acc_plain = _plain_tokens(
                sink_k_ptr + sink, sink_v_ptr + sink, n_sink, qs, m, lsum, acc_rot, acc_plain, stride_st, T, D,
            )  # fmt: skip

    per_split = tl.cdiv(ntiles, S)
    start = split * per_split
    end = tl.minimum(start + per_split, ntiles)
    for i in range(start, end):
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + i).to(tl.int64)
        rec = cache_ptr + blk * stride_cb + hk.to(tl.int64) * stride_ch
        kcode = load_codes(rec + KC, t[None, :], d[:, None], KB, T, D).to(tl.float32)  # [D, T]
        ks = load_positive(rec + KS, d, lut_ptr, LOG8)
        ko = load_offset(rec + KO, d, ks, LOG8)
        kf = load_positive(rec + KF, t, lut_ptr, LOG8)
        s = tl.dot(qr * ks[None, :], kcode) + tl.sum(qr * ko[None, :], axis=1)[:, None]
        s = s * kf[None, :]
        if SINK_TOKENS > 0:  # tile 0 is in split 0: its first n_sink tokens were attended exactly
            s = tl.where((i == 0) & (t[None, :] < n_sink), float("-inf"), s)
        p, m, lsum, acc_rot, acc_plain = _softmax_step(s, m, lsum, acc_rot, acc_plain)
        vcode = load_codes(rec + VC, t[:, None], d[None, :], VB, T, D).to(tl.float32)  # [T, D]
        vs = load_positive(rec + VS, t, lut_ptr, LOG8)
        vo = load_offset(rec + VO, t, vs, LOG8)
        vf = load_positive(rec + VF, d, lut_ptr, LOG8)
        pv = tl.dot(p * vs[None, :], vcode) + tl.sum(p * vo[None, :], axis=1)[:, None]
        acc_rot += pv * vf[None, :]

    if split == S - 1:
        tail = b.to(tl.int64) * stride_tb + hk * stride_th
        m, lsum, acc_rot, acc_plain = _plain_tokens(
            tail_k_ptr + tail, tail_v_ptr + tail, tl.load(tail_len_ptr + b), qs, m, lsum, acc_rot, acc_plain,
            stride_tt, T, D,
        )  # fmt: skip

    if ROTATE:  # un-rotate: acc @ R^T
        acc_rot = tl.dot(acc_rot, tl.load(rot_ptr + d[None, :] * D + d[:, None]))
    acc = acc_rot + acc_plain
    hq = hk * G + g
    if S == 1:
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
        o_ptr = out_ptr + b * stride_ob + hq[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        row = (b * (tl.num_programs(1) * G) + hq) * S + split  # [B, Hq, S] flattened
        tl.store(out_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, lsum, mask=gmask)


@triton.jit
def split_reduce_kernel(
    part_ptr,  # [B * Hq, S, D] float32 partial accumulators (unrotated)
    ml_ptr,  # [B * Hq, S, 2] float32 (m, l)
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    Hq,
    S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    D: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // Hq
    h = row % Hq
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    smask = s < S
    m = tl.load(ml_ptr + (row * S + s) * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(ml_ptr + (row * S + s) * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(part_ptr + (row * S + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_use)
    denom = tl.sum(w * lsum, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))
