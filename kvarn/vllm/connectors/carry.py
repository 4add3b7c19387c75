"""What a request's KV is in a kvarn engine, read out of and written into its pages and sink pool.

A request of ``N`` tokens holds (see ``docs/connectors.md``):

* ``N // T`` **tiles**: block ``j`` of its block table holds tile ``j``'s packed record, the first
  ``tile_bytes`` of each KV head's page (``pages[block, h, :tile_bytes]``);
* ``N % T`` **tail rows** of its partial tile ``n = N // T``: row ``r`` in the page of block-table
  entry ``k`` at row offset ``o`` (``layout.address(n, r)``), bytes ``o * row_bytes ..`` of each
  head's page (:mod:`kvarn.vllm.tail`);
* its **sink rows**: the exact first ``capacity`` tokens, in the sink pool slot keyed by its first
  block (:mod:`kvarn.vllm.sinks`; :meth:`~kvarn.vllm.sinks.SinkPool.full_slot` finds it,
  :meth:`~kvarn.vllm.sinks.SinkPool.adopt` gives a loaded sequence one).

Pages are one layer's ``[num_blocks, H, page_bytes]`` uint8; every function moves bytes as they
are, so a record read here and written into another engine's pages of the same layout is the same KV.
"""

from __future__ import annotations

import torch

from kvarn.vllm.pools import Pool
from kvarn.vllm.tail import TailLayout


def read_tiles(pages: torch.Tensor, blocks: list[int], tile_bytes: int) -> torch.Tensor:
    """The packed records of ``blocks``: ``[len(blocks), H, tile_bytes]`` uint8 (a copy)."""
    index = torch.tensor(blocks, dtype=torch.long, device=pages.device)
    return pages[:, :, :tile_bytes].index_select(0, index)


def write_tiles(pages: torch.Tensor, blocks: list[int], records: torch.Tensor, tile_bytes: int) -> None:
    """``pages[blocks[i], :, :tile_bytes] = records[i]`` (``records`` ``[len(blocks), H, tile_bytes]`` uint8).

    Raises:
        ValueError: ``records`` is not of that shape and dtype (nothing written).
    """
    _check("tile records", records, (len(blocks), pages.shape[1], tile_bytes))
    index = torch.tensor(blocks, dtype=torch.long, device=pages.device)
    pages[:, :, : records.shape[2]].index_copy_(0, index, records.to(pages.device))


def tail_addresses(layout: TailLayout, row: list[int], tile: int, rows: int) -> list[tuple[int, int]]:
    """``(block id, first byte)`` within each head's page of rows ``0 .. rows - 1`` of ``tile``, for
    a request whose block table is ``row`` (its tiles, then its lookahead blocks).

    Raises:
        ValueError: ``row`` is too short to hold the tail blocks of ``tile``.
    """
    out = []
    for r in range(rows):
        k, off = layout.address(tile, r)
        if k >= len(row):
            raise ValueError(
                f"kvarn: tail row {r} of tile {tile} lies in block-table entry {k}, beyond the {len(row)} blocks given"
            )
        out.append((row[k], off * layout.row_bytes))
    return out


def read_tail(pages: torch.Tensor, layout: TailLayout, row: list[int], tile: int, rows: int) -> torch.Tensor:
    """Rows ``0 .. rows - 1`` of ``tile``'s tail: ``[rows, H, row_bytes]`` uint8 (a copy)."""
    rb = layout.row_bytes
    parts = [pages[b, :, o : o + rb] for b, o in tail_addresses(layout, row, tile, rows)]
    return torch.stack(parts) if parts else pages.new_empty((0, pages.shape[1], rb))


def write_tail(pages: torch.Tensor, layout: TailLayout, row: list[int], tile: int, rows: torch.Tensor) -> None:
    """Write ``rows`` ``[n, H, row_bytes]`` uint8 as rows ``0 .. n - 1`` of ``tile``'s tail.

    Raises:
        ValueError: ``rows`` is not of that shape and dtype, or ``row`` holds too few blocks (nothing written).
    """
    rb = layout.row_bytes
    _check("tail rows", rows, (rows.shape[0], pages.shape[1], rb))
    for i, (b, o) in enumerate(tail_addresses(layout, row, tile, rows.shape[0])):
        pages[b, :, o : o + rb] = rows[i].to(pages.device)


def read_sink(pool: Pool, slot: int) -> torch.Tensor:
    """Slot ``slot`` of a layer's sink pool: ``[2, H, capacity, D]`` (keys, values; a copy)."""
    return torch.stack([pool[0][slot], pool[1][slot]])


def write_sink(pool: Pool, slot: int, rows: torch.Tensor) -> None:
    """Fill slot ``slot`` of a layer's sink pool with ``rows`` ``[2, H, capacity, D]``.

    Raises:
        ValueError: ``rows`` is not of that shape (nothing written).
    """
    _check("sink rows", rows, (2, *pool[0].shape[1:]), pool[0].dtype)
    pool[0][slot] = rows[0].to(pool[0].device, pool[0].dtype)
    pool[1][slot] = rows[1].to(pool[1].device, pool[1].dtype)


def _check(what: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> None:
    """Raise ValueError unless ``t`` has ``shape`` and ``dtype`` (a record of another layout or scheme)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{what} of shape {list(t.shape)} {t.dtype}, this layer holds {list(shape)} {dtype}")
