"""The CUDA path of the kvarn backend: the same plan as :mod:`kvarn.vllm.torch_path`, run by
the Triton kernels of :mod:`kvarn.kernels` (``prefill_attention`` / ``decode_attention`` over the
paged cache, ``store_tiles`` for tiles that became full).

The kernels read ``cache`` as ``[num_blocks, num_kv_heads, tile_bytes]``; a page is exactly one
record per head unless a preset gives layers different bit widths (pages then hold the widest
record), in which case :func:`usable` is False and the torch path serves the layer.

Schemes with ``sink_tokens``: the kernels take each request's exact first tokens as ``sink_k/v``
(``[B, H, group_size, D]``, rows ``0..sink_lens[b]-1`` from its sink slot, zeros beyond) and use
them in place of those positions of its first packed tile; the copies are written by the shared
:func:`~kvarn.vllm.torch_path.stage_and_collect`.
"""

from __future__ import annotations

import torch

from kvarn.schemes import Scheme
from kvarn.vllm.staging import RequestPlan
from kvarn.vllm.torch_path import stage_and_collect


def usable(cache: torch.Tensor, scheme: Scheme, head_dim: int) -> bool:
    """Whether the kernels can address this layer's pages (page bytes == this layer's record bytes).

    Sink tiles are not served by the backend; in-tile sink tokens are (the kernels take the copies).
    """
    return cache.shape[-1] == scheme.tile_bytes(head_dim) and not scheme.sink_tile


_NO_SINK: tuple[None, None, None] = (None, None, None)


def _sinks(
    plans: list[RequestPlan], sink: tuple[torch.Tensor, torch.Tensor] | None, stage_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None]:
    """The kernels' ``sink_k, sink_v`` ``[B, H, T, D]`` (exact first tokens in rows
    ``0..sink_lens[b]-1``, zeros beyond) and ``sink_lens`` ``[B]`` int32; Nones without slots."""
    if sink is None:
        return _NO_SINK
    b, (_, h, t, d), s = len(plans), stage_k.shape, sink[0].shape[2]
    sink_k = torch.zeros(b, h, t, d, dtype=sink[0].dtype, device=sink[0].device)
    sink_v = torch.zeros_like(sink_k)
    slots = torch.tensor([max(p.sink_slot, 0) for p in plans], dtype=torch.long, device=sink[0].device)
    sink_k[:, :, :s] = sink[0].index_select(0, slots)
    sink_v[:, :, :s] = sink[1].index_select(0, slots)
    lens = torch.tensor([p.sink_read for p in plans], dtype=torch.int32, device=sink[0].device)
    return sink_k, sink_v, lens


def _context(
    plans: list[RequestPlan], stage_k: torch.Tensor, stage_v: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table ``[B, max_tiles]``, num_tiles ``[B]``, tails ``[B, H, T, D]`` and tail_lens ``[B]``."""
    b = len(plans)
    width = max([len(p.ctx_blocks) for p in plans] + [1])
    table = torch.zeros(b, width, dtype=torch.int32)
    for i, p in enumerate(plans):
        table[i, : len(p.ctx_blocks)] = torch.tensor(p.ctx_blocks, dtype=torch.int32)
    num_tiles = torch.tensor([len(p.ctx_blocks) for p in plans], dtype=torch.int32)
    slots = torch.tensor([max(p.read_slot, 0) for p in plans], dtype=torch.long, device=stage_k.device)
    tail_lens = torch.tensor([p.staged_read for p in plans], dtype=torch.int32)
    return (
        table.to(device),
        num_tiles.to(device),
        stage_k.index_select(0, slots),
        stage_v.index_select(0, slots),
        tail_lens.to(device),
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    plans: list[RequestPlan],
    scheme: Scheme,
    scale: float,
    output: torch.Tensor,
    *,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Same contract as :func:`kvarn.vllm.torch_path.attend` (``cache`` ``[B, H, 1, page_bytes]``)."""
    from kvarn.kernels import ops

    live = [p for p in plans if p.q_len > 0]
    if not live:
        return
    pages = cache[:, :, 0, :]
    table, num_tiles, tail_k, tail_v, tail_lens = _context(live, stage_k, stage_v, query.device)
    sink_k, sink_v, sink_lens = _sinks(live, sink, stage_k)
    if all(p.q_len == 1 for p in live):
        idx = torch.tensor([p.q_start for p in live], dtype=torch.long, device=query.device)
        # the new token joins its tail unquantized (the tails are copies), as in the torch path
        rows = torch.arange(len(live), device=query.device)
        pos = tail_lens.long()
        tail_k[rows, :, pos] = key.index_select(0, idx).to(tail_k.dtype)
        tail_v[rows, :, pos] = value.index_select(0, idx).to(tail_v.dtype)
        tail_lens = tail_lens + 1
        paged = (pages, table, num_tiles, tail_k, tail_v, tail_lens, scheme)
        q = query.index_select(0, idx)
        out = ops.decode_attention(q, *paged, sink_k=sink_k, sink_v=sink_v, sink_lens=sink_lens, sm_scale=scale)
        output.index_copy_(0, idx, out.to(output.dtype))
        return
    first, last = live[0].q_start, live[-1].q_start + live[-1].q_len
    cu = torch.tensor([p.q_start - first for p in live] + [last - first], dtype=torch.int32, device=query.device)
    sl = slice(first, last)
    if sum(p.q_len for p in live) != last - first:  # requests with no tokens in between: not expected
        raise RuntimeError("kvarn: the step's query tokens are not contiguous per request")
    paged = (pages, table, num_tiles, tail_k, tail_v, tail_lens, scheme)
    out = ops.prefill_attention(
        query[sl], key[sl], value[sl], cu, *paged, sink_k=sink_k, sink_v=sink_v, sink_lens=sink_lens, sm_scale=scale
    )
    output[sl] = out.to(output.dtype)


def commit(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    plans: list[RequestPlan],
    scheme: Scheme,
    *,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Same contract as :func:`kvarn.vllm.torch_path.commit`, quantizing with ``store_tiles``."""
    from kvarn.kernels import ops

    full = stage_and_collect(key, value, stage_k, stage_v, plans, scheme.group_size, sink)
    if full is None:
        return
    k, v, blocks = full
    idx = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    ops.store_tiles(k.contiguous(), v.contiguous(), cache[:, :, 0, :], idx, scheme, check_finite=True)
