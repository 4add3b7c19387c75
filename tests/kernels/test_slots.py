"""Decode and prefill reading staging and sink POOLS by slot id, full tails, odd groups, head_dim 256.

Every case is checked against float64 attention over the reference-dequantized context (SQNR >=
40 dB, as in test_decode / test_prefill), and the pool form against the per-sequence form.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvarn.kernels import KernelArgumentError, PagedContext
from kvarn.kernels.triton import decode_attention, prefill_attention
from kvarn.schemes import Scheme

from ._reference import (
    DEVICE,
    PagedBatch,
    Pools,
    causal_reference,
    decode_reference,
    named,
    paged_batch,
    sqnr_db,
    to_pools,
    with_tails,
)

MIN_SQNR_DB = 40.0


def _decode(s: Scheme, pb: PagedBatch, q: torch.Tensor, pools: Pools | None, splits: int = 1) -> torch.Tensor:
    return decode_attention(q, pb.context(s, pools), num_splits=splits)


@pytest.mark.parametrize(
    ("name", "splits"), [("kvarn_k4v2_g32", 1), ("kvarn_k3v2_g32_rot-rh_s8_sink2", 2), ("kvarn_k4v4_g32_sink", 1)]
)
def test_decode_reads_pools_by_permuted_slot(name: str, splits: int) -> None:
    s = named(name)
    pb = paged_batch(s, [2 * 32 + 9, 32, 5, 3 * 32 + 31], hkv=2, d=64, seed=4)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    pools = to_pools(pb, s, spare=3)
    assert pools.tail_slot.tolist()[1] == 0  # an empty tail reads slot 0, another sequence's
    out = _decode(s, pb, q, pools, splits)
    assert sqnr_db(decode_reference(pb, q), out.cpu()) >= MIN_SQNR_DB
    assert torch.equal(out, _decode(s, pb, q, None, splits))
    pools.tail_slot = pools.tail_slot.roll(1)  # the check can fail: other sequences' tails (measured 25 dB)
    assert sqnr_db(decode_reference(pb, q), _decode(s, pb, q, pools, splits).cpu()) < MIN_SQNR_DB - 10


def test_decode_tail_lengths_one_to_group_size() -> None:
    """tail_lens 1..group_size inclusive (a full tail: the new token filled it, not yet packed)."""
    s = named("kvarn_k4v2_g32")
    t = s.group_size
    lens = [(b % 2) * t + t - 1 for b in range(t)]  # every other sequence has one packed tile
    pb = with_tails(paged_batch(s, lens, hkv=1, d=64, seed=5), list(range(1, t + 1)))
    q = torch.randn(t, 2, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = _decode(s, pb, q, to_pools(pb, s, spare=1))
    assert sqnr_db(decode_reference(pb, q), out.cpu()) >= MIN_SQNR_DB


@pytest.mark.parametrize(
    ("name", "d", "group"),
    [
        ("kvarn_k4v2_g32", 256, 7),
        ("kvarn_k4v2_g32", 256, 1),  # one query head per KV head at 256: its own (half) sub-block config
        ("kvarn_k2v3_g32_s8_sink1", 128, 7),
    ],
)
def test_decode_groups_1_7_and_head_dim_256(name: str, d: int, group: int) -> None:
    s = named(name)
    pb = paged_batch(s, [32 + 7, 4], hkv=1, d=d, seed=6)
    q = torch.randn(2, group, d, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = _decode(s, pb, q, to_pools(pb, s, spare=2), splits=2)
    assert sqnr_db(decode_reference(pb, q), out.cpu()) >= MIN_SQNR_DB


def _prefill(s: Scheme, pb: PagedBatch, new: list[int], group: int, pools: Pools) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``new`` tokens per sequence from pools; returns (output, float64 causal reference)."""
    hkv, d = pb.tail_k.shape[1], pb.tail_k.shape[3]
    g = torch.Generator().manual_seed(8)
    total = sum(new)
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (hkv * group, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    out = prefill_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), pb.context(s, pools), max_query_len=max(new)
    )
    return out, causal_reference(pb, q, k, v, cu)


@pytest.mark.parametrize(
    ("name", "d", "group", "cached", "new"),
    [
        ("kvarn_k4v2_g32_sink2", 64, 2, [2 * 32 + 5, 32, 3], [9, 17, 1]),  # pools, sink copies, one-token chunk
        ("kvarn_k4v2_g32", 256, 7, [32 + 31], [5]),  # head_dim 256, a group of 7
        ("kvarn_k3v4_g32_rot-none_sink", 64, 7, [32 + 12, 9], [3, 6]),  # sink tile pool, no rotation
    ],
)
def test_prefill_reads_pools_by_permuted_slot(name: str, d: int, group: int, cached: list[int], new: list[int]) -> None:
    s = named(name)
    pb = paged_batch(s, cached, hkv=1, d=d, seed=9)
    out, ref = _prefill(s, pb, new, group, to_pools(pb, s, spare=2))
    assert sqnr_db(ref, out.cpu()) >= MIN_SQNR_DB


def test_prefill_full_tail() -> None:
    """A tail holding a whole tile's tokens (not yet packed) is attended in full before the new tokens."""
    s = named("kvarn_k4v4_g32")
    pb = with_tails(paged_batch(s, [32 + 31, 31], hkv=1, d=64, seed=10), [32, 32])
    out, ref = _prefill(s, pb, [4, 2], 2, to_pools(pb, s, spare=1))
    assert sqnr_db(ref, out.cpu()) >= MIN_SQNR_DB


def test_pool_arguments_are_checked() -> None:
    s = named("kvarn_k4v2_g32_sink2")
    pb = paged_batch(s, [40, 70], hkv=1, d=64)
    pools = to_pools(pb, s, spare=1)
    q = torch.randn(2, 2, 64, device=DEVICE)
    base = (q, pb.cache, pb.block_table, pb.num_tiles, pools.tail_k, pools.tail_v, pb.tail_lens, s)
    sink = {"sink_k": pools.sink_k, "sink_v": pools.sink_v, "sink_lens": pb.sink_lens}
    with pytest.raises(KernelArgumentError, match="tail_k must have shape \\[2, 1, \\*, 64\\]"):
        decode_attention(
            base[0], PagedContext(*base[1:], **sink, sink_slot=pools.sink_slot)
        )  # a 3-slot pool without tail_slot
    with pytest.raises(KernelArgumentError, match="tail_slot dtype torch.int64"):
        decode_attention(
            base[0], PagedContext(*base[1:], tail_slot=pools.tail_slot.long(), **sink, sink_slot=pools.sink_slot)
        )
    with pytest.raises(KernelArgumentError, match="sink_slot must have shape \\[2\\]"):
        decode_attention(
            base[0], PagedContext(*base[1:], tail_slot=pools.tail_slot, **sink, sink_slot=pools.sink_slot[:1])
        )
    with pytest.raises(KernelArgumentError, match="sink_slot without sink_k"):
        decode_attention(
            base[:-1][0],
            PagedContext(*base[:-1][1:], named("kvarn_k4v2_g32"), tail_slot=pools.tail_slot, sink_slot=pools.sink_slot),
        )


def test_decode_and_prefill_do_not_synchronise_with_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``.item()``/``.tolist()``/``.cpu()``/``bool(tensor)`` in either op (decode: CUDA-graph safe)."""
    s = named("kvarn_k4v2_g32_sink1")
    pb = paged_batch(s, [2 * 32 + 3, 6], hkv=1, d=64, seed=11)
    pools = to_pools(pb, s, spare=1)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    expected = _decode(s, pb, q, pools, splits=2)
    new, group = [3, 1], 2

    def host_sync(*args: object, **kwargs: object) -> None:
        raise AssertionError("host synchronisation")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    out = _decode(s, pb, q, pools, splits=2)
    g = torch.Generator().manual_seed(8)
    nq, nk, nv = (torch.randn(sum(new), h, 64, generator=g).to(DEVICE) for h in (group, 1, 1))
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)
    prefill_attention(nq, nk, nv, cu, pb.context(s, pools), max_query_len=max(new))
    monkeypatch.undo()
    assert torch.equal(out, expected)


def test_sink_arguments_for_a_scheme_without_sink_are_refused() -> None:
    """They would otherwise be attended as a sink tile ahead of the packed tiles."""
    s = named("kvarn_k4v2_g32")
    pb = paged_batch(s, [40], hkv=1, d=64)
    q = torch.randn(1, 2, 64, device=DEVICE)
    with pytest.raises(KernelArgumentError, match="keeps no sink"):
        decode_attention(
            q, dataclasses.replace(pb.context(s), sink_k=pb.tail_k, sink_v=pb.tail_v, sink_lens=pb.tail_lens)
        )


def test_records_in_wider_pages() -> None:
    """A layer's records inside wider pages (``pages[:, :, :tile_bytes]``, as a mixed-bit preset's
    narrower layers are served) give the same decode and prefill outputs as a contiguous cache."""
    s = named("kvarn_k4v2_g32_sink2")
    pb = paged_batch(s, [70, 40], hkv=2, d=64, seed=12)
    nb, h, rec = pb.cache.shape
    pages = torch.full((nb, h, rec + 24), 0xA5, dtype=torch.uint8, device=pb.cache.device)  # garbage after each
    pages[:, :, :rec] = pb.cache
    narrow = pages[:, :, :rec]
    assert narrow.stride(1) == rec + 24
    pools = to_pools(pb, s, spare=1)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    want = _decode(s, pb, q, pools)
    assert torch.equal(_decode(s, dataclasses.replace(pb, cache=narrow), q, pools), want)
    out, _ = _prefill(s, dataclasses.replace(pb, cache=narrow), [3, 5], 2, pools)
    ref, _ = _prefill(s, pb, [3, 5], 2, pools)
    assert torch.equal(out, ref)
    overlapping = pages.as_strided((nb, h, rec), (h * rec, rec // 2, 1))
    with pytest.raises(KernelArgumentError, match="cache records overlap"):
        _decode(s, dataclasses.replace(pb, cache=overlapping), q, pools)
