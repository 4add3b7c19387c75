"""The contract both attention backends implement: one argument (:class:`PagedContext`) and one
protocol (:class:`AttentionOps`); :func:`kvarn.kernels.dispatch.ops_for` picks the backend of a device.

Paged cache layout (one layer)::

    cache        [num_blocks, H, tile_bytes] uint8   one packed record per (block, KV head); record
                                                     layout: kvarn.codec.tiles.layout
    block_table  [B, max_blocks] int32   block ids of each sequence's full tiles, in token order
    num_tiles    [B] int32               how many entries of block_table are full (packed) tiles
    tail_k/v     [B, H, T, D] fp16/bf16/fp32, unrotated: the tile being filled (T = group_size);
                 with tail_slot [B] int32 the staging pool [num_slots, H, T, D], sequence b reading
                 rows 0..tail_lens[b]-1 of tail_k[tail_slot[b]]; tail_lens [B] int32
    sink_k/v     [B, H, R, D] (with sink_slot the sink pool [num_sink_slots, H, R, D]), unrotated
                 exact first tokens in rows 0..sink_lens[b]-1; sink_lens [B] int32. Required when
                 scheme.sink_len > 0; R = T for a sink tile, sink_tokens..T for sink tokens.

A sequence's context is, in token order:

* ``scheme.sink_tile``: ``sink_lens`` sink tokens (the whole first tile, kept instead of a packed
  one), ``num_tiles`` packed tiles, ``tail_lens`` tail tokens.
* ``scheme.sink_tokens = S``: ``num_tiles`` packed tiles (tile 0 included) then the tail; positions
  ``0..min(sink_lens[b], S)-1`` of tile ``block_table[b, 0]`` are read from the exact copies, and
  none while ``num_tiles[b] == 0`` (tile 0's tokens are still in the tail). Larger ``sink_lens``
  are clamped.
* otherwise: ``num_tiles`` packed tiles then the tail.

Queries, keys and outputs are unrotated; the kernels rotate inside. Staging tensors may be any
strided views whose last axis is contiguous; keys and values share strides. Slot ids are valid
indices (0 where a sequence reads no row).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Protocol

import torch

from kvarn.schemes.scheme import Scheme

__all__ = ["AttentionOps", "PagedContext", "split_lengths"]


@dataclass(frozen=True)
class PagedContext:
    """One layer's cached context for a batch of ``B`` sequences (layout in the module doc)."""

    cache: torch.Tensor  # [num_blocks, H, tile_bytes] uint8
    block_table: torch.Tensor  # [B, max_blocks] int32
    num_tiles: torch.Tensor  # [B] int32
    tail_k: torch.Tensor  # [B or num_slots, H, T, D]
    tail_v: torch.Tensor  # same shape, dtype and strides as tail_k
    tail_lens: torch.Tensor  # [B] int32
    scheme: Scheme  # without per-layer overrides
    _: KW_ONLY
    tail_slot: torch.Tensor | None = None  # [B] int32: staging slot of each sequence (None: slot b)
    sink_k: torch.Tensor | None = None  # [B or num_sink_slots, H, R, D]
    sink_v: torch.Tensor | None = None
    sink_lens: torch.Tensor | None = None  # [B] int32
    sink_slot: torch.Tensor | None = None  # [B] int32 (None: slot b)
    scale: float | None = None  # softmax scale; None: 1 / sqrt(D)

    def sm_scale(self, head_dim: int) -> float:
        """The softmax scale: :attr:`scale`, or ``1 / sqrt(head_dim)``."""
        return self.scale if self.scale is not None else head_dim**-0.5

    def sink_count(self) -> torch.Tensor:
        """Sink rows each sequence reads, ``[B]`` int64 (reads the lengths on the host's side of
        the tensors): clamped to the pool's capacity; with ``sink_tokens`` also to ``S``, and 0
        until tile 0 is packed."""
        if self.sink_k is None or self.sink_lens is None:
            return torch.zeros(self.num_tiles.shape[0], dtype=torch.long, device=self.num_tiles.device)
        cap = self.sink_k.shape[2]
        if self.scheme.sink_tokens:
            cap = min(cap, self.scheme.sink_tokens)
        n = self.sink_lens.long().clamp(0, cap)
        return torch.where(self.num_tiles > 0, n, 0) if self.scheme.sink_tokens else n


class AttentionOps(Protocol):
    """Attention over a :class:`PagedContext` and the store of full tiles: one backend's ops.

    Implemented by the modules :mod:`kvarn.kernels.triton.ops` (CUDA; CPU tensors under
    ``TRITON_INTERPRET=1``) and :mod:`kvarn.kernels.cpu.ops`.
    """

    def decode_attention(
        self, query: torch.Tensor, ctx: PagedContext, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One new token per sequence: ``query`` ``[B, Hq, D]`` -> ``[B, Hq, D]`` in its dtype
        (``out`` when given); query head ``h`` reads KV head ``h // (Hq // H)``; a sequence with no
        token gets zeros. ``tail_lens`` counts the new token (already staged)."""
        ...

    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        ctx: PagedContext,
        *,
        max_query_len: int | None = None,
        out: torch.Tensor | None = None,
        decode_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of new tokens over ``ctx`` plus themselves: ``query`` ``[N, Hq, D]``,
        ``key``/``value`` ``[N, H, D]`` packed by sequence at ``cu_seqlens_q`` ``[B + 1]`` int32;
        ``max_query_len`` bounds any sequence's new tokens; ``decode_rows`` ``[B]`` bool (host, or
        None: unknown) marks the sequences whose new tokens follow their prompt, which a backend may
        attend as decode rows. Returns ``[N, Hq, D]``."""
        ...

    def store_tiles(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        cache: torch.Tensor,
        block_ids: torch.Tensor,
        scheme: Scheme,
        *,
        check_finite: bool = False,
    ) -> None:
        """Quantize full tiles ``[N, H, T, D]`` into records ``cache[block_ids[n], h]``, in place."""
        ...


def split_lengths(seq_lens: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Context lengths ``[B]`` -> ``(num_tiles, tail_lens, sink_lens)`` ``[B]`` int32 for this layout.

    With ``scheme.sink_tile`` the first ``group_size`` tokens are sink tokens and every full tile
    after them is packed. With ``scheme.sink_tokens = S`` every full tile is packed and
    ``sink_lens`` is ``min(len, S)`` once the first tile is packed, else 0 (the tokens are still in
    the tail). Otherwise ``sink_lens`` is None. The rest is the tail.

    Example:
        >>> lens = torch.tensor([1, 40, 64])
        >>> [x.tolist() for x in split_lengths(lens, Scheme.from_name("kvarn_k4v2_g32_sink2"))]
        [[0, 1, 2], [1, 8, 0], [0, 2, 2]]
    """
    lens = seq_lens.to(torch.int32)
    t = scheme.group_size
    sink = torch.clamp(lens, max=t) if scheme.sink_tile else None
    rest = lens - sink if sink is not None else lens
    tiles = torch.div(rest, t, rounding_mode="floor")
    if scheme.sink_tokens:
        sink = torch.where(tiles > 0, torch.clamp(lens, max=scheme.sink_tokens), 0)
    return tiles.to(torch.int32), (rest - tiles * t).to(torch.int32), None if sink is None else sink.to(torch.int32)
