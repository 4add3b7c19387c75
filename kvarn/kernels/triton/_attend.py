# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton helpers both attention kernels (decode, prefill) share: reading packed tiles, the online
softmax, and the attention of one sequence's cached context (:func:`attend_context`).

A tile is streamed in sub-blocks of ``BT`` tokens: packed codes load as int32 words (``D * bits /
32`` per token row), unpack in registers and enter ``tl.dot`` as float16 (codes of up to 8 bits
are exact there); the float side of each product is scaled per row into [-1, 1] and rounded to
float16 (:func:`to_fp16_rows`): 11 mantissa bits on one operand, against TF32's 10 on both; one
fp16 part only, since a second, low part costs registers for the ``[16, D]`` operand every warp
holds whole. float16, not bfloat16, because the interpreter's bfloat16 dots cannot be checked
against the reference on CPU. Unquantized tokens use three TF32 products. With ``k = (code * ks +
ko) * kf`` (keys: scale and zero point per channel, factor per token) the scores are ``kf[t] * ((q
* ks) . code[t] + q . ko)``; with ``v = (code * vs + vo) * vf`` the output update is ``vf * ((p *
vs) @ code + p . vo)``. Scores use base 2 (``sm_scale * log2(e)`` is folded into the query). The
packed part of the context is attended in the rotated domain (``acc_r``); unquantized sink and tail
tokens in the plain one (``acc_p``). The query is rotated in chunks of ``RK`` channels, so no ``[D,
D]`` matrix is ever held whole (at head_dim 256 it alone is 256 KiB).

With in-tile sink tokens (``SINK_TOKENS > 0``) the exact copies are attended like a sink tile (in
split 0), and the scores of the same positions in tile 0 (also in split 0) are masked to -inf, so
their dequantized values weigh nothing.

Arguments the kernels pass through unchanged: ``context``, the tuple
:func:`kvarn.kernels.triton._args.context_args` builds (cache, block table, tile counts, the tail
and sink as ``staging`` tuples ``(k, v, stride_slot, stride_h, stride_t, lens, slot)``, rotation,
log8 table), and ``C``, its constexprs (:class:`kvarn.kernels.triton._args.ContextConstants`).
"""

from __future__ import annotations

import triton
import triton.language as tl

NEVER = tl.constexpr(1 << 30)  # a key index no query row reaches: "no causal limit"


@triton.jit
def load_plane(rec, t0, W: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    """One ``W``-bit code plane of tokens ``t0 .. t0+BT-1`` at byte pointer ``rec`` -> ``[BT, D]`` int32.

    A token's row of the plane is ``D * W / 32`` little-endian int32 words; channel ``j`` of a word
    sits at bits ``j*W .. j*W+W-1`` (the byte packing of ``kvarn.codec.pack`` read 4 bytes at a time).
    """
    PER: tl.constexpr = 32 // W
    NW: tl.constexpr = D // PER
    words = rec.to(tl.pointer_type(tl.int32))
    tt = t0 + tl.arange(0, BT)
    w = tl.load(words + tt[:, None] * NW + tl.arange(0, NW)[None, :])  # [BT, NW]
    shifts = tl.arange(0, PER) * W
    codes = (w[:, :, None] >> shifts[None, None, :]) & ((1 << W) - 1)  # [BT, NW, PER]
    return tl.reshape(codes, (BT, D))


@triton.jit
def load_code_block(rec, t0, BITS: tl.constexpr, BT: tl.constexpr, T: tl.constexpr, D: tl.constexpr):
    """Codes of tokens ``t0 .. t0+BT-1`` of one code section (4-byte aligned) -> ``[BT, D]`` int32."""
    W0: tl.constexpr = 8 if BITS == 8 else (4 if BITS == 4 else 2)
    code = load_plane(rec, t0, W0, BT, D)
    if BITS == 3:  # second plane: the high bit, after the whole 2-bit plane
        code = code | (load_plane(rec + T * D // 4, t0, 1, BT, D) << 2)
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
def to_fp16_rows(a):
    """``a`` ``[M, K]`` float32 -> ``(h, scale)``: ``a ~= h * scale[:, None]``, ``h`` fp16 in [-1, 1].

    Scaling each row by its largest magnitude first means no fp16 overflow whatever the scales,
    and 11 mantissa bits relative to the row's largest entry (TF32 keeps 10, on both operands).
    """
    scale = tl.max(tl.abs(a), axis=1)
    scale = tl.where(scale > 0, scale, 1.0)
    return (a * (1.0 / scale)[:, None]).to(tl.float16), scale


@triton.jit
def dot_exact(a, b):
    """``a @ b`` for float32 ``a`` and staged tokens ``b`` (any float dtype): three TF32 products."""
    return tl.dot(a, b.to(tl.float32), input_precision="tf32x3")


@triton.jit
def slot_of(slot_ptr, b, POOL: tl.constexpr):
    """Staging slot of sequence ``b`` (int64): ``slot_ptr[b]`` for a pool, else ``b`` itself."""
    if POOL:
        return tl.load(slot_ptr + b).to(tl.int64)
    return b.to(tl.int64)


@triton.jit
def softmax_step(s, m, lsum):
    """Online softmax: fold scores ``s`` [M, N] (base 2, -inf = masked) into (m, lsum).

    Returns ``(p, m, lsum, alpha)``: weights, new maximum and sum, and the factor for old accumulators.
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep every weight 0
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, m_new, lsum * alpha + tl.sum(p, axis=1), alpha


@triton.jit
def rotated_query(q_rows, qmask, rot_ptr, qk_scale, M: tl.constexpr, D: tl.constexpr, RK: tl.constexpr):
    """``(q @ R) * qk_scale`` for query rows at ``q_rows`` (``[M, 1]`` pointers) -> ``[M, D]`` float32.

    R streams in ``[RK, D]`` row chunks, the query in matching column chunks (full fp32 products).
    """
    d = tl.arange(0, D)
    qr = tl.zeros((M, D), tl.float32)
    for k0 in range(0, D, RK):
        kk = k0 + tl.arange(0, RK)
        qc = tl.load(q_rows + kk[None, :], mask=qmask, other=0.0).to(tl.float32)
        qr += tl.dot(qc, tl.load(rot_ptr + kk[:, None] * D + d[None, :]), input_precision="ieee")
    return qr * qk_scale


@triton.jit
def attend_tiles(
    cache_ptr, stride_cb, stride_ch, bt_row, hk, first, last, n_sink, qr, m, lsum, acc_r, lut_ptr, C: tl.constexpr
):
    """Attend packed tiles ``first .. last-1`` of ``bt_row`` (rotated query ``qr`` [M, D], scaled).

    Tile 0's first ``n_sink`` positions are masked when ``C.SINK_TOKENS`` (their exact copies are
    attended as plain tokens). Returns the updated ``(m, lsum, acc_r)``.
    """
    T: tl.constexpr = C.T
    D: tl.constexpr = C.D
    BT: tl.constexpr = C.BT
    LOG8: tl.constexpr = C.LOG8
    d = tl.arange(0, D)
    for i in range(first, last):
        blk = tl.load(bt_row + i).to(tl.int64)
        rec = cache_ptr + blk * stride_cb + hk * stride_ch
        ks = load_positive(rec + C.KS, d, lut_ptr, LOG8)
        qk, qk_scale = to_fp16_rows(qr * ks[None, :])
        qo = tl.sum(qr * load_offset(rec + C.KO, d, ks, LOG8)[None, :], axis=1)
        vf = load_positive(rec + C.VF, d, lut_ptr, LOG8)
        for t0 in range(0, T, BT):
            tt = t0 + tl.arange(0, BT)
            kc = tl.trans(load_code_block(rec + C.KC, t0, C.KB, BT, T, D).to(tl.float16))  # [D, BT]
            s = tl.dot(qk, kc) * qk_scale[:, None] + qo[:, None]
            s = s * load_positive(rec + C.KF, tt, lut_ptr, LOG8)[None, :]
            if C.SINK_TOKENS > 0:
                s = tl.where((i == 0) & (tt[None, :] < n_sink), float("-inf"), s)
            p, m, lsum, alpha = softmax_step(s, m, lsum)
            vs = load_positive(rec + C.VS, tt, lut_ptr, LOG8)
            vo = load_offset(rec + C.VO, tt, vs, LOG8)
            vc = load_code_block(rec + C.VC, t0, C.VB, BT, T, D).to(tl.float16)  # [BT, D]
            pw, pw_scale = to_fp16_rows(p * vs[None, :])
            pv = tl.dot(pw, vc) * pw_scale[:, None] + tl.sum(p * vo[None, :], axis=1)[:, None]
            acc_r = acc_r * alpha[:, None] + pv * vf[None, :]
    return m, lsum, acc_r


@triton.jit
def attend_plain(
    k_ptr, v_ptr, stride_t, n_keys, row_last, q_rows, qmask, qk_scale, m, lsum, acc_r, acc_p,
    M: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """Attend ``n_keys`` unquantized, unrotated keys (rows ``stride_t`` apart at ``k_ptr``/``v_ptr``).

    The query (``q_rows`` ``[M, 1]`` pointers, masked by ``qmask``) is read in chunks of ``C.RK``
    channels for the scores, so no ``[M, D]`` float32 dot operand is held whole (at head_dim 256
    it alone would not fit in registers). Query row ``r`` sees key ``j`` only when ``j <= row_last[r]``
    (causal new tokens; ``NEVER`` otherwise). The values go to ``acc_p`` when ``C.ROTATE`` (merged
    after un-rotating ``acc_r``), else straight into ``acc_r``. Returns ``(m, lsum, acc_r, acc_p)``.
    """
    PT: tl.constexpr = C.PT
    DC: tl.constexpr = C.RK
    D: tl.constexpr = C.D
    d = tl.arange(0, D)
    for j0 in range(0, n_keys, PT):
        j = j0 + tl.arange(0, PT)
        valid = j < n_keys
        s = tl.zeros((M, PT), tl.float32)
        for c0 in range(0, D, DC):
            cc = c0 + tl.arange(0, DC)
            qc = tl.load(q_rows + cc[None, :], mask=qmask, other=0.0).to(tl.float32)
            kc = tl.load(k_ptr + j[:, None] * stride_t + cc[None, :], mask=valid[:, None], other=0.0)
            s += dot_exact(qc, tl.trans(kc))
        s = tl.where(valid[None, :] & (j[None, :] <= row_last[:, None]), s * qk_scale, float("-inf"))
        p, m, lsum, alpha = softmax_step(s, m, lsum)
        pv = dot_exact(p, tl.load(v_ptr + j[:, None] * stride_t + d[None, :], mask=valid[:, None], other=0.0))
        acc_r = acc_r * alpha[:, None]
        if C.ROTATE:
            acc_p = acc_p * alpha[:, None] + pv
        else:
            acc_r += pv
    return m, lsum, acc_r, acc_p


@triton.jit
def attend_staged(
    staging, b, hk, n_keys, q_rows, qmask, qk_scale, m, lsum, acc_r, acc_p,
    M: tl.constexpr, POOL: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """Attend rows ``0 .. n_keys-1`` of sequence ``b``'s tail or sink (``staging``; read at the
    sequence's slot when ``POOL``), KV head ``hk``, all visible. Returns ``(m, lsum, acc_r, acc_p)``."""
    k_ptr, v_ptr, stride_slot, stride_h, stride_t, lens_ptr, slot_ptr = staging
    base = slot_of(slot_ptr, b, POOL) * stride_slot + hk * stride_h
    no_limit = tl.full((M,), NEVER, tl.int32)
    return attend_plain(
        k_ptr + base, v_ptr + base, stride_t, n_keys, no_limit, q_rows, qmask, qk_scale, m, lsum, acc_r, acc_p, M, C
    )


@triton.jit
def attend_context(context, b, hk, split, q_rows, qmask, qk_scale, M: tl.constexpr, S: tl.constexpr, C: tl.constexpr):
    """Attend sequence ``b``'s cached context through KV head ``hk`` for ``M`` query rows (``q_rows``
    ``[M, 1]`` pointers to unrotated queries, masked by ``qmask``): split ``split`` of ``S`` of its
    packed tiles, the sink in split 0 and the tail in split ``S - 1``.

    Returns the online-softmax state ``(m, lsum, acc_r, acc_p)``: ``acc_r`` ``[M, D]`` float32 in
    the rotated domain (the plain one when not ``C.ROTATE``), ``acc_p`` the plain tokens' values
    when ``C.ROTATE``.
    """
    cache_ptr, stride_cb, stride_ch, bt_ptr, stride_btb, ntiles_ptr, tail, sink, rot_ptr, lut_ptr = context
    D: tl.constexpr = C.D
    m = tl.full((M,), float("-inf"), tl.float32)
    lsum = tl.zeros((M,), tl.float32)
    acc_r = tl.zeros((M, D), tl.float32)

    ntiles = tl.load(ntiles_ptr + b)
    n_sink = 0
    if C.HAS_SINK:
        n_sink = tl.minimum(tl.maximum(tl.load(sink[5] + b), 0), C.SCAP)  # sink[5]: sink_lens
        if C.SINK_TOKENS > 0:  # before tile 0 is packed its tokens are in the tail: no copies then
            n_sink = tl.where(ntiles > 0, tl.minimum(n_sink, C.SINK_TOKENS), 0)

    per_split = tl.cdiv(ntiles, S)
    start = split * per_split
    if C.ROTATE:
        qr = rotated_query(q_rows, qmask, rot_ptr, qk_scale, M, D, C.RK)
    else:
        qr = tl.load(q_rows + tl.arange(0, D)[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
    m, lsum, acc_r = attend_tiles(
        cache_ptr, stride_cb, stride_ch, bt_ptr + b.to(tl.int64) * stride_btb, hk.to(tl.int64), start,
        tl.minimum(start + per_split, ntiles), n_sink, qr, m, lsum, acc_r, lut_ptr, C,
    )  # fmt: skip
    acc_p = tl.zeros((M, D), tl.float32)  # plain-token values, born after the tile loop

    # plain tokens after the tiles, in the first split (sink) and the last (tail); order is free
    # in an online softmax, and the tile loop then holds only the rotated query
    if (split == 0) | (split == S - 1):
        if C.HAS_SINK:  # noqa: SIM102  (a constexpr, then a runtime condition)
            if split == 0:
                m, lsum, acc_r, acc_p = attend_staged(
                    sink, b, hk, n_sink, q_rows, qmask, qk_scale, m, lsum, acc_r, acc_p, M, C.SINK_SLOT, C
                )
        if split == S - 1:
            n_tail = tl.minimum(tl.maximum(tl.load(tail[5] + b), 0), C.T)  # tail[5]: tail_lens
            m, lsum, acc_r, acc_p = attend_staged(
                tail, b, hk, n_tail, q_rows, qmask, qk_scale, m, lsum, acc_r, acc_p, M, C.TAIL_SLOT, C
            )
    return m, lsum, acc_r, acc_p


@triton.jit
def store_result(
    o_rows, part_ptr, ml_ptr, row, m, lsum, acc_r, acc_p, mask, plain_mask,
    PARTIAL: tl.constexpr, NACC: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Write rows' attention: normalized into ``o_rows`` (``[M, 1]`` output pointers), or, when
    ``PARTIAL``, the accumulators into ``part_ptr`` ``[rows, NACC, D]`` (``acc_p`` second, where
    ``plain_mask``, when ``NACC == 2``) and ``(m, lsum)`` into ``ml_ptr`` ``[rows, 2]`` at ``row``."""
    d = tl.arange(0, D)
    if PARTIAL:
        tl.store(part_ptr + (row * NACC)[:, None] * D + d[None, :], acc_r, mask=mask[:, None])
        if NACC == 2:
            tl.store(part_ptr + (row * NACC + 1)[:, None] * D + d[None, :], acc_p, mask=plain_mask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=mask)
        tl.store(ml_ptr + row * 2 + 1, lsum, mask=mask)
    else:
        out = acc_r / tl.where(lsum > 0, lsum, 1.0)[:, None]
        tl.store(o_rows + d[None, :], out.to(o_rows.dtype.element_ty), mask=mask[:, None])
