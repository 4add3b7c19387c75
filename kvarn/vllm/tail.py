"""The 16-bit tail of each running request, kept in blocks of vLLM's own pool.

A tile's scales need all of its ``T`` tokens, so the tokens of a partially filled tile wait
unquantized. They wait in the request's own *lookahead blocks*: the kvarn KV-cache manager
(:class:`kvarn.vllm.tail_spec.TailManager`) gives every request ``L`` blocks beyond the tiles its tokens fill, taken from
the block pool vLLM sizes when the request is scheduled and freed with it. The tail of tile ``j``
lives in the pages of blocks ``j + 1 .. j + L`` of the request's block table, which hold no packed
tile until the sequence reaches them. So the memory of tails follows the requests that actually run:
no pool is sized by ``max_num_seqs``, and the KV capacity vLLM reports is the packed one (vLLM's
"Maximum concurrency" log counts a request's tiles only; kvarn's start-up line,
:func:`kvarn.vllm.tail_cost.describe`, gives what a request holds with its tail).

Layout (:class:`TailLayout`): a page holds, per KV head, ``rows_per_page`` rows of keys then values
in the model dtype (``[rows_per_page, 2, D]``). Two orders, one per engine:

- *forward* (no speculative decoding): row ``r`` of tile ``j`` sits in page ``j + r //
  rows_per_page`` of the request's block table, row ``r % rows_per_page``. The partial tile's own
  block holds its first rows until the tile fills and its packed record replaces them (they are read
  into the step's scratch tile first), and the next tile starts in the block after it. A request
  holds ``L`` blocks beyond its complete tiles, the first of them its partial tile's own
  (:meth:`TailLayout.table_blocks`).
- *backward* (speculative decoding, which rolls a request back into a tile it completed): row ``r``
  of tile ``j`` sits at linear index ``x = L * rows_per_page - 1 - r`` of the ``L`` pages after
  block ``j``: page ``j + 1 + x // rows_per_page``, row ``x % rows_per_page``. Filling backwards keeps
  a tile's rows intact while the next tile writes its first ``rows_per_page - 1`` rows (their pages
  differ), so a step whose draft tokens are rejected still finds the rows of that tile; rows the
  next tile writes later overwrite them, and by then no rollback can reach them. The packed record
  of tile ``j`` goes into block ``j`` itself, which then holds no row anyone reads. A request holds
  ``L`` blocks beyond every tile it touches: one more than in the forward order while a tile is
  partial.

``L = ceil(T / rows_per_page)``, e.g. 5 for ``kvarn_k4v2_g128`` at head_dim 64 or 128 in bfloat16.
A request holds its ``L`` blocks from its first step, not as its rows arrive: allocated row by row,
a burst of requests is admitted by its tiles alone and then preempted as the rows come (measured
in docs/capacity.md). The rows of the smallest page of the model's kvarn layers set
``rows_per_page`` for all of them.

The same layout serves the two other page kinds. An MLA layer's page is one latent record
(:mod:`kvarn.vllm.mla`): one "head", rows of one vector (the latent and RoPE key, ``vectors=1``).
A hybrid (Mamba / linear-attention) model's vLLM blocks hold several tiles, which vLLM splits into
one-tile kernel blocks for kvarn: ``L`` counts kernel blocks, and the manager allocates the vLLM
blocks that cover them (:func:`kvarn.vllm.tail_spec.with_tail`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvarn.schemes import Scheme
from kvarn.vllm.staging import RequestPlan

logger = logging.getLogger("kvarn.vllm")


@dataclass(frozen=True)
class TailLayout:
    """Where the 16-bit rows of a partial tile live (see the module docstring).

    ``group_size``: tokens per tile (``T``); ``rows_per_page``: rows per page and KV head;
    ``blocks``: the most tail blocks a request holds (``L``, one-tile kernel blocks); ``head_dim`` and
    ``dtype``: of the rows (keys then values of one KV head, the model dtype); ``vectors``: vectors
    of ``head_dim`` per row (2: a key and a value; 1: an MLA latent row); ``forward``: the forward
    order (no rollback), else the backward one.
    """

    group_size: int
    rows_per_page: int
    blocks: int
    head_dim: int
    dtype: torch.dtype
    vectors: int = 2
    forward: bool = False

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: the key and value of one KV head (an MLA row: its one vector)."""
        return self.vectors * self.head_dim * self.dtype.itemsize

    def address(self, tile: int, row: int) -> tuple[int, int]:
        """``(index into the request's block row, row within that page)`` of row ``row`` of ``tile``."""
        if self.forward:
            return tile + row // self.rows_per_page, row % self.rows_per_page
        x = self.blocks * self.rows_per_page - 1 - row
        return tile + 1 + x // self.rows_per_page, x % self.rows_per_page

    def table_blocks(self, tokens: int) -> int:
        """Kernel blocks a request of ``tokens`` tokens holds in its block table: ``L`` beyond its
        complete tiles (forward), or beyond every tile it touches (backward); none before a token."""
        if tokens <= 0:
            return 0
        full, rows = divmod(tokens, self.group_size)
        return full + (rows > 0 and not self.forward) + self.blocks


def tail_layout(
    scheme: Scheme, head_dim: int, num_layers: int, dtype: torch.dtype, max_rollback: int = 0
) -> TailLayout:
    """The tail layout of a model whose kvarn layers follow ``scheme`` (per-layer overrides included).

    ``max_rollback``: the most tokens a step may roll back (the speculative tokens per step).

    Raises:
        ValueError: a page holds no 16-bit row, or too few rows to survive a rollback.
    """
    pages = [s.tile_bytes(head_dim) for i in range(max(num_layers, 1)) if (s := scheme.for_layer(i)) is not None]
    if not pages:
        raise ValueError(f"{scheme.name}: no layer of the model is quantized")
    return page_layout(scheme, min(pages), head_dim, dtype, max_rollback)


def page_layout(
    scheme: Scheme, page: int, head_dim: int, dtype: torch.dtype, max_rollback: int = 0, vectors: int = 2
) -> TailLayout:
    """The tail layout of pages of ``page`` bytes per KV head holding rows of ``vectors`` x ``head_dim``
    numbers of ``dtype`` (an MLA model: its latent record and ``vectors=1``, ``head_dim`` the row width).

    Raises:
        ValueError: a page holds no row, or too few rows to survive a rollback of ``max_rollback`` tokens.
    """
    rows = page // (vectors * head_dim * dtype.itemsize)
    if rows <= max_rollback:
        raise ValueError(
            f"{scheme.name}: a page of {page} bytes per KV head holds {rows} 16-bit rows of {vectors} x "
            f"{head_dim} in {dtype}; the tail needs more than the {max_rollback} speculative tokens per step. "
            "Use fewer speculative tokens or a scheme with more bits."
        )
    blocks = math.ceil(scheme.group_size / rows)
    return TailLayout(scheme.group_size, rows, blocks, head_dim, dtype, vectors, forward=max_rollback == 0)


@dataclass
class TailMoves:
    """A step's traffic between the tails in pages and the step's 16-bit scratch tiles.

    ``slots``: scratch tiles this step uses (``[slots, H, T, D]`` keys and values, see
    :func:`kvarn.vllm.forward.run_layer`); ``loads``: ``(slot, row, block, offset)`` ``[n]`` int64
    each, the staged rows read from pages into scratch before anything else; ``saves``: ``(token,
    block, offset)`` ``[m]`` int64 each, this step's rows written into pages at the end. Every layer
    of a step moves the same rows, so the index tensors built for them are kept (``index``).
    """

    slots: int
    loads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    saves: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    index: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, repr=False)


def plan_tails(
    query_start: list[int], seq_lens: list[int], block_rows: list[list[int]], layout: TailLayout, device: torch.device
) -> tuple[list[RequestPlan], TailMoves]:
    """Plan one step of paged tails: each request's plan (scratch slots numbered within the step) and
    the loads and saves of its 16-bit rows.

    Args:
        query_start: ``[num_reqs + 1]`` offsets of each request's new tokens.
        seq_lens: ``[num_reqs]`` tokens of each request after this step.
        block_rows: per request, its block ids: its tiles, then its ``layout.blocks`` lookahead blocks.
        layout: where the rows live.
        device: where the moves' tensors go.

    In the forward order a request saves the rows of its partial tile only. In the backward order it
    saves from the first row of its last tile, full or not, or of the tile before when the last one
    holds fewer than ``rows_per_page`` rows (a rollback may return to them).
    """
    t, rpp = layout.group_size, layout.rows_per_page
    plans: list[RequestPlan] = []
    loads: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    saves: tuple[list[int], list[int], list[int]] = ([], [], [])
    slots = 0
    for i, seq_len in enumerate(seq_lens):
        q0, q_len = query_start[i], query_start[i + 1] - query_start[i]
        full = block_rows[i]
        p = RequestPlan(q0, q_len, seq_len - q_len, full[: (seq_len + t - 1) // t])
        if q_len and len(full) < (need := layout.table_blocks(seq_len)):
            raise RuntimeError(
                f"kvarn: request {i}'s block table has {len(full)} entries; its {seq_len} tokens need "
                f"{need} with their tail (vLLM did not size it by kvarn's TailSpec)"
            )
        p.dummy = q_len == 0 or not p.row or 0 in p.row
        plans.append(p)
        if p.dummy:
            continue
        staged, first = p.staged(t), p.ctx // t
        if staged:
            p.read_slot, slots = slots, slots + 1
            for r in range(staged):
                k, off = layout.address(first, r)
                loads[0].append(p.read_slot)
                loads[1].append(r)
                loads[2].append(full[k])
                loads[3].append(off)
        if seq_len % t and not (seq_len // t == first and staged):
            p.new_slot, slots = slots, slots + 1
        last = (seq_len - 1) // t
        # forward: the partial tile's rows only (a full tile's first rows share its record's block)
        backward = last * t if seq_len - last * t >= rpp else max(last - 1, 0) * t
        lo = seq_len // t * t if layout.forward else backward
        for pos in range(max(p.ctx, lo), seq_len):
            k, off = layout.address(pos // t, pos % t)
            saves[0].append(q0 + pos - p.ctx)
            saves[1].append(full[k])
            saves[2].append(off)

    def tensors(lists: tuple[list[int], ...]) -> Any:
        if not lists[0]:
            return None
        return tuple(torch.tensor(x, dtype=torch.long).to(device, non_blocking=True) for x in lists)

    return plans, TailMoves(slots, tensors(loads), tensors(saves))


def _words(pages: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``pages`` ``[NB, H, page_bytes]`` uint8 viewed in the widest integer type that divides a row
    and that the view's strides and offset allow (a row then moves as 32 int64 words, not 256 bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            try:
                return pages.view(dtype)
            except RuntimeError:
                continue
    return pages


def _cached(moves: TailMoves, key: tuple[Any, ...], build: Any) -> torch.Tensor:
    """``moves.index[key]``, built by ``build()`` for the step's first layer (every layer moves the same rows)."""
    if key not in moves.index:
        moves.index[key] = build()
    return moves.index[key]


def _row_windows(
    pages: torch.Tensor, moves: TailMoves, kind: str, block: torch.Tensor, off: torch.Tensor, layout: TailLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pages`` (in words, last axis contiguous) as the overlapping windows ``[extent - W + 1, W]`` of
    ``W`` words (one row) starting at every word, and the ``[n * H]`` windows where the rows
    ``(block, off)`` of every head start: one contiguous copy per row and head moves them."""
    words = _words(pages, layout.row_bytes)
    (nb, h, _), (s0, s1, s2) = words.shape, words.stride()
    per_row = layout.row_bytes // words.dtype.itemsize
    if s2 != 1:
        raise ValueError(f"kvarn: the pages' last axis must be contiguous, got strides {words.stride()}")
    extent = (nb - 1) * s0 + (h - 1) * s1 + words.shape[2]
    windows = words.as_strided((extent - per_row + 1, per_row), (1, 1), words.storage_offset())

    def starts() -> torch.Tensor:
        heads = torch.arange(h, device=block.device)[None, :] * s1
        return (block[:, None] * s0 + heads + off[:, None] * per_row).flatten()

    return windows, _cached(moves, (kind, h, per_row, s0, s1, words.device), starts)


def read_rows(pages: torch.Tensor, moves: TailMoves, layout: TailLayout) -> torch.Tensor:
    """The staged rows of ``moves.loads`` from ``pages`` ``[NB, H, page_bytes]`` uint8:
    ``[n, H, vectors * D]`` of ``layout.dtype`` (:func:`_row_windows`; an empty tensor without loads)."""
    if moves.loads is None:
        return torch.empty(0, pages.shape[1], layout.vectors * layout.head_dim, dtype=layout.dtype)
    _, _, block, off = moves.loads
    windows, at = _row_windows(pages, moves, "load", block, off, layout)
    return windows.index_select(0, at).view(-1, pages.shape[1], windows.shape[1]).view(layout.dtype)


def write_page_rows(pages: torch.Tensor, picked: torch.Tensor, moves: TailMoves, layout: TailLayout) -> None:
    """Write the rows of ``moves.saves`` into ``pages``: ``picked`` ``[m, H, vectors * D]``, the step's
    rows at ``moves.saves[0]`` in that order."""
    if moves.saves is None:
        return
    _, block, off = moves.saves
    picked = picked.to(layout.dtype)
    windows, at = _row_windows(pages, moves, "save", block, off, layout)
    # distinct rows never share a word, so writing through the overlapping windows is well defined
    windows.index_copy_(0, at, picked.view(windows.dtype).view(-1, windows.shape[1]))


def load_rows(
    pages: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor], moves: TailMoves, layout: TailLayout
) -> None:
    """Copy the staged rows of ``moves.loads`` from ``pages`` ``[NB, H, page_bytes]`` uint8 into the
    scratch tiles ``[slots, H, T, D]`` (keys, values).

    Rows move as whole memory rows (:func:`_row_windows`)."""
    if moves.loads is None:
        return
    slot, row, _, _ = moves.loads
    k, v = scratch
    h = pages.shape[1]
    rows = read_rows(pages, moves, layout)  # [n, H, 2 * D]
    d, t = layout.head_dim, k.shape[2]
    if k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == layout.dtype:

        def dst() -> torch.Tensor:
            return ((slot[:, None] * h + torch.arange(h, device=slot.device)) * t + row[:, None]).flatten()

        to = _cached(moves, ("scratch", h, t, k.device), dst)
        k.view(-1, d).index_copy_(0, to, rows[..., :d].reshape(-1, d))
        v.view(-1, d).index_copy_(0, to, rows[..., d:].reshape(-1, d))
        return
    k[slot, :, row] = rows[..., :d].to(k.dtype)
    v[slot, :, row] = rows[..., d:].to(v.dtype)


def save_rows(
    pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, moves: TailMoves, layout: TailLayout
) -> None:
    """Write this step's rows ``moves.saves`` of ``key``/``value`` ``[N, H, D]`` into ``pages``."""
    if moves.saves is None:
        return
    token = moves.saves[0]
    rows = torch.cat([key.index_select(0, token), value.index_select(0, token)], dim=-1)  # [m, H, 2 * D]
    write_page_rows(pages, rows, moves, layout)


class Scratch:
    """16-bit scratch tiles (``[slots, H, T, D]`` keys and values) that every layer of a step uses in
    turn, kept between steps and grown to the most slots a step has needed."""

    def __init__(self) -> None:
        self.tiles: tuple[torch.Tensor, ...] | None = None

    def _tiles(self, shape: tuple[int, ...], like: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        old = self.tiles
        fits = old is not None and len(old) == parts and old[0].shape[1:] == shape[1:] and old[0].dtype == like.dtype
        if old is None or not fits or old[0].shape[0] < shape[0] or old[0].device != like.device:
            n = max(shape[0], old[0].shape[0] if old is not None and fits else 0)
            old = self.tiles = tuple(like.new_empty((n, *shape[1:])) for _ in range(parts))
        return tuple(x[: shape[0]] for x in old)

    def get(self, slots: int, like: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots`` scratch tiles shaped for keys ``like`` ``[N, H, D]`` (its dtype and device)."""
        k, v = self._tiles((max(slots, 1), like.shape[1], group_size, like.shape[2]), like, 2)
        return k, v

    def rows(self, slots: int, like: torch.Tensor, group_size: int) -> torch.Tensor:
        """``slots`` scratch tiles ``[slots, T, W]`` of single rows ``like`` ``[N, W]`` (an MLA latent row)."""
        return self._tiles((max(slots, 1), group_size, like.shape[1]), like, 1)[0]
