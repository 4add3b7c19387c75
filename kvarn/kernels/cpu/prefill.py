"""Prefill attention over packed tiles on the CPU, in PyTorch: the ``prefill_attention`` of :mod:`.ops`.

A sequence's keys are, in token order, its *packed part* (sink rows, packed tiles, tile 0 with its
exact sink copies: :mod:`kvarn.kernels.api`) and its *exact rows* (the staged tail rows, then its
new tokens, causal). Each sequence (segment) is attended by one call of torch's CPU flash attention
over its packed part followed by its exact rows, with a mask that lets the query of tile row ``r``
see every packed key and the exact rows ``0..r``: no second pass, no merge of partial softmaxes.

* **keys**: the step planner cuts a request's new tokens into one sequence (segment) per tile;
  consecutive segments whose tiles are a prefix of the next one's (the segments of one request)
  form a *chain*. Every tile any segment reads is dequantized once per call
  (:func:`kvarn.kernels.cpu.dequant.dequantize_blocks`, native) and the chain's packed rows are
  gathered once into one buffer, with room after them for exact rows. The chain's segments are
  attended last first: each writes its exact rows right after its own packed part (over packed rows
  only the later segments read), so that its keys are a prefix of the buffer, copied nowhere else.
* **exact rows**: always a whole number of tiles (zero rows past the new tokens, masked), so that
  a segment's key count depends only on its packed part, not on how its tile was chunked.
* **queries**: each at its row in the tile, in whole row blocks (:func:`row_block`) counted from
  the tile's first row.

Why fixed widths and row blocks: torch's CPU flash attention splits the queries into blocks whose
size follows the query count and the keys into blocks whose size follows the key count, and its
matrix products round a row by the shape of the block it falls in. With each query at its row in
the tile, every segment padded to whole blocks of flash attention's own size, and the key count
fixed by the packed part, a token of a segment inside one tile (as the step planner makes them) is
computed the same way whatever its chunk and the other segments of the step: a request's bits do
not depend on its batch (docs/reliability.md).

Query head ``h`` reads KV head ``h // (Hq // H)`` (flash attention's own grouped-query heads).
Attention computes in bfloat16 when the query is bfloat16 (keys and values rounded to it, as a
16-bit cache stores them; float32 accumulation and softmax state), else in float32.
"""

from __future__ import annotations

import torch

from kvarn.kernels._checks import KernelArgumentError
from kvarn.kernels.api import PagedContext
from kvarn.kernels.cpu import paged_prefill
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
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill attention -> ``[N, Hq, D]`` in the compute dtype (bfloat16 for a bfloat16 query,
    else float32; see :func:`kvarn.kernels.cpu.ops.prefill_attention`): ``out`` where it is given,
    contiguous and of that dtype, else a new tensor.

    Args:
        attend: ``[B]`` bool, the sequences to attend (default all); the others' rows are unspecified.
        impl: ``flash`` (torch's flash attention, one call per segment), ``vllm`` (vLLM's CPU
            attention kernel, :mod:`.paged_prefill`; an error where it is not loaded) or ``auto``
            (``vllm`` where it is loaded and serves the shapes, else ``flash``).
    """
    total, hq, d = query.shape
    t = p.scheme.group_size
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    if attend is not None:
        q_lens = torch.where(attend, q_lens, 0)
    dt = torch.bfloat16 if query.dtype == torch.bfloat16 else torch.float32
    q, key, value = query.to(dt), key.to(dt), value.to(dt)
    isa = paged_prefill.engine(dt, t, d) if impl != "flash" else None
    if impl == "vllm" and isa is None:
        raise KernelArgumentError(f"impl='vllm': vLLM's CPU attention ops are not loaded or do not serve head_dim {d}")
    if out is None or out.dtype != dt or not out.is_contiguous():
        out = torch.empty(total, hq, d, dtype=dt)
    if isa is not None:
        return paged_prefill.prefill(p, q, key, value, cu, q_lens, isa, out)
    bsz = q_lens.shape[0]
    n = p.num_tiles.long()
    tail = torch.where(q_lens > 0, p.tail_lens.long(), 0)
    exact = (tail + q_lens + t - 1) // t * t  # exact rows of each segment: whole tiles
    sink = p.sink_count() if p.sink_k is not None else torch.zeros(bsz, dtype=torch.long)
    ahead = sink if p.scheme.sink_tile else torch.zeros_like(sink)
    length = torch.where(q_lens > 0, ahead + n * t, 0)  # packed keys of each segment
    if not bool((q_lens > 0).any()):
        return out
    all_k, all_v, tile_of, sink_slot, sink_base = _packed_sources(p, n, sink, length, d, dt)
    zero = all_k.shape[1] - 1  # the zero row appended to the sources
    cap = p.sink_k.shape[2] if p.sink_k is not None else 0
    mask = _mask(int(length.max()), int(exact.max()), dt)
    lmax, rb = int(length.max()), row_block(t)
    lens, tails, exacts, starts = length.tolist(), tail.tolist(), exact.tolist(), cu.tolist()
    slots = (p.tail_slot.long() if p.tail_slot is not None else torch.arange(bsz)).tolist()
    for chain in _chains(p, n, sink, sink_slot, length, q_lens):
        last = chain[-1]
        rows = _packed_rows(int(n[last]), int(sink[last]), tile_of[last], sink_base + int(sink_slot[last]) * cap, t, p)
        room = max(lens[s] + exacts[s] for s in chain)
        rows = torch.cat([rows, torch.full((room - rows.shape[0],), zero, dtype=torch.long)])
        buf_k = all_k.index_select(1, rows)  # [H, room, D]
        buf_v = all_v.index_select(1, rows)
        for s in reversed(chain):  # each writes its exact rows over packed rows only later segments read
            a, b, lp, tl, ew = starts[s], starts[s + 1], lens[s], tails[s], exacts[s]
            for buf, staged, new in ((buf_k, p.tail_k, key), (buf_v, p.tail_v, value)):
                if tl:
                    buf[:, lp : lp + tl] = staged[slots[s], :, :tl]
                buf[:, lp + tl : lp + tl + b - a] = new[a:b].transpose(0, 1)
                buf[:, lp + tl + b - a : lp + ew] = 0
            r0, r1 = tl // rb * rb, (tl + b - a + rb - 1) // rb * rb  # the row blocks its queries fall in
            qs = q.new_zeros(1, hq, r1 - r0, d)
            qs[0, :, tl - r0 : tl - r0 + b - a] = q[a:b].transpose(0, 1)
            m = mask[r0:r1, lmax - lp : lmax + ew][None, None]
            o = _flash(
                qs, buf_k[None, :, : lp + ew], buf_v[None, :, : lp + ew], 0.0, False, attn_mask=m, scale=p.sm_scale(d)
            )[0]
            out[a:b] = o[0, :, tl - r0 : tl - r0 + b - a].transpose(0, 1)
    return out


def _mask(packed: int, exact: int, dtype: torch.dtype) -> torch.Tensor:
    """``[exact, packed + exact]``: 0 over the packed columns, then a causal mask over the exact
    rows (row ``r`` sees exact columns ``0..r``, -inf past them). A segment with ``lp`` packed keys
    and ``ew`` exact rows reads the view ``[:, packed - lp : packed + ew]``."""
    m = torch.zeros(exact, packed + exact, dtype=dtype)
    m[:, packed:] = torch.full((exact, exact), float("-inf"), dtype=dtype).triu(1)
    return m


def _packed_sources(
    p: PagedContext, n: torch.Tensor, sink: torch.Tensor, length: torch.Tensor, d: int, dt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The rows packed parts read, ``[H, X, D]`` keys and values of ``dt``: every tile read
    dequantized once, then the sink rows of the slots read, then one zero row. With them: the
    source tile of each sequence's ``i``-th tile ``[B, width]``, each sequence's sink slot among the
    slots read ``[B]`` and where the sink rows start."""
    h, t = p.cache.shape[1], p.scheme.group_size
    bsz = n.shape[0]
    width = int(n.max()) if bsz else 0
    cols = torch.arange(width)[None, :]
    reads = (cols < n[:, None]) & (length[:, None] > 0)
    ids = torch.where(reads, p.block_table[:, :width].long(), 0)
    blocks, which = torch.unique(ids[reads], return_inverse=True)
    tile_of = torch.zeros(bsz, width, dtype=torch.long)
    tile_of[reads] = which
    src_k, src_v = [], []
    u = blocks.shape[0]
    if u:
        dk, dv = dequantize_blocks(p.cache, blocks, p.scheme, d, dt)  # [H, U, T, D]
        src_k.append(dk.view(h, u * t, d))
        src_v.append(dv.view(h, u * t, d))
    sink_slot = torch.zeros(bsz, dtype=torch.long)
    if p.sink_k is not None and p.sink_v is not None and bool((sink > 0).any()):
        slots = p.sink_slot.long() if p.sink_slot is not None else torch.arange(bsz)
        used, slot_of = torch.unique(slots[sink > 0], return_inverse=True)
        sink_slot[sink > 0] = slot_of
        src_k.append(p.sink_k.index_select(0, used).transpose(0, 1).reshape(h, -1, d).to(dt))
        src_v.append(p.sink_v.index_select(0, used).transpose(0, 1).reshape(h, -1, d).to(dt))
    zero = torch.zeros(h, 1, d, dtype=dt)
    return torch.cat([*src_k, zero], 1), torch.cat([*src_v, zero], 1), tile_of, sink_slot, u * t


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
    p: PagedContext,
    n: torch.Tensor,
    sink: torch.Tensor,
    sink_slot: torch.Tensor,
    length: torch.Tensor,
    q_lens: torch.Tensor,
) -> list[list[int]]:
    """Sequences with new tokens, in runs of consecutive ones whose packed parts are prefixes of
    the run's last one (the segments of one request: same blocks in order, same sink rows); a
    sequence without a packed part is a run of its own."""
    width = int(n.max())
    bt = p.block_table[:, :width]
    cols = torch.arange(width)[None, :]
    same = ((bt[1:] == bt[:-1]) | (cols >= n[:-1, None])).all(1) & (n[1:] >= n[:-1])
    same &= (sink[1:] == sink[:-1]) & (sink_slot[1:] == sink_slot[:-1]) & (length[:-1] > 0)
    chains: list[list[int]] = []
    for s, (has, joins) in enumerate(zip((q_lens > 0).tolist(), [False, *same.tolist()], strict=True)):
        if not has:
            continue
        if joins and chains and chains[-1][-1] == s - 1:
            chains[-1].append(s)
        else:
            chains.append([s])
    return chains
