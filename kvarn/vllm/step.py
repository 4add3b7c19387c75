"""One step's device tensors, built once by the metadata builder and used by every layer.

Tile-causal attention: a query in tile ``j`` of its sequence attends the packed tiles ``0..j-1``
exactly as decode will read them later (quantized; tile 0 with its exact sink rows where the
scheme keeps them) and the tokens of tile ``j`` up to itself exactly. So a prompt gives the same
result whether its prefix was cached and however the scheduler splits it into chunks.

Each request's new tokens are cut into *segments*, one per tile they fall in; the attention ops
see one sequence per segment (:func:`kvarn.kernels.triton.ops.prefill_attention`): context = the packed
tiles before the segment's tile, then the staged tokens of that tile before the segment (first
segment only), then the segment's own keys causally. A step where every request has one new
token (decode) gives one row per request to ``decode_attention`` instead, its new token written
into the staging slot first and counted in ``tail_lens``.

Order inside a layer (:func:`kvarn.vllm.forward.run_layer`): (1) ``pre`` writes into scratch and
sink slots, (2) tiles that became full are quantized into their pages (those whose first tokens
were staged are read whole from their slot after (1)), (3) attention, (4) ``post`` writes: the
tokens of new partial blocks in prefill steps, after attention (with paged tails they reach the
pages through the step's saves, :func:`kvarn.vllm.tail.save_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvarn.vllm.staging import RequestPlan

if TYPE_CHECKING:
    from kvarn.vllm.tail import Scratch, TailLayout, TailMoves

Writes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (token index, slot, row) [n] int64 each


@dataclass
class StepTensors:
    """Device tensors of one step (``R`` attention rows: segments, or requests in a decode step)."""

    num_tokens: int  # tokens of the step's flattened query that belong to requests
    max_query_len: int  # the most query tokens of any row (the prefill grid; 1 in decode)
    decode: bool  # decode_attention (one token per request) instead of prefill_attention
    cu_seqlens: torch.Tensor  # [R + 1] int32 query offsets of the rows (unused in decode)
    block_table: torch.Tensor  # [R, W] int32 packed tiles each row reads
    num_tiles: torch.Tensor  # [R] int32
    tail_slot: torch.Tensor  # [R] int32 scratch tile read; 0 if no tail
    tail_lens: torch.Tensor  # [R] int32
    sink_slot: torch.Tensor | None  # [R] int32 sink slot read (schemes with sinks)
    sink_lens: torch.Tensor | None  # [R] int32 exact rows read (0: tile 0 quantized, or still in the tail)
    stage_pre: Writes | None  # staging writes before attention
    stage_post: Writes | None  # staging writes after attention
    sink_writes: Writes | None  # sink-slot writes (before attention)
    full_slots: torch.Tensor | None  # [F1] int64 slots holding a tile that became full
    full_tokens: torch.Tensor | None  # [F2 * T] int64 tokens of tiles that became full without staging
    full_blocks: torch.Tensor | None  # [F1 + F2] int64 their pages, slot tiles first
    # [R] bool (host): rows of requests past their prompt, which the CPU ops attend as decode rows when
    # short (kvarn.kernels.cpu.ops.prefill_attention); None when the step's metadata does not say
    decode_rows: torch.Tensor | None = None
    # paged tails (kvarn.vllm.tail): the step's row traffic, the layout, and the scratch tiles the slots
    # above index; run_layer refuses a step without them
    tail: TailMoves | None = None
    layout: TailLayout | None = None
    scratch: Scratch | None = None


def _writes(lists: tuple[list[int], list[int], list[int]], device: torch.device) -> Writes | None:
    if not lists[0]:
        return None
    src, slot, row = (torch.tensor(x, dtype=torch.long).to(device, non_blocking=True) for x in lists)
    return src, slot, row


def build_step(
    plans: list[RequestPlan],
    block_table: torch.Tensor,
    group_size: int,
    *,
    sink_tile: bool,
    has_sink: bool,
    decode: bool,
    prefilling: list[bool] | None = None,
    tail: TailMoves | None = None,
    layout: TailLayout | None = None,
    scratch: Scratch | None = None,
) -> StepTensors:
    """Turn a step's plans into :class:`StepTensors` on ``block_table``'s device.

    Args:
        plans: from :func:`kvarn.vllm.tail.plan_tails` (and :meth:`SinkPool.plan` when ``has_sink``).
        block_table: ``[num_reqs, max_blocks]`` int32 vLLM's block table of the step's requests.
        group_size: tokens per tile (= vLLM block size).
        sink_tile: the scheme keeps the first tile 16-bit (rows read the sink, then tiles 1..).
        has_sink: the scheme keeps exact first tokens (sink tile or sink tokens).
        decode: every request has exactly one new token.
        prefilling: per request, whether its new tokens are (or end) its prompt (vLLM's
            ``is_prefilling``); None: not known, and the CPU ops pick decode rows by their length.
        tail, layout, scratch: with paged tails, the step's row traffic, the layout and the scratch
            tiles its slots index (:mod:`kvarn.vllm.tail`); :func:`kvarn.vllm.forward.run_layer` refuses a
            step without them.
    """
    t, dev = group_size, block_table.device
    cu, req, off, tiles, t_slot, t_len, s_slot, s_len = ([0], [], [], [], [], [], [], [])
    pre: tuple[list[int], list[int], list[int]] = ([], [], [])
    post: tuple[list[int], list[int], list[int]] = ([], [], [])
    sink: tuple[list[int], list[int], list[int]] = ([], [], [])
    f_slots: list[int] = []
    f_tokens: list[int] = []
    f_blocks: list[int] = []
    f_blocks_tok: list[int] = []

    def add_row(i: int, end: int, j: int, slot: int, lens: int, p: RequestPlan) -> None:
        """Row of request ``i`` ending at query token ``end``, in tile ``j``, tail ``lens`` rows of ``slot``."""
        reads = has_sink and j > 0 and p.sink_read > 0
        skip = 1 if reads and sink_tile else 0  # the sink tile replaces packed tile 0
        cu.append(end)
        req.append(i)
        off.append(skip)
        tiles.append(j - skip)
        t_slot.append(max(slot, 0) if lens else 0)
        t_len.append(lens)
        s_slot.append(p.sink_slot if reads else 0)
        s_len.append(p.sink_read if reads else 0)

    def put(dst: tuple[list[int], list[int], list[int]], p: RequestPlan, a: int, b: int, slot: int) -> None:
        """Positions ``a..b-1`` of request ``p`` into rows ``a % t ..`` of ``slot``."""
        dst[0].extend(range(p.q_start + a - p.ctx, p.q_start + b - p.ctx))
        dst[1].extend([slot] * (b - a))
        dst[2].extend(x % t for x in range(a, b))

    for i, p in enumerate(plans):
        seq_len, staged, first = p.ctx + p.q_len, p.staged(t), p.ctx // t
        if p.dummy:
            if decode or p.q_len:
                add_row(i, p.q_start + p.q_len, 0, 0, 0, p)
            continue
        if staged:  # the staged tile's new tokens join its slot
            put(pre, p, p.ctx, min(seq_len, (first + 1) * t), p.read_slot)
        if p.new_slot >= 0:
            put(pre if decode else post, p, seq_len // t * t, seq_len, p.new_slot)
        if p.sink_write:
            sink[0].extend(range(p.q_start, p.q_start + p.sink_write))
            sink[1].extend([p.sink_slot] * p.sink_write)
            sink[2].extend(range(p.ctx, p.ctx + p.sink_write))
        for j in range(first, seq_len // t):  # tiles that become full
            if j == first and staged:
                f_slots.append(p.read_slot)
                f_blocks.append(p.row[j])
            else:
                f_tokens.extend(range(p.q_start + j * t - p.ctx, p.q_start + (j + 1) * t - p.ctx))
                f_blocks_tok.append(p.row[j])
        if decode:
            add_row(i, p.q_start + 1, first, p.read_slot if staged else p.new_slot, staged + 1, p)
            continue
        for j in range(first, (seq_len - 1) // t + 1):  # one row per tile the new tokens fall in
            end = min(seq_len, (j + 1) * t)
            add_row(i, p.q_start + end - p.ctx, j, p.read_slot, staged if j == first else 0, p)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32).to(dev, non_blocking=True)

    req_idx = torch.tensor(req, dtype=torch.long)
    n_tiles = torch.tensor(tiles, dtype=torch.long)
    width = max(max(tiles, default=0), 1)
    cols = torch.tensor(off, dtype=torch.long)[:, None] + torch.arange(width)[None, :]
    valid = torch.arange(width)[None, :] < n_tiles[:, None]
    cols = torch.where(valid, cols, 0).clamp_max(block_table.shape[1] - 1)
    rows = req_idx[:, None].expand_as(cols)
    table = block_table[rows.to(dev), cols.to(dev)].to(torch.int32)
    table = torch.where(valid.to(dev), table, 0)
    blocks = f_blocks + f_blocks_tok
    return StepTensors(
        num_tokens=cu[-1],
        max_query_len=max((b - a for a, b in zip(cu, cu[1:], strict=False)), default=0),
        decode=decode,
        decode_rows=None if prefilling is None else ~torch.tensor(prefilling, dtype=torch.bool)[req_idx],
        cu_seqlens=i32(cu),
        block_table=table,
        num_tiles=i32(tiles),
        tail_slot=i32(t_slot),
        tail_lens=i32(t_len),
        sink_slot=i32(s_slot) if has_sink else None,
        sink_lens=i32(s_len) if has_sink else None,
        stage_pre=_writes(pre, dev),
        stage_post=_writes(post, dev),
        sink_writes=_writes(sink, dev),
        full_slots=torch.tensor(f_slots, dtype=torch.long).to(dev) if f_slots else None,
        full_tokens=torch.tensor(f_tokens, dtype=torch.long).to(dev) if f_tokens else None,
        full_blocks=torch.tensor(blocks, dtype=torch.long).to(dev) if blocks else None,
        tail=tail,
        layout=layout,
        scratch=scratch,
    )
