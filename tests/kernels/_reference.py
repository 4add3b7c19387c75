"""Float oracles and fixtures for the kernel tests: attention over the reference-dequantized cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvarn.codec import dequantize_tiles, quantize_tiles
from kvarn.kernels import KernelArgumentError, PagedContext
from kvarn.schemes import Scheme

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``ref``, in dB."""
    ref, test = ref.double(), test.double()
    noise = (ref - test).square().sum().clamp_min(1e-300)
    return float(10 * torch.log10(ref.square().sum() / noise))


def kv_tiles(n: int, t: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with an outlier channel and a loud first token, Gaussian values: ``[n, t, d]`` float32."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, t, d, generator=g)
    k[:, :, 3] = k[:, :, 3] * 6 + 3
    k[:, 0, :] *= 4
    return k, torch.randn(n, t, d, generator=g)


@dataclass
class PagedBatch:
    """A paged cache, its block table and per-sequence lengths, plus the float context it encodes."""

    cache: torch.Tensor  # [num_blocks, Hkv, tile_bytes] uint8
    block_table: torch.Tensor  # [B, max_blocks] int32
    num_tiles: torch.Tensor  # [B] int32
    tail_k: torch.Tensor  # [B, Hkv, T, D]
    tail_v: torch.Tensor
    tail_lens: torch.Tensor  # [B] int32
    sink_k: torch.Tensor | None
    sink_v: torch.Tensor | None
    sink_lens: torch.Tensor | None
    context_k: list[torch.Tensor]  # per sequence [Hkv, L, D] float32: what attention must see
    context_v: list[torch.Tensor]

    def context(self, scheme: Scheme, pools: Pools | None = None) -> PagedContext:
        """The kernels' argument: tails and sinks per sequence, or read from ``pools`` by slot."""
        if pools is None:
            return PagedContext(
                self.cache, self.block_table, self.num_tiles, self.tail_k, self.tail_v, self.tail_lens, scheme,
                sink_k=self.sink_k, sink_v=self.sink_v, sink_lens=self.sink_lens,
            )  # fmt: skip
        return PagedContext(
            self.cache, self.block_table, self.num_tiles, pools.tail_k, pools.tail_v, self.tail_lens, scheme,
            tail_slot=pools.tail_slot, sink_k=pools.sink_k, sink_v=pools.sink_v, sink_lens=self.sink_lens,
            sink_slot=pools.sink_slot,
        )  # fmt: skip


def paged_batch(scheme: Scheme, lens: list[int], hkv: int, d: int, seed: int = 0, spare_blocks: int = 3) -> PagedBatch:
    """Quantize random contexts of ``lens`` tokens with the reference codec into a shuffled paged cache.

    With ``scheme.sink_tokens`` the sink buffers hold the exact first tokens of tile 0 (random
    rows elsewhere, and for sequences without a packed tile, where the kernels must ignore them),
    and the context sees those exact tokens in place of their dequantized ones.
    """
    t = scheme.group_size
    g = torch.Generator().manual_seed(seed + 1000)
    sink_lens = [min(n, t) for n in lens] if scheme.sink_tile else [0] * len(lens)
    tiles = [(n - s) // t for n, s in zip(lens, sink_lens, strict=True)]
    tails = [n - s - k * t for n, s, k in zip(lens, sink_lens, tiles, strict=True)]
    in_tile = [min(n, scheme.sink_tokens) if k else 0 for n, k in zip(lens, tiles, strict=True)]
    total = sum(tiles)
    num_blocks = total + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)  # non-contiguous block tables
    cache = torch.randint(0, 256, (num_blocks, hkv, scheme.tile_bytes(d)), generator=g, dtype=torch.uint8)
    max_blocks = max(max(tiles), 1) + 2
    table = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    tail_k = torch.randn(len(lens), hkv, t, d, generator=g)
    tail_v = torch.randn(len(lens), hkv, t, d, generator=g)
    sink_k = torch.randn(len(lens), hkv, t, d, generator=g) * 2
    sink_v = torch.randn(len(lens), hkv, t, d, generator=g)
    ctx_k, ctx_v = [], []
    used = 0
    for b in range(len(lens)):
        parts_k = [sink_k[b, :, : sink_lens[b]]]
        parts_v = [sink_v[b, :, : sink_lens[b]]]
        if tiles[b]:
            k, v = kv_tiles(tiles[b] * hkv, t, d, seed + 7 * b)
            recs = quantize_tiles(k, v, scheme).view(tiles[b], hkv, -1)
            blocks = perm[used : used + tiles[b]]
            used += tiles[b]
            cache[blocks] = recs
            table[b, : tiles[b]] = blocks.to(torch.int32)
            dk, dv = dequantize_tiles(recs.view(tiles[b] * hkv, -1), scheme, d)
            if in_tile[b]:  # tile 0 of head h is row h: its first tokens read exactly
                s0 = in_tile[b]
                sink_k[b, :, :s0], sink_v[b, :, :s0] = k[:hkv, :s0], v[:hkv, :s0]
                dk[:hkv, :s0], dv[:hkv, :s0] = k[:hkv, :s0], v[:hkv, :s0]
            parts_k.append(dk.view(tiles[b], hkv, t, d).permute(1, 0, 2, 3).reshape(hkv, -1, d))
            parts_v.append(dv.view(tiles[b], hkv, t, d).permute(1, 0, 2, 3).reshape(hkv, -1, d))
        parts_k.append(tail_k[b, :, : tails[b]])
        parts_v.append(tail_v[b, :, : tails[b]])
        ctx_k.append(torch.cat(parts_k, dim=1))
        ctx_v.append(torch.cat(parts_v, dim=1))

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    has_sink = scheme.sink_len > 0
    if scheme.sink_tokens:
        sink_lens = in_tile
    return PagedBatch(
        cache.to(DEVICE),
        table.to(DEVICE),
        i32(tiles),
        tail_k.to(DEVICE),
        tail_v.to(DEVICE),
        i32(tails),
        sink_k.to(DEVICE) if has_sink else None,
        sink_v.to(DEVICE) if has_sink else None,
        i32(sink_lens) if has_sink else None,
        ctx_k,
        ctx_v,
    )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None = None) -> torch.Tensor:
    """Float64 attention: ``q`` ``[L, Hq, D]``, ``k``/``v`` ``[Hkv, S, D]`` -> ``[L, Hq, D]``.

    With ``causal_offset`` query ``i`` sees keys ``0 .. causal_offset + i``.
    """
    hq, hkv = q.shape[1], k.shape[0]
    k = k.double().repeat_interleave(hq // hkv, dim=0)
    v = v.double().repeat_interleave(hq // hkv, dim=0)
    s = torch.einsum("lhd,hsd->hls", q.double().cpu(), k.cpu()) / q.shape[-1] ** 0.5
    if causal_offset is not None:
        pos = torch.arange(q.shape[0])[:, None] + causal_offset
        s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos, float("-inf"))
    return torch.einsum("hls,hsd->lhd", torch.softmax(s, dim=-1), v.cpu())


def causal_reference(
    pb: PagedBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor
) -> torch.Tensor:
    """Float64 causal attention of new tokens ``q``/``k``/``v`` (packed at ``cu``) after each
    sequence's cached context: ``[N, Hq, D]``."""
    refs = []
    for b in range(cu.shape[0] - 1):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        ctx_k = torch.cat([pb.context_k[b], k[rows].transpose(0, 1)], dim=1)
        ctx_v = torch.cat([pb.context_v[b], v[rows].transpose(0, 1)], dim=1)
        refs.append(attention(q[rows], ctx_k, ctx_v, causal_offset=pb.context_k[b].shape[1]))
    return torch.cat(refs)


def decode_reference(pb: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    """Float64 attention of one query token per sequence ``[B, Hq, D]`` over its context."""
    return torch.cat([attention(q[b : b + 1], pb.context_k[b], pb.context_v[b]) for b in range(q.shape[0])])


def named(name: str, sink_tokens: int = 0) -> Scheme:
    """``name`` with an explicit ``sink_tokens`` (built-in presets may default to exact first tokens).

    Names with their own sink suffix (``_sink``, ``_sink2``) are taken as written.
    """
    s = Scheme.from_name(name)
    return s if "_sink" in name else dataclasses.replace(s, sink_tokens=sink_tokens)


@dataclass
class Pools:
    """The staging of a :class:`PagedBatch` moved into pools read by slot id (others' rows are noise)."""

    tail_k: torch.Tensor  # [num_slots, Hkv, T, D]
    tail_v: torch.Tensor
    tail_slot: torch.Tensor  # [B] int32; 0 where the tail is empty
    sink_k: torch.Tensor | None  # [num_sink_slots, Hkv, S, D]
    sink_v: torch.Tensor | None
    sink_slot: torch.Tensor | None


def to_pools(pb: PagedBatch, scheme: Scheme, spare: int, seed: int = 0) -> Pools:
    """Copy each sequence's tail and sink into a random slot of pools with ``spare`` extra slots.

    Slots are a permutation (sequence b rarely gets slot b); unused rows hold random values, so a
    kernel that read the wrong slot or rows past the lengths would fail the oracle. A sequence with
    an empty tail gets slot 0 (another sequence's), as the contract allows. The sink pool holds
    ``sink_tokens`` rows per slot (a sink tile: ``group_size``).
    """
    g = torch.Generator().manual_seed(seed + 77)
    bsz, hkv, t, d = pb.tail_k.shape
    slots = torch.randperm(bsz + spare, generator=g)[:bsz]
    tail_k = torch.randn(bsz + spare, hkv, t, d, generator=g).to(pb.tail_k)
    tail_v = torch.randn(bsz + spare, hkv, t, d, generator=g).to(pb.tail_v)
    tail_k[slots], tail_v[slots] = pb.tail_k, pb.tail_v
    tail_slot = torch.where(pb.tail_lens.cpu() > 0, slots, 0).to(torch.int32)
    sink_k = sink_v = sink_slot = None
    if pb.sink_k is not None and pb.sink_v is not None:
        rows = t if scheme.sink_tile else scheme.sink_tokens
        sslots = torch.randperm(bsz + spare, generator=g)[:bsz]
        sink_k = torch.randn(bsz + spare, hkv, rows, d, generator=g).to(pb.sink_k)
        sink_v = torch.randn(bsz + spare, hkv, rows, d, generator=g).to(pb.sink_v)
        sink_k[sslots], sink_v[sslots] = pb.sink_k[:, :, :rows], pb.sink_v[:, :, :rows]
        sink_slot = sslots.to(torch.int32).to(DEVICE)
    return Pools(tail_k, tail_v, tail_slot.to(DEVICE), sink_k, sink_v, sink_slot)


def with_tails(pb: PagedBatch, tails: list[int]) -> PagedBatch:
    """``pb`` with ``tail_lens`` replaced by ``tails`` (0..group_size): the context takes those rows."""
    old = pb.tail_lens.tolist()
    ctx_k = [torch.cat([k[:, : k.shape[1] - o], pb.tail_k[b, :, :n].cpu()], 1) for b, (k, o, n) in
             enumerate(zip(pb.context_k, old, tails, strict=True))]  # fmt: skip
    ctx_v = [torch.cat([v[:, : v.shape[1] - o], pb.tail_v[b, :, :n].cpu()], 1) for b, (v, o, n) in
             enumerate(zip(pb.context_v, old, tails, strict=True))]  # fmt: skip
    tail_lens = torch.tensor(tails, dtype=torch.int32, device=pb.tail_lens.device)
    return dataclasses.replace(pb, tail_lens=tail_lens, context_k=ctx_k, context_v=ctx_v)


def assert_store_refusals(
    store_tiles: Callable[..., None], k: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor, scheme: Scheme
) -> None:
    """The refusals every backend's ``store_tiles`` shares: a cache of the wrong record size, a
    scheme with per-layer overrides, and (``check_finite``) a NaN; ``k`` ``[N, H, T, D]`` valid."""
    with pytest.raises(KernelArgumentError, match="cache must have shape"):
        store_tiles(k, k, cache[:, :, :-1], ids, scheme)
    with pytest.raises(KernelArgumentError, match="per-layer overrides"):
        store_tiles(k, k, cache, ids, Scheme.from_name("kvarn_k4v2_g32_L0fp16"))
    bad = k.clone()
    bad[0, 0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        store_tiles(bad, k, cache, ids, scheme, check_finite=True)
