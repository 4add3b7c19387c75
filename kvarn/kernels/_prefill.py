# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton bodies for prefill and chunked prefill: tile dequantization into a workspace, then causal
flash attention of the new query tokens over the dense workspace.

Correct first: the packed context is dequantized (and un-rotated) into a ``[B, Hkv, L, D]``
workspace once per call, so the attention kernel is a plain variable-length causal kernel. Query
token ``i`` of a sequence with ``q_len`` new and ``ctx_len`` total tokens sits at position
``ctx_len - q_len + i`` and sees keys ``0 ..`` that position.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._decode import load_codes, load_offset, load_positive


@triton.jit
def dequant_tiles_kernel(
    cache_ptr,  # [num_blocks, Hkv, tile_bytes] uint8
    stride_cb,
    stride_ch,
    bt_ptr,  # [B, max_blocks] int32
    stride_btb,
    ntiles_ptr,  # [B] int32
    first_ptr,  # [B] int32: workspace position of each sequence's first packed token
    rot_ptr,  # [D, D] float32
    lut_ptr,  # [256] float32
    ws_k_ptr,  # [B, Hkv, L, D] workspace
    ws_v_ptr,
    stride_wb,
    stride_wh,
    stride_wl,
    KB: tl.constexpr,
    VB: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    LOG8: tl.constexpr,
    ROTATE: tl.constexpr,
    KC: tl.constexpr,
    VC: tl.constexpr,
    KS: tl.constexpr,
    KO: tl.constexpr,
    KF: tl.constexpr,
    VS: tl.constexpr,
    VO: tl.constexpr,
    VF: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.program_id(1)
    hk = tl.program_id(2)
    if i < tl.load(ntiles_ptr + b):
        t = tl.arange(0, T)
        d = tl.arange(0, D)
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + i).to(tl.int64)
        rec = cache_ptr + blk * stride_cb + hk.to(tl.int64) * stride_ch
        ks = load_positive(rec + KS, d, lut_ptr, LOG8)
        k = load_codes(rec + KC, t[:, None], d[None, :], KB, T, D).to(tl.float32) * ks[None, :]
        k = (k + load_offset(rec + KO, d, ks, LOG8)[None, :]) * load_positive(rec + KF, t, lut_ptr, LOG8)[:, None]
        vs = load_positive(rec + VS, t, lut_ptr, LOG8)
        v = load_codes(rec + VC, t[:, None], d[None, :], VB, T, D).to(tl.float32) * vs[:, None]
        v = (v + load_offset(rec + VO, t, vs, LOG8)[:, None]) * load_positive(rec + VF, d, lut_ptr, LOG8)[None, :]
        if ROTATE:  # back to the plain domain: x @ R^T
            rt = tl.load(rot_ptr + d[None, :] * D + d[:, None])
            k = tl.dot(k, rt, input_precision="ieee")
            v = tl.dot(v, rt, input_precision="ieee")
        pos = tl.load(first_ptr + b) + i * T + t
        dst = b.to(tl.int64) * stride_wb + hk * stride_wh + pos[:, None].to(tl.int64) * stride_wl + d[None, :]
        tl.store(ws_k_ptr + dst, k.to(ws_k_ptr.dtype.element_ty))
        tl.store(ws_v_ptr + dst, v.to(ws_v_ptr.dtype.element_ty))


@triton.jit
def prefill_kernel(
    q_ptr,  # [total_q, Hq, D]
    stride_qt,
    stride_qh,
    cu_q_ptr,  # [B + 1] int32 query start offsets
    ctx_len_ptr,  # [B] int32 workspace tokens per sequence (cached + new)
    ws_k_ptr,  # [B, Hkv, L, D]
    ws_v_ptr,
    stride_wb,
    stride_wh,
    stride_wl,
    out_ptr,  # [total_q, Hq, D]
    stride_ot,
    stride_oh,
    qk_scale,  # sm_scale * log2(e)
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    hq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mb * BLOCK_M < q_len:
        ctx = tl.load(ctx_len_ptr + b)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        d = tl.arange(0, D)
        q_off = (q_start + rows).to(tl.int64)[:, None] * stride_qt + hq * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
        pos = ctx - q_len + rows  # absolute position of each query token
        kv = b.to(tl.int64) * stride_wb + (hq // G) * stride_wh
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        lsum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        last = tl.minimum(ctx, ctx - q_len + (mb + 1) * BLOCK_M)  # keys beyond the block's last row are masked
        for start in range(0, last, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cmask = cols < ctx
            k = tl.load(ws_k_ptr + kv + cols[None, :] * stride_wl + d[:, None], mask=cmask[None, :], other=0.0)
            s = tl.dot(q, k.to(tl.float32))
            s = tl.where(cmask[None, :] & (cols[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(s - m_use[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            v = tl.load(ws_v_ptr + kv + cols[:, None] * stride_wl + d[None, :], mask=cmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            m = m_new
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
        o_off = (q_start + rows).to(tl.int64)[:, None] * stride_ot + hq * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
