"""Prefill and chunked prefill vs float64 causal attention over the reference-dequantized context.

Tolerance: SQNR >= 40 dB (the workspace is in the query dtype; float32 here).
"""

from __future__ import annotations

import pytest
import torch

from kvarn.codec import dequantize_tiles
from kvarn.kernels import KernelArgumentError
from kvarn.kernels.triton import KernelConfig, prefill_attention
from kvarn.schemes import Scheme

from ._reference import DEVICE, PagedBatch, attention, causal_reference, named, paged_batch, sqnr_db

MIN_SQNR_DB = 40.0
SMALL = KernelConfig(num_warps=4, num_stages=1, block_m=64, block_n=32)  # few interpreter programs


def _new_tokens(lens: list[int], hkv: int, group: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random query ``[sum(lens), hkv * group, d]``, key and value ``[sum(lens), hkv, d]`` float32 (CPU)."""
    g = torch.Generator().manual_seed(1)
    total = sum(lens)
    return (
        torch.randn(total, hkv * group, d, generator=g),
        torch.randn(total, hkv, d, generator=g),
        torch.randn(total, hkv, d, generator=g),
    )


def _run(
    scheme: Scheme, pb: PagedBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor
) -> torch.Tensor:
    return prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), pb.context(scheme), config=SMALL)


@pytest.mark.parametrize(
    ("name", "d", "hkv", "group", "cached", "new"),
    [
        ("kvarn_k4v2_g32", 64, 2, 3, [0, 0], [37, 5]),  # first chunk: nothing cached
        ("kvarn_k4v2_g32", 128, 1, 8, [3 * 32 + 11, 64], [20, 16]),  # after tiles + a mid-tile tail; tile-aligned
        ("kvarn_k3v2_g32_s8_sink", 64, 1, 1, [2 * 32 + 9, 7], [9, 33]),  # sink tile kept unquantized
        ("kvarn_k4v4_g64_rot-none", 64, 1, 2, [64 + 1], [1]),  # a one-token chunk is a decode step
        # sink tokens: exact copies over tile 0; tail-only and empty caches ignore them
        ("kvarn_k4v2_g32_sink2", 64, 2, 2, [3 * 32 + 5, 32, 1, 0], [7, 40, 33, 34]),
        ("kvarn_k3v2_g32_rot-rh_s8_sink8", 64, 1, 3, [32 + 9, 20], [1, 16]),
    ],
)
def test_prefill_matches_causal_reference(
    name: str, d: int, hkv: int, group: int, cached: list[int], new: list[int]
) -> None:
    scheme = named(name)
    pb = paged_batch(scheme, cached, hkv, d, seed=d + group)
    q, k, v = _new_tokens(new, hkv, group, d)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    out = _run(scheme, pb, q, k, v, cu)
    assert [c.shape[1] for c in pb.context_k] == cached  # the reference's causal offsets
    assert out.shape == q.shape
    assert sqnr_db(causal_reference(pb, q, k, v, cu), out.cpu()) >= MIN_SQNR_DB


def test_prefill_sink_tokens_differ_from_reading_tile_0_quantized_and_clamp_sink_lens() -> None:
    scheme = named("kvarn_k4v2_g32_sink2")
    pb = paged_batch(scheme, [2 * 32 + 3, 5], 1, 64)
    q, k, v = _new_tokens([9, 4], hkv=1, group=2, d=64)
    cu = torch.tensor([0, 9, 13], dtype=torch.int32)
    out = _run(scheme, pb, q, k, v, cu)
    assert pb.sink_lens is not None
    pb.sink_lens = torch.full_like(pb.sink_lens, 32)  # clamped to 2; ignored without a packed tile
    assert torch.equal(_run(scheme, pb, q, k, v, cu), out)
    dk, dv = dequantize_tiles(pb.cache[pb.block_table[0, :1].long()].view(1, -1).cpu(), scheme, 64)
    quant_k, quant_v = pb.context_k[0].clone(), pb.context_v[0].clone()
    quant_k[:, :32], quant_v[:, :32] = dk, dv
    new_k, new_v = k[:9].transpose(0, 1), v[:9].transpose(0, 1)
    ref = attention(q[:9], torch.cat([pb.context_k[0], new_k], 1), torch.cat([pb.context_v[0], new_v], 1), 67)
    quantized = attention(q[:9], torch.cat([quant_k, new_k], 1), torch.cat([quant_v, new_v], 1), 67)
    assert sqnr_db(ref, out[:9].cpu()) >= MIN_SQNR_DB
    assert sqnr_db(quantized, out[:9].cpu()) < 20.0


def test_prefill_sink_tokens_require_sink_arguments() -> None:
    scheme = named("kvarn_k4v2_g32_sink1")
    pb = paged_batch(scheme, [40], 1, 64)
    q, k, v = _new_tokens([3], hkv=1, group=1, d=64)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    pb.sink_k = pb.sink_v = pb.sink_lens = None
    with pytest.raises(KernelArgumentError, match="keeps its first 1 tokens exactly: pass sink_k"):
        _run(scheme, pb, q, k, v, cu)


def test_prefill_is_causal() -> None:
    """Changing a later new token must not change earlier outputs."""
    scheme = named("kvarn_k4v2_g32")
    pb = paged_batch(scheme, [40], 1, 64)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2 if i == 0 else 1, 64, generator=g).to(DEVICE) for i in range(3))
    cu = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    ctx = pb.context(scheme)
    a = prefill_attention(q, k, v, cu, ctx, config=SMALL)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 5
    v2[-1] -= 5
    b = prefill_attention(q, k2, v2, cu, ctx, config=SMALL)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.allclose(a[-1], b[-1])
