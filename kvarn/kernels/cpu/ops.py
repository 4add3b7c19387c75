"""The CPU backend's :class:`~kvarn.kernels.api.AttentionOps`: attention over packed tiles and the store.

Decode runs the native kernel (:mod:`.native`) where it builds and takes the tensors, else the
torch path (vectorized PyTorch, :mod:`.torch_path`); prefill runs vLLM's CPU attention kernel where
vLLM's CPU build is loaded (:mod:`.paged_prefill`), else torch's CPU flash attention
(:mod:`.prefill`), except short segments past their prompt (:data:`SHORT_SEGMENT` tokens or fewer),
which the native decode kernel attends token by token so that they get the bits decoding them gives.
Layout and token order of the context: :mod:`kvarn.kernels.api`.
Full tiles are quantized into the cache by :func:`store_tiles` (:mod:`.store`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvarn.kernels._checks import KernelArgumentError, check_prefill, check_query, output_buffer
from kvarn.kernels.api import PagedContext
from kvarn.kernels.cpu import native, prefill, torch_path
from kvarn.kernels.cpu._checks import CPU, check_context, check_indices
from kvarn.kernels.cpu.store import quantize_tiles_cpu, store_tiles

__all__ = ["decode_attention", "prefill_attention", "quantize_tiles_cpu", "store_tiles"]

IMPLS = ("auto", "native", "torch")
PREFILL_IMPLS = ("auto", "flash", "vllm")
# Segments of at most this many new tokens (speculative verification, decode tokens in a step with
# prefill chunks) are attended token by token by the decode kernel, so that they get the bits decoding
# them would give.
SHORT_SEGMENT = 16


def decode_attention(
    query: torch.Tensor, ctx: PagedContext, *, out: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged, packed context, on the CPU.

    Args:
        query: ``[B, Hq, D]`` fp16/bf16/fp32, unrotated (any row strides); query head ``h`` reads KV
            head ``h // (Hq // H)``.
        ctx: the cached context; ``cache`` may be a page view (last axis contiguous), ``tail_lens``
            counts the new token, slot tensors are int32 or int64.
        out: optional ``[B, Hq, D]`` output buffer (any float dtype and strides).
        impl: ``auto`` (the native kernel when it builds and takes the tensors, else the torch path),
            ``native`` (error without it) or ``torch`` (the torch path, :mod:`.torch_path`).

    Returns:
        ``[B, Hq, D]`` in ``query``'s dtype (``out`` when given); zeros for a sequence with no token.
    """
    if impl not in IMPLS:
        raise KernelArgumentError(f"impl={impl!r} is not one of: {', '.join(IMPLS)}")
    bsz, hq, d = check_query(query, CPU)
    check_context(ctx, bsz, hq, d, indices=False)
    out = output_buffer(out, query, (bsz, hq, d), CPU, any_strides=True)
    if not bsz:
        return out
    if impl != "torch" and native.decode(query, ctx, out):  # raises on an index out of range
        return out
    if impl == "native":
        raise KernelArgumentError("impl='native': the native kernel is not built or does not take these tensors")
    check_indices(ctx)
    out.copy_(torch_path.decode(ctx, query))
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
    decode_rows: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Causal attention of new tokens (a prefill or a chunk of one) over cached context plus themselves.

    The cached context of sequence ``b`` is ``ctx``'s (all empty for a first chunk); its new tokens
    ``query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` follow it. The packed tiles read are dequantized
    once per call and attended apart from the exact rows (:mod:`.prefill`); bfloat16 queries attend
    in bfloat16, others in float32; the op reads lengths on the host.

    Args:
        query: ``[N, Hq, D]`` new tokens of all sequences, packed by sequence, unrotated.
        key, value: ``[N, H, D]`` their keys and values (unrotated).
        cu_seqlens_q: ``[B + 1]`` int32 start offsets of each sequence's tokens.
        ctx: the cached context, as in :func:`decode_attention` (``tail_lens`` may be 0).
        max_query_len: unused (lengths are read here); part of the ops' shared signature.
        out: optional ``[N, Hq, D]`` output buffer.
        decode_rows: optional ``[B]`` bool (host), the sequences whose new tokens follow their
            prompt (speculative verifications, decode tokens beside prefill chunks): those of at most
            :data:`SHORT_SEGMENT` tokens that stay in their tile are attended by the decode kernel, and
            no other sequence is. None: every sequence that short is. A prompt's tokens then get the
            bits of the prefill path however the scheduler chunks the prompt.
        impl: the prefill path: ``auto`` (vLLM's CPU attention kernel where vLLM's CPU build is
            loaded, else flash attention), ``vllm`` or ``flash`` (:func:`.prefill.prefill`).

    Returns:
        ``[N, Hq, D]`` in ``query``'s dtype (``out`` when given).
    """
    if impl not in PREFILL_IMPLS:
        raise KernelArgumentError(f"impl={impl!r} is not one of: {', '.join(PREFILL_IMPLS)}")
    bsz = check_prefill(query, key, value, cu_seqlens_q, ctx, CPU)
    total, hq, d = query.shape
    if bsz and (int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != total or bool((cu_seqlens_q.diff() < 0).any())):
        raise KernelArgumentError(f"cu_seqlens_q must rise from 0 to {total}, got {cu_seqlens_q.tolist()}")
    check_context(ctx, bsz, hq, d)
    out = output_buffer(out, query, (total, hq, d), CPU, any_strides=True)
    if not (bsz and total):
        return out
    q_lens = cu_seqlens_q.diff()
    # a short segment is decoded token by token in its staging slot: only while it stays in one tile
    short = (q_lens > 0) & (q_lens <= SHORT_SEGMENT) & (ctx.tail_lens.long() + q_lens <= ctx.scheme.group_size)
    if decode_rows is not None:
        if decode_rows.shape != (bsz,):
            raise KernelArgumentError(f"decode_rows must be [{bsz}] bool, got {tuple(decode_rows.shape)}")
        short &= decode_rows.to(short.device, torch.bool)
    decoded = _short_segments(ctx, query, key, value, cu_seqlens_q, short)
    if decoded is None or not bool(short.all()):
        attend = None if decoded is None else ~short
        res = prefill.prefill(ctx, query, key, value, cu_seqlens_q, attend, impl, out=out)
        if res is not out:
            out.copy_(res)
    if decoded is not None:
        out[decoded[0]] = decoded[1].to(out.dtype)
    return out


def _short_segments(
    p: PagedContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
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
        block_table=p.block_table[b].contiguous(),
        num_tiles=p.num_tiles[b].contiguous(),
        tail_k=work_k,
        tail_v=work_v,
        tail_lens=(rows + 1).to(torch.int32),
        tail_slot=tok_seg.to(torch.int32),
        sink_lens=p.sink_lens[b].contiguous() if p.sink_lens is not None else None,
        sink_slot=sink_slot,
    )
    q = query[tok]
    dst = torch.empty_like(q)
    if not native.decode(q, rows_p, dst):
        return None
    return tok, dst


def _segment_tokens(cu: torch.Tensor, seg: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Query token indices of segments ``seg`` (``lens`` tokens each, starting at ``cu[seg]``), in order."""
    starts = torch.repeat_interleave(cu[seg] - (lens.cumsum(0) - lens), lens)
    return starts + torch.arange(int(lens.sum()))
