"""Prefill and chunked prefill vs float64 causal attention over the reference-dequantized context.

Tolerance: SQNR >= 40 dB (the workspace is in the query dtype; float32 here).
"""

from __future__ import annotations

import pytest
import torch

from kvarn.kernels import KernelConfig, prefill_attention
from kvarn.schemes import Scheme

from ._reference import DEVICE, attention, paged_batch, sqnr_db

MIN_SQNR_DB = 40.0
SMALL = KernelConfig(num_warps=4, num_stages=1, block_m=16, block_n=32)  # few interpreter steps


@pytest.mark.parametrize(
    ("name", "d", "hkv", "group", "cached", "new"),
    [
        ("kvarn_k4v2_g32", 64, 2, 3, [0, 0], [37, 5]),  # first chunk: nothing cached
        ("kvarn_k4v2_g32", 128, 1, 8, [3 * 32 + 11, 64], [20, 16]),  # after tiles + a mid-tile tail; tile-aligned
        ("kvarn_k3v2_g32_s8_sink", 64, 1, 1, [2 * 32 + 9, 7], [9, 33]),  # sink tile kept unquantized
        ("kvarn_k4v4_g64_rot-none", 64, 1, 2, [64 + 1], [1]),  # a one-token chunk is a decode step
    ],
)
def test_prefill_matches_causal_reference(
    name: str, d: int, hkv: int, group: int, cached: list[int], new: list[int]
) -> None:
    scheme = Scheme.from_name(name)
    pb = paged_batch(scheme, cached, hkv, d, seed=d + group)
    g = torch.Generator().manual_seed(1)
    total = sum(new)
    q = torch.randn(total, hkv * group, d, generator=g)
    k = torch.randn(total, hkv, d, generator=g)
    v = torch.randn(total, hkv, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    out = prefill_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), pb.cache, pb.block_table, pb.num_tiles,
        pb.tail_k, pb.tail_v, pb.tail_lens, scheme, sink_k=pb.sink_k, sink_v=pb.sink_v, sink_lens=pb.sink_lens,
        config=SMALL,
    )  # fmt: skip
    refs = []
    for b in range(len(new)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        ctx_k = torch.cat([pb.context_k[b], k[rows].transpose(0, 1)], dim=1)
        ctx_v = torch.cat([pb.context_v[b], v[rows].transpose(0, 1)], dim=1)
        refs.append(attention(q[rows], ctx_k, ctx_v, causal_offset=cached[b]))
    assert out.shape == q.shape
    assert sqnr_db(torch.cat(refs), out.cpu()) >= MIN_SQNR_DB


def test_prefill_is_causal() -> None:
    """Changing a later new token must not change earlier outputs."""
    scheme = Scheme.from_name("kvarn_k4v2_g32")
    pb = paged_batch(scheme, [40], 1, 64)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2 if i == 0 else 1, 64, generator=g).to(DEVICE) for i in range(3))
    cu = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    args = (cu, pb.cache, pb.block_table, pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens, scheme)
    a = prefill_attention(q, k, v, *args, config=SMALL)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 5
    v2[-1] -= 5
    b = prefill_attention(q, k2, v2, *args, config=SMALL)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.allclose(a[-1], b[-1])
