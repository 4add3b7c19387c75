"""Float oracles and fixtures for the kernel tests: attention over the reference-dequantized cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn.codec import dequantize_tiles, quantize_tiles
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
