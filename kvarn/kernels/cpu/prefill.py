"""Prefill attention over packed tiles on the CPU, in PyTorch: the ``prefill_attention`` of :mod:`.ops`.

A sequence's keys are, in token order, its *packed part* (sink rows, packed tiles, tile 0 with its
exact sink copies: :mod:`kvarn.kernels.api`) and its *exact part* (the staged tail rows, then its
new tokens, causal). Each part is attended by torch's CPU flash attention, which also returns the
log-sum-exp of each query's scores, and the two results are merged per query::

    out = (o_p * exp(lse_p - m) + o_e * exp(lse_e - m)) / (exp(lse_p - m) + exp(lse_e - m))

with ``m = max(lse_p, lse_e)``. So no mask is built:

* **packed part**: no mask at all. The step planner cuts a request's new tokens into one sequence
  (segment) per tile; consecutive segments whose tiles are a prefix of the next one's (the segments
  of one request) form a *chain*. Every tile any segment reads is dequantized once per call
  (:func:`kvarn.kernels.cpu.dequant.dequantize_blocks`, native), the
  chain's keys are gathered once, at its longest segment's length, and each segment attends a
  prefix of them. A segment's queries sit at their rows in the tile (after its tail rows), in
  whole row blocks (:func:`row_block`).
* **exact part**: the tail rows and the new tokens of every segment padded to whole row blocks,
  the query of new token ``i`` placed at row ``tail_lens + i``, so that flash attention's own
  causal mask (query row ``r`` sees keys ``0..r``) is the causal mask of the sequence. One flash
  call per padded width.

Why row blocks: torch's CPU flash attention splits the queries into blocks whose size follows the
query count, sums a row's keys over the padded width in vectors plus a scalar rest, and its matrix
products round a row by the shape of the block it falls in. With each query at its row in the
tile and every segment padded to whole blocks of flash attention's own size, a token of a segment
inside one tile (as the step planner makes them) is computed the same way whatever its chunk and
the other segments of the step: a request's bits do not depend on its batch (docs/reliability.md).

Query head ``h`` reads KV head ``h // (Hq // H)`` (flash attention's own grouped-query heads).
Both parts compute in bfloat16 when the query is bfloat16 (keys and values rounded to it, as a 16-bit
cache stores them; float32 accumulation and softmax state), else in float32.
"""

from __future__ import annotations

import torch

from kvarn.kernels.api import PagedContext
from kvarn.kernels.cpu.dequant import dequantize_blocks

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# torch's CPU flash attention takes the queries in blocks of 32 rows when it gets fewer than 192
FLASH_ROWS, FLASH_MAX_ROWS = 32, 192


def row_block(group_size: int) -> int:
    """The rows a segment's queries are padded in: the blocks of this many rows, counted from the
    tile's first row, that its tokens fall in. Flash attention's query block (:data:`FLASH_ROWS`)
    where a tile is a whole number of them and shorter than :data:`FLASH_MAX_ROWS`, else the tile."""
    return FLASH_ROWS if group_size < FLASH_MAX_ROWS and group_size % FLASH_ROWS == 0 else group_size


def prefill(
    p: PagedContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    attend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill attention -> ``[N, Hq, D]`` float32 (see :func:`kvarn.kernels.cpu.ops.prefill_attention`).

    Args:
        attend: ``[B]`` bool, the sequences to attend (default all); the others' rows are unspecified.
    """
    total, hq, d = query.shape
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    if attend is not None:
        q_lens = torch.where(attend, q_lens, 0)
    q = query if query.dtype == torch.bfloat16 else query.float()
    scale = p.sm_scale(d)
    o_e, lse_e = _exact_part(p, q, key, value, cu, q_lens, scale)
    packed = _packed_part(p, q, cu, q_lens, scale)
    if packed is None:
        return o_e
    o_p, lse_p = packed  # lse_p is -inf where a token has no packed part
    m = torch.maximum(lse_e, lse_p)
    w_e, w_p = torch.exp(lse_e - m), torch.exp(lse_p - m)
    return (o_e * w_e[..., None] + o_p * w_p[..., None]) / (w_e + w_p)[..., None]


def _exact_part(
    p: PagedContext,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token over its sequence's tail rows and the new tokens up to itself:
    ``(out [N, Hq, D] float32, lse [N, Hq])`` (rows of tokens not attended: 0 and -inf)."""
    total, hq, d = q.shape
    h = key.shape[1]
    bsz, rows = q_lens.shape[0], p.tail_k.shape[2]
    tail = torch.where(q_lens > 0, p.tail_lens.long(), 0)
    slots = p.tail_slot.long() if p.tail_slot is not None else torch.arange(bsz)
    used, slot_of = torch.unique(slots[tail > 0], return_inverse=True)
    # source rows [X, H, D]: the staged rows of the slots read, the new keys, a zero row
    dt = q.dtype
    src_k = [p.tail_k.index_select(0, used).transpose(1, 2).reshape(-1, h, d).to(dt), key.to(dt)]
    src_v = [p.tail_v.index_select(0, used).transpose(1, 2).reshape(-1, h, d).to(dt), value.to(dt)]
    new_base, zero = used.shape[0] * rows, used.shape[0] * rows + total
    zero_row = torch.zeros(1, h, d, dtype=dt)
    all_k, all_v = torch.cat([*src_k, zero_row]), torch.cat([*src_v, zero_row])
    q_src = torch.cat([q, torch.zeros(1, hq, d, dtype=dt)])
    slot_idx = torch.zeros(bsz, dtype=torch.long)
    slot_idx[tail > 0] = slot_of
    out = torch.empty(total, hq, d)  # every token attended is written
    lse = torch.empty(total, hq)
    # each sequence padded to whole row blocks: a token's row and its flash-attention blocks are fixed
    # by its position in the tile, whatever the other sequences and the chunk it came in
    rb = row_block(p.scheme.group_size)
    width = (tail + q_lens + rb - 1) // rb * rb
    for w in torch.unique(width[q_lens > 0]).tolist():
        grp = ((width == w) & (q_lens > 0)).nonzero().flatten()
        r = torch.arange(w)[None, :]
        tl, ql, start = tail[grp, None], q_lens[grp, None], cu[grp, None]
        idx = torch.where(r < tl, slot_idx[grp, None] * rows + r, new_base + start + r - tl)
        idx = torch.where(r < tl + ql, idx, zero)
        q_ok = (r >= tl) & (r < tl + ql)
        q_idx = torch.where(q_ok, start + r - tl, total)
        b = grp.shape[0]
        qg = q_src.index_select(0, q_idx.flatten()).view(b, w, hq, d).transpose(1, 2)  # [b, Hq, w, D]
        kg = all_k.index_select(0, idx.flatten()).view(b, w, h, d).transpose(1, 2)  # [b, H, w, D]
        vg = all_v.index_select(0, idx.flatten()).view(b, w, h, d).transpose(1, 2)
        o, lg = _flash(qg, kg, vg, 0.0, True, scale=scale)[:2]  # causal: row r sees keys 0..r
        at = q_ok.flatten().nonzero().flatten()  # rows of new tokens in the padded [b * w]
        tok = q_idx.flatten().index_select(0, at)
        out.index_copy_(0, tok, o.transpose(1, 2).reshape(b * w, hq, d).index_select(0, at).float())
        lse.index_copy_(0, tok, lg.transpose(1, 2).reshape(b * w, hq).index_select(0, at))
    return out, lse


def _packed_part(
    p: PagedContext, q: torch.Tensor, cu: torch.Tensor, q_lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each new token over its sequence's packed part: ``(out [N, Hq, D] float32, lse [N, Hq])``,
    -inf where a sequence has none; None when no sequence has one."""
    total, hq, d = q.shape
    h, t = p.cache.shape[1], p.scheme.group_size
    bsz = q_lens.shape[0]
    n = p.num_tiles.long()
    tail, rb = p.tail_lens.long(), row_block(t)
    sink = p.sink_count() if p.sink_k is not None else torch.zeros(bsz, dtype=torch.long)
    ahead = sink if p.scheme.sink_tile else torch.zeros_like(sink)
    length = torch.where(q_lens > 0, ahead + n * t, 0)
    if not bool((length > 0).any()):
        return None
    width = int(n.max())
    cols = torch.arange(width)[None, :]
    reads = (cols < n[:, None]) & (length[:, None] > 0)
    ids = torch.where(reads, p.block_table[:, :width].long(), 0)
    blocks, which = torch.unique(ids[reads], return_inverse=True)
    tile_of = torch.zeros(bsz, width, dtype=torch.long)
    tile_of[reads] = which
    # source rows [H, X, D]: every tile read dequantized once, then the sink rows of the slots read
    src_k, src_v = [], []
    u = blocks.shape[0]
    if u:
        dk, dv = dequantize_blocks(p.cache, blocks, p.scheme, d, q.dtype)  # [H, U, T, D]
        src_k.append(dk.view(h, u * t, d))
        src_v.append(dv.view(h, u * t, d))
    sink_slot = torch.zeros(bsz, dtype=torch.long)
    cap = 0
    if p.sink_k is not None and p.sink_v is not None and bool((sink > 0).any()):
        slots = p.sink_slot.long() if p.sink_slot is not None else torch.arange(bsz)
        used, slot_of = torch.unique(slots[sink > 0], return_inverse=True)
        sink_slot[sink > 0] = slot_of
        cap = p.sink_k.shape[2]
        src_k.append(p.sink_k.index_select(0, used).transpose(0, 1).reshape(h, -1, d).to(q.dtype))
        src_v.append(p.sink_v.index_select(0, used).transpose(0, 1).reshape(h, -1, d).to(q.dtype))
    all_k, all_v = torch.cat(src_k, 1), torch.cat(src_v, 1)
    sink_base = u * t
    out = torch.zeros(total, hq, d)
    lse = torch.full((total, hq), float("-inf"))
    for seg in _chains(p, n, sink, sink_slot, length):
        last = seg[-1]
        rows = _packed_rows(int(n[last]), int(sink[last]), tile_of[last], sink_base + int(sink_slot[last]) * cap, t, p)
        kc = all_k.index_select(1, rows)[None]  # [1, H, P, D]
        vc = all_v.index_select(1, rows)[None]
        for s in seg:
            a, b, keys = int(cu[s]), int(cu[s] + q_lens[s]), int(length[s])
            r0 = int(tail[s]) % rb  # the queries at their rows in the tile's row blocks
            qs = q.new_zeros(1, hq, (r0 + b - a + rb - 1) // rb * rb, d)
            qs[0, :, r0 : r0 + b - a] = q[a:b].transpose(0, 1)
            o, lg = _flash(qs, kc[:, :, :keys], vc[:, :, :keys], 0.0, False, scale=scale)[:2]
            out[a:b] = o[0, :, r0 : r0 + b - a].transpose(0, 1)
            lse[a:b] = lg[0, :, r0 : r0 + b - a].transpose(0, 1)
    return out, lse


def _packed_rows(n: int, sink: int, tile_of: torch.Tensor, sink_base: int, t: int, p: PagedContext) -> torch.Tensor:
    """Row indices (into one KV head's source rows) of a sequence's packed part, in token order."""
    rows = (tile_of[:n, None] * t + torch.arange(t)[None, :]).flatten()
    sink_rows = sink_base + torch.arange(sink)
    if p.scheme.sink_tile:
        return torch.cat([sink_rows, rows])
    if sink:  # sink tokens: tile 0's first positions read from the exact copies
        rows[:sink] = sink_rows
    return rows


def _chains(
    p: PagedContext, n: torch.Tensor, sink: torch.Tensor, sink_slot: torch.Tensor, length: torch.Tensor
) -> list[list[int]]:
    """Sequences with a packed part, in runs of consecutive ones whose packed parts are prefixes of
    the run's last one (the segments of one request: same blocks in order, same sink rows)."""
    width = int(n.max())
    bt = p.block_table[:, :width]
    cols = torch.arange(width)[None, :]
    same = ((bt[1:] == bt[:-1]) | (cols >= n[:-1, None])).all(1) & (n[1:] >= n[:-1])
    same &= (sink[1:] == sink[:-1]) & (sink_slot[1:] == sink_slot[:-1]) & (length[:-1] > 0)
    chains: list[list[int]] = []
    for s, (has, joins) in enumerate(zip((length > 0).tolist(), [False, *same.tolist()], strict=True)):
        if not has:
            continue
        if joins and chains and chains[-1][-1] == s - 1:
            chains[-1].append(s)
        else:
            chains.append([s])
    return chains
