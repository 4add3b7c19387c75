"""A layer's forward: only op launches over the step's tensors (:mod:`kvarn.vllm.step`).

No loop over requests, no host synchronisation, no tensor built from Python lists. Partial tiles
are read by slot id from the step's scratch tiles, loaded from the requests' tail pages
(:mod:`kvarn.vllm.tail`); sink slots from the sink pool. The ops are the engine's
:class:`~kvarn.kernels.api.AttentionOps` (:attr:`kvarn.vllm.context.EngineSpec.ops`), over one
:class:`~kvarn.kernels.api.PagedContext` per layer and step. Tiles are stored without the NaN check
of ``check_finite`` (a host sync per layer).
"""

from __future__ import annotations

import torch

from kvarn.kernels.api import AttentionOps, PagedContext
from kvarn.kernels.dispatch import ops_for
from kvarn.schemes import Scheme
from kvarn.vllm.pools import Pool
from kvarn.vllm.step import StepTensors, Writes
from kvarn.vllm.tail import load_rows, save_rows


def write_rows(pool: torch.Tensor, rows: torch.Tensor, w: Writes | None) -> None:
    """``pool[slot[n], :, row[n]] = rows[src[n]]`` for every write ``n``: ``pool`` ``[S, H, R, D]``,
    ``rows`` ``[N, H, D]`` (an MLA pool ``[S, R, W]`` as ``[S, 1, R, W]``)."""
    if w is None:
        return
    src, slot, row = w
    pool[slot, :, row] = rows.index_select(0, src).to(pool.dtype)


def _write(pool: Pool, key: torch.Tensor, value: torch.Tensor, w: Writes | None) -> None:
    """Keys and values of the writes ``w`` into ``pool`` (:func:`write_rows`)."""
    if w is None:
        return
    write_rows(pool[0], key, w)
    write_rows(pool[1], value, w)


def gather_full_tiles(
    pool: torch.Tensor, rows: torch.Tensor, st: StepTensors, group_size: int, token_dim: int
) -> torch.Tensor:
    """The tiles that became full this step, one per ``st.full_blocks`` entry: staged ones whole from
    their ``pool`` slot (``st.full_slots``), then those this step's ``rows`` ``[N, ...]`` fill alone
    (``st.full_tokens``), with the token axis moved to ``token_dim`` as in the pool and its dtype."""
    parts = []
    if st.full_slots is not None:
        parts.append(pool.index_select(0, st.full_slots))
    if st.full_tokens is not None:
        tiles = rows.index_select(0, st.full_tokens).view(-1, group_size, *rows.shape[1:])
        parts.append(tiles.movedim(1, token_dim).to(pool.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def store_full_tiles(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: torch.Tensor,
    stage: Pool,
    st: StepTensors,
    scheme: Scheme,
    ops: AttentionOps,
) -> None:
    """Quantize the tiles that became full this step into their pages (``[NB, H, >= tile_bytes]`` uint8)."""
    if st.full_blocks is None:
        return
    d, t = key.shape[2], scheme.group_size
    k = gather_full_tiles(stage[0], key, st, t, token_dim=2)  # [F, H, T, D]
    v = gather_full_tiles(stage[1], value, st, t, token_dim=2)
    ops.store_tiles(k, v, pages[:, :, : scheme.tile_bytes(d)], st.full_blocks, scheme)  # no check_finite: a sync


def run_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pages: torch.Tensor,
    sink: Pool | None,
    st: StepTensors,
    scheme: Scheme,
    scale: float,
    out: torch.Tensor,
    ops: AttentionOps | None = None,
) -> None:
    """Commit this step's keys/values, then attend, for one layer.

    Args:
        query: ``[N, Hq, D]``; key, value: ``[N, H, D]`` (model dtype, unrotated; ``N >= st.num_tokens``).
        pages: ``[num_blocks, H, page_bytes]`` uint8 (``page_bytes >= scheme.tile_bytes(D)``).
        sink: sink pool ``[num_sink_slots, H, S, D]`` keys and values (schemes with sinks), else None.
        st: the step's tensors from the metadata builder, with its tail moves: partial tiles are read
            from ``pages`` into the step's scratch tiles and this step's rows saved back
            (:mod:`kvarn.vllm.tail`).
        scheme: this layer's scheme (no per-layer overrides).
        scale: softmax scale.
        out: ``[N, Hq, D]``; rows ``0..st.num_tokens-1`` are written.
        ops: the attention ops (default :func:`~kvarn.kernels.dispatch.ops_for` the query's device).
    """
    n = st.num_tokens
    q, k, v, o = query[:n], key[:n], value[:n], out[:n]
    if st.tail is None or st.layout is None or st.scratch is None:
        raise ValueError("kvarn: a step without tail moves (build_step's tail, layout and scratch)")
    stage = st.scratch.get(st.tail.slots, k, scheme.group_size)  # the staged rows, read from pages
    load_rows(pages, stage, st.tail, st.layout)
    _write(stage, k, v, st.stage_pre)
    if sink is not None:
        _write(sink, k, v, st.sink_writes)
    ops = ops or ops_for(query.device)
    store_full_tiles(k, v, pages, stage, st, scheme, ops)
    cache = pages[:, :, : scheme.tile_bytes(query.shape[2])]
    ctx = PagedContext(
        cache, st.block_table, st.num_tiles, stage[0], stage[1], st.tail_lens, scheme, tail_slot=st.tail_slot,
        sink_k=sink[0] if sink is not None else None, sink_v=sink[1] if sink is not None else None,
        sink_lens=st.sink_lens if sink is not None else None, sink_slot=st.sink_slot if sink is not None else None,
        scale=scale,
    )  # fmt: skip
    if st.decode:
        ops.decode_attention(q, ctx, out=o)
    else:
        ops.prefill_attention(
            q, k, v, st.cu_seqlens, ctx, max_query_len=st.max_query_len, out=o, decode_rows=st.decode_rows
        )
    save_rows(pages, k, v, st.tail, st.layout)
