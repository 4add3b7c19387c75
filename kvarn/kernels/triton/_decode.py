# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton bodies of fused paged decode attention (optionally split-K) and of the merge kernel that
combines split partials and un-rotates.

One program serves one (sequence, KV head, split): the query heads of that KV head (GQA) are one
``[BLOCK_G, D]`` block, so every packed tile is read once for all of them. How tiles and plain
tokens are attended: :mod:`._attend`. The output is un-rotated by :func:`merge_kernel` in chunks
of columns, so no ``[D, D]`` matrix is ever held whole.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.triton._attend import attend_context, store_result


@triton.jit
def decode_kernel(
    q_ptr, stride_qb, stride_qh,  # [B, Hq, D] unrotated
    context,  # cache, block table, tiles, tail and sink pools, rotation, log8 table (_args.context_args)
    out_ptr, stride_ob, stride_oh,  # [B, Hq, D] (not PARTIAL)
    part_ptr, ml_ptr,  # PARTIAL: [B * Hq, S, NACC, D] float32 accumulators, [B * Hq, S, 2] float32 (m, l)
    qk_scale,  # sm_scale * log2(e)
    G: tl.constexpr, BLOCK_G: tl.constexpr, S: tl.constexpr, PARTIAL: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + (hk * G + g)[:, None] * stride_qh
    m, lsum, acc_r, acc_p = attend_context(context, b, hk, split, q_rows, gmask[:, None], qk_scale, BLOCK_G, S, C)
    hq = hk * G + g
    row = (b * (tl.num_programs(1) * G) + hq) * S + split  # PARTIAL: [B, Hq, S] flattened
    # only the first and last split attend plain tokens; the merge reads only theirs
    plain_rows = gmask & ((g * 0 + split == 0) | (g * 0 + split == S - 1))
    o_rows = out_ptr + b.to(tl.int64) * stride_ob + hq[:, None] * stride_oh
    store_result(
        o_rows, part_ptr, ml_ptr, row, m, lsum, acc_r, acc_p, gmask, plain_rows, PARTIAL, 2 if C.ROTATE else 1, C.D
    )


@triton.jit
def merge_kernel(
    part_ptr,  # [rows, S, NACC, D] float32 accumulators (NACC = 2: rotated, plain)
    ml_ptr,  # [rows, S, 2] float32 (m, l)
    rot_ptr,  # [D, D] float32
    out_ptr,  # [B, Hq, D]: row = b * Hq + h
    stride_ob,
    stride_oh,
    Hq,
    S: tl.constexpr,
    D: tl.constexpr,
    BJ: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """Output columns ``BJ * pid(1) ..`` of one row: ``(sum_s w_s acc_r[s]) @ R^T + sum_s w_s acc_p[s]``, normalized."""
    row = tl.program_id(0)
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    d = tl.arange(0, D)
    NACC: tl.constexpr = 2 if ROTATE else 1
    m_max = tl.load(ml_ptr + row * S * 2)
    for s in range(1, S):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (row * S + s) * 2))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = 0.0
    rot = tl.zeros((D,), tl.float32)
    plain = tl.zeros((BJ,), tl.float32)
    for s in range(S):
        w = tl.exp2(tl.load(ml_ptr + (row * S + s) * 2) - m_use)
        denom += w * tl.load(ml_ptr + (row * S + s) * 2 + 1)
        base = part_ptr + (row * S + s).to(tl.int64) * NACC * D
        if ROTATE:
            rot += w * tl.load(base + d)
        else:
            plain += w * tl.load(base + j)
    if ROTATE:  # plain tokens: first split (sink) and last (tail) only; then acc @ R^T: sum_d acc[d] * R[j, d]
        for s in tl.static_range(2 if S > 1 else 1):
            sp = s * (S - 1)
            w = tl.exp2(tl.load(ml_ptr + (row * S + sp) * 2) - m_use)
            plain += w * tl.load(part_ptr + ((row * S + sp).to(tl.int64) * 2 + 1) * D + j)
        plain += tl.sum(tl.load(rot_ptr + j[:, None] * D + d[None, :]) * rot[None, :], axis=1)
    out = plain / tl.where(denom > 0, denom, 1.0)
    b = row // Hq
    h = row % Hq
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + j, out.to(out_ptr.dtype.element_ty))
