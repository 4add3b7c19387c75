"""Triton launchers: check arguments, allocate outputs, choose the grid, call the kernels.

The ops of :class:`~kvarn.kernels.api.AttentionOps` over a :class:`~kvarn.kernels.api.PagedContext`
(layout and token order in :mod:`kvarn.kernels.api`); the ``@triton.jit`` bodies live in
``_store.py``, ``_decode.py`` and ``_prefill.py`` (with ``_attend.py``), launch options in
:mod:`.configs`. Every kernel is specialized through ``tl.constexpr`` on the scheme (bits, group
size, head_dim, rotation, iterations, scale storage, sink): one source for every scheme. Neither
attention op synchronises with the host, so decode steps can be captured in CUDA graphs. Without
CUDA the kernels run under ``TRITON_INTERPRET=1`` (correctness only).
"""

from __future__ import annotations

import math

import torch
import triton

from kvarn.codec.tiles import layout
from kvarn.kernels._checks import (
    KernelArgumentError,
    check_pages,
    check_prefill,
    check_query,
    check_scheme,
    check_store,
    log8_table,
    output_buffer,
    refuse_non_finite,
    rotation,
)
from kvarn.kernels.api import PagedContext
from kvarn.kernels.triton._args import context_args
from kvarn.kernels.triton._decode import decode_kernel, merge_kernel
from kvarn.kernels.triton._prefill import prefill_kernel
from kvarn.kernels.triton._store import store_side_kernel
from kvarn.kernels.triton.configs import (
    KernelConfig,
    choose_num_splits,
    decode_configs,
    prefill_configs,
    store_configs,
)
from kvarn.schemes.scheme import Scheme

__all__ = ["decode_attention", "prefill_attention", "quantize_tiles_triton", "store_tiles"]


def _check_apart(cache: torch.Tensor, num_kv_heads: int) -> None:
    """Records may lie in wider pages (``pages[:, :, :tile_bytes]`` of a mixed-bit preset's layer):
    the kernels take the block and head strides; records must not overlap."""
    if cache.stride(1) < cache.shape[2] or cache.stride(0) < cache.stride(1) * num_kv_heads:
        raise KernelArgumentError(
            f"cache records overlap: strides {cache.stride()} for shape {list(cache.shape)} (each head's record "
            f"needs {cache.shape[2]} bytes, each block {num_kv_heads} records)"
        )


def store_tiles(
    keys: torch.Tensor,
    values: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    scheme: Scheme,
    *,
    check_finite: bool = False,
    config: KernelConfig | None = None,
) -> None:
    """Quantize and pack full tiles into the paged cache, in place.

    Args:
        keys: ``[N, num_kv_heads, group_size, head_dim]`` fp16/bf16/fp32, unrotated; any strides with
            a contiguous last axis (a permuted ``[N, group_size, num_kv_heads, head_dim]`` works).
        values: same shape and dtype as ``keys``.
        cache: ``[num_blocks, num_kv_heads, tile_bytes]`` uint8; record ``cache[block_ids[n], h]``
            is overwritten with the record of tile ``n``, head ``h``.
        block_ids: ``[N]`` int32/int64 destination blocks (the slot mapping, one entry per tile).
        scheme: a scheme without per-layer overrides.
        check_finite: refuse inf/NaN like the reference codec (costs a device sync).
        config: launch options for both sides; default per side ``configs.store_configs(scheme, d,
            bits)[0]`` (``block_m``/``block_n``: tokens per row chunk and channels per column chunk).

    Allocates a float32 workspace of ``N * num_kv_heads * (T * D + 10 * (T + D))`` elements (74 KiB
    per tile at 128 x 128; from the caching allocator, so also inside a CUDA graph capture).
    """
    dev = keys.device
    n, h, t, d = check_store(keys, values, cache, block_ids, scheme, dev)
    _check_apart(cache, h)
    if n == 0:
        return
    if check_finite:
        refuse_non_finite(keys, values)
    lay = layout(scheme, d)
    rot = rotation(scheme.rotation, d, dev)
    lut = log8_table(dev)
    block_ids = block_ids.contiguous()
    # each program streams its rotated tile and a few vectors through its own workspace row (L1/L2
    # resident) instead of holding [T, D] float32 in registers; both sides reuse it (same stream)
    work = torch.empty(n * h, t * d + 10 * (t + d), dtype=torch.float32, device=dev)
    compiled = isinstance(store_side_kernel, triton.runtime.JITFunction)  # False under TRITON_INTERPRET=1
    sides = (
        (keys, lay.key_codes, lay.key_scale, lay.key_offset, lay.key_factor, scheme.key_bits, True),
        (values, lay.value_codes, lay.value_scale, lay.value_offset, lay.value_factor, scheme.value_bits, False),
    )
    for x, code_off, s_off, o_off, f_off, bits, per_channel in sides:
        cfg = config or store_configs(scheme, d, bits)[0]
        # chunks bound registers on a GPU; the interpreter (numpy) is fastest with one chunk per pass
        rows, cols = (cfg.block_m, cfg.block_n) if compiled or config else (t, d)
        if t % rows or d % cols:
            raise KernelArgumentError(f"store config block_m={rows}, block_n={cols} must divide tile {t} x {d}")
        store_side_kernel[(n * h,)](
            x,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            rot,
            lut,
            cache,
            cache.stride(0),
            cache.stride(1),
            block_ids,
            work,
            h,
            CODE_OFF=code_off,
            SCALE_OFF=s_off,
            OFFSET_OFF=o_off,
            FACTOR_OFF=f_off,
            BITS=bits,
            PER_CHANNEL=per_channel,
            T=t,
            D=d,
            ITERS=scheme.norm_iters,
            LOG8=scheme.scale_dtype == "log8",
            ROTATE=scheme.rotation != "none",
            LIBDEVICE=compiled,
            ROWS=rows,
            COLS=cols,
            # rotation in [16, 32] blocks over 16 channels at a time when compiled (registers); whole
            # under the interpreter, whose numpy matmul then rounds exactly like the reference's x @ R
            RR=min(t, 16) if compiled else t,
            RC=min(d, 32) if compiled else d,
            RK=16 if compiled else d,
            enable_fp_fusion=False,  # the reference rounds every multiply and add separately
            **cfg.launch_kwargs(),
        )


def quantize_tiles_triton(keys: torch.Tensor, values: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The store kernel with the reference codec's API: ``[N, T, D]`` keys/values -> ``[N, tile_bytes]`` uint8."""
    if keys.dim() != 3:
        raise KernelArgumentError(f"keys must be [tiles, {scheme.group_size}, head_dim], got {list(keys.shape)}")
    n, _, d = keys.shape
    check_scheme(scheme, d)
    records = torch.empty(n, 1, scheme.tile_bytes(d), dtype=torch.uint8, device=keys.device)
    ids = torch.arange(n, dtype=torch.int32, device=keys.device)
    store_tiles(keys.unsqueeze(1), values.unsqueeze(1), records, ids, scheme)
    return records.squeeze(1)


_MERGE_COLS = 32  # merge kernel: output columns per program (a [32, D] float32 slice of R)


def _merge(part: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, scheme: Scheme, hq: int) -> None:
    """Combine the split partials ``part`` ``[rows, S, NACC, D]`` into ``out`` ``[rows / hq, hq, D]``, un-rotating."""
    rows, splits, _, d = part.shape
    cols = min(d, _MERGE_COLS)
    merge_kernel[(rows, d // cols)](
        part, ml, rotation(scheme.rotation, d, part.device), out, out.stride(0), out.stride(1), hq,
        S=splits, D=d, BJ=cols, ROTATE=scheme.rotation != "none", num_warps=4,
    )  # fmt: skip


def decode_attention(
    query: torch.Tensor,
    ctx: PagedContext,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged, packed context.

    No host synchronisation (nothing reads device values on the host), so a decode step can be
    captured in a CUDA graph; it allocates only the split partials (rotating schemes or split-K).

    Args:
        query: ``[B, num_q_heads, D]`` fp16/bf16/fp32, unrotated; query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)``.
        ctx: the cached context; ``cache`` 4-byte aligned, ``tail_lens`` counting the new token.
        out: optional ``[B, num_q_heads, D]`` output buffer.
        num_splits: split-K factor; default :func:`choose_num_splits` (1 = no split).
        config: launch options; default ``configs.decode_configs(...)[0]``.

    Returns:
        ``[B, num_q_heads, D]`` in ``query``'s dtype (``out`` when given). A sequence with no
        token at all gets zeros.
    """
    dev = query.device
    bsz, hq, d = check_query(query, dev)
    scheme = ctx.scheme
    hkv = check_pages(ctx, bsz, hq, d, dev)
    _check_apart(ctx.cache, hkv)
    group = hq // hkv
    cfg = config or decode_configs(scheme, d, group)[0]
    context, consts = context_args(ctx, bsz, d, cfg.block_n)
    out = output_buffer(out, query, (bsz, hq, d), dev)
    splits = num_splits if num_splits is not None else choose_num_splits(bsz, hkv, ctx.block_table.shape[1], dev)
    if not 1 <= splits <= 1024:
        raise KernelArgumentError(f"num_splits={splits} must be in 1..1024")
    if bsz == 0:
        return out
    partial = splits > 1 or scheme.rotation != "none"
    if partial:
        part = torch.empty(bsz * hq, splits, 2 if scheme.rotation != "none" else 1, d, dtype=torch.float32, device=dev)
        ml = torch.empty(bsz * hq, splits, 2, dtype=torch.float32, device=dev)
    else:
        part = ml = out  # unused
    decode_kernel[(bsz, hkv, splits)](
        query, query.stride(0), query.stride(1), context, out, out.stride(0), out.stride(1), part, ml,
        ctx.sm_scale(d) * math.log2(math.e),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), S=splits, PARTIAL=partial, C=consts,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    if partial:
        _merge(part, ml, out, scheme, hq)
    return out


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx: PagedContext,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    decode_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens (prefill or a prefill chunk) over cached context plus themselves.

    The cached context of sequence ``b`` is described exactly as for :func:`decode_attention`
    (sink, ``num_tiles[b]`` packed tiles, ``tail_lens[b]`` tail tokens; all zero for a first
    chunk); the new tokens follow it. Tiles are dequantized inside the attention loop, a sub-block
    of tokens at a time; nothing is written but the output (and, for rotating schemes, the
    ``[total_q * num_q_heads, 2, D]`` float32 accumulators that the merge kernel un-rotates).
    No host synchronisation either: the grid's first axis covers ``max_query_len`` new tokens
    per sequence, ``total_q`` when not given (correct, but launches idle programs for batches of
    many short sequences: pass it when the host knows it, as vLLM's metadata does).

    Args:
        query: ``[total_q, num_q_heads, D]`` new tokens of all sequences, packed by sequence.
        key, value: ``[total_q, num_kv_heads, D]`` their keys and values (unrotated), same dtype.
        cu_seqlens_q: ``[B + 1]`` int32 start offsets of each sequence's tokens in ``query``.
        ctx: the cached context, as in :func:`decode_attention` (``tail_lens`` may be 0).
        max_query_len: the most new tokens of any sequence (an upper bound is fine).
        out: optional ``[total_q, num_q_heads, D]`` output.
        config: launch options (``configs.prefill_configs``).
        decode_rows: unused: this kernel attends every sequence alike; part of the ops' shared signature.

    Returns:
        ``[total_q, num_q_heads, D]`` in ``query``'s dtype.
    """
    dev = query.device
    bsz = check_prefill(query, key, value, cu_seqlens_q, ctx, dev)
    total, hq, d = query.shape
    scheme = ctx.scheme
    hkv = check_pages(ctx, bsz, hq, d, dev)
    if key.stride() != value.stride():
        raise KernelArgumentError(f"key and value must have the same strides, got {key.stride()} and {value.stride()}")
    _check_apart(ctx.cache, hkv)
    cfg = config or prefill_configs(d)[0]
    context, consts = context_args(ctx, bsz, d, cfg.block_n)
    out = output_buffer(out, query, (total, hq, d), dev)
    if max_query_len is not None and max_query_len < 0:
        raise KernelArgumentError(f"max_query_len={max_query_len} must be >= 0")
    q_max = min(total, max_query_len if max_query_len is not None else total)
    if bsz == 0 or q_max == 0:
        return out
    group = hq // hkv
    gp = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, gp)
    rotate = scheme.rotation != "none"
    if rotate:
        part = torch.empty(total * hq, 1, 2, d, dtype=torch.float32, device=dev)
        ml = torch.empty(total * hq, 1, 2, dtype=torch.float32, device=dev)
    else:
        part = ml = out  # unused
    prefill_kernel[(triton.cdiv(q_max, block_m // gp), bsz, hkv)](
        query, query.stride(0), query.stride(1), key, value, key.stride(0), key.stride(1), cu_seqlens_q,
        context, out, out.stride(0), out.stride(1), part, ml,
        ctx.sm_scale(d) * math.log2(math.e),
        G=group, GP=gp, BLOCK_M=block_m, C=consts, **cfg.launch_kwargs(),
    )  # fmt: skip
    if rotate:
        _merge(part, ml, out, scheme, hq)
    return out
