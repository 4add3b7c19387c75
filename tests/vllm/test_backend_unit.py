"""Unit tests of the kvarn vLLM backend pieces that need no engine: planner, torch path, registration."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.codec import dequantize_tiles, quantize_tiles  # noqa: E402
from kvarn.schemes import Scheme  # noqa: E402
from kvarn.vllm import torch_path, triton_path  # noqa: E402
from kvarn.vllm.staging import StagingLostError, StagingPool  # noqa: E402

pytestmark = pytest.mark.vllm
T = 32  # a small tile keeps these tests fast


def test_planner_chunked_prefill_then_decode() -> None:
    pool = StagingPool(num_slots=2, block_size=T)
    # request 0: 40 new tokens in blocks [5, 6]: block 5 fills, 8 tokens stage in block 6
    (p,) = pool.plan([0, 40], [40], [[5, 6]])
    assert (p.ctx_blocks, p.staged_read, p.commit_blocks, p.rem_tokens) == ([], 0, [5], 8)
    slot = p.rem_slot
    assert pool.slot_of_block == {6: slot}
    # next chunk: 30 tokens: reads 8 staged tokens, block 6 fills, 6 tokens stage in block 7
    (p,) = pool.plan([0, 30], [70], [[5, 6, 7]])
    assert (p.ctx_blocks, p.staged_read, p.read_slot, p.commit_blocks, p.rem_tokens) == ([5], 8, slot, [6], 6)
    assert 6 not in pool.slot_of_block and pool.slot_of_block[7] == p.rem_slot != slot
    # decode step: same block keeps filling in the same slot
    (q,) = pool.plan([0, 1], [71], [[5, 6, 7]])
    assert (q.ctx_blocks, q.staged_read, q.read_slot, q.rem_slot, q.rem_tokens) == (
        [5, 6],
        6,
        p.rem_slot,
        p.rem_slot,
        7,
    )


def test_planner_reclaims_abandoned_blocks_and_never_reads_lost_ones() -> None:
    pool = StagingPool(num_slots=1, block_size=T)
    pool.plan([0, 5], [5], [[3]])  # request A stages 5 tokens in block 3, then is abandoned
    pool.plan([0, 5], [5], [[4]])  # request B needs a slot: A's block is reclaimed (not in this step)
    assert pool.slot_of_block == {4: 0} and 3 in pool.lost
    with pytest.raises(StagingLostError, match="reclaimed"):
        pool.plan([0, 1], [6], [[3]])  # A comes back: an error, never stale tokens


def test_planner_grows_for_live_blocks_and_reclaims_dead_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.vllm import staging

    pool = StagingPool(num_slots=1, block_size=T, max_slots=4)
    monkeypatch.setitem(staging.LIVE_BLOCKS, "blocks", {3})
    pool.plan([0, 5], [5], [[3]])  # A stages block 3 and stays live (unscheduled next step)
    pool.plan([0, 5], [5], [[4]])  # B: no free slot, A is live -> the pool grows instead of evicting
    assert pool.num_slots == 2 and pool.growths == [2] and set(pool.slot_of_block) == {3, 4}
    monkeypatch.setitem(staging.LIVE_BLOCKS, "blocks", {3, 5})  # B finished: block 4 is dead
    pool.plan([0, 5], [5], [[5]])
    assert pool.num_slots == 2 and set(pool.slot_of_block) == {3, 5} and not pool.lost
    (p,) = pool.plan([0, 1], [6], [[3]])  # A resumes with its staged tokens intact
    assert p.staged_read == 5


def test_planner_dummy_requests_on_null_block() -> None:
    pool = StagingPool(num_slots=1, block_size=T)
    (p,) = pool.plan([0, 16], [16], [[0]])
    assert p.dummy and not pool.slot_of_block


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention in float32: q [n, Hq, D], k/v [n, H, D] -> [n, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("chunks", [[70], [40, 30, 1, 1], [32, 33, 7]])
def test_torch_path_matches_reference_over_dequantized_tiles(chunks: list[int]) -> None:
    """Attention through pages + staging equals attention over the codec's round trip of full tiles."""
    torch.manual_seed(0)
    scheme = Scheme(4, 4, T)
    h, hq, d, n = 2, 4, 64, sum(chunks)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, h, d), torch.randn(n, h, d)
    blocks = [7, 2, 9]
    cache = torch.zeros(10, h, 1, scheme.tile_bytes(d), dtype=torch.uint8)
    sk, sv = torch.zeros(2, h, T, d), torch.zeros(2, h, T, d)
    pool = StagingPool(2, T)
    out = torch.zeros(n, hq, d)
    done = 0
    for c in chunks:
        (p,) = pool.plan([0, c], [done + c], [blocks[: (done + c + T - 1) // T]])
        sl = slice(done, done + c)
        o = torch.zeros(c, hq, d)
        torch_path.attend(q[sl], k[sl], v[sl], cache, sk, sv, [p], scheme, 0.125, o)
        torch_path.commit(k[sl], v[sl], cache, sk, sv, [p], scheme)
        out[sl] = o
        done += c
    # expected: tokens read back from full tiles written before their chunk are quantized
    kq, vq = k.clone(), v.clone()
    full = n // T
    recs = quantize_tiles(
        k[: full * T].view(full, T, h, d).permute(0, 2, 1, 3).reshape(-1, T, d),
        v[: full * T].view(full, T, h, d).permute(0, 2, 1, 3).reshape(-1, T, d),
        scheme,
    )
    assert torch.equal(cache[torch.tensor(blocks[:full]), :, 0].reshape(-1, recs.shape[1]), recs)
    kd, vd = dequantize_tiles(recs, scheme, d)
    kq[: full * T] = kd.view(full, h, T, d).permute(0, 2, 1, 3).reshape(-1, h, d)
    vq[: full * T] = vd.view(full, h, T, d).permute(0, 2, 1, 3).reshape(-1, h, d)
    done = 0
    for c in chunks:  # a chunk sees quantized tiles only among tiles completed before it started
        n_q = done // T * T
        kk = torch.cat([kq[:n_q], k[n_q : done + c]])
        vv = torch.cat([vq[:n_q], v[n_q : done + c]])
        qq = torch.cat([torch.zeros(done, hq, d), q[done : done + c]])
        ref = _reference(qq, kk, vv, 0.125)[done:]
        torch.testing.assert_close(out[done : done + c], ref, atol=2e-5, rtol=1e-4)
        done += c


def test_registration_unknown_name_lists_presets() -> None:
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.schemes import UnknownSchemeError
    from kvarn.vllm.plugin import register

    register()
    assert CacheConfig(cache_dtype="kvarn_k4v2_g128").cache_dtype == "kvarn_k4v2_g128"
    with pytest.raises(UnknownSchemeError, match="Known: kvarn_k4v2_g128"):
        EngineArgs(model="unused", kv_cache_dtype="kvarn_k9v9_g128")


def test_page_bytes_rejects_unsupported_head_dim_and_fp16_layers() -> None:
    from kvarn.vllm.backend import page_bytes

    s = Scheme.from_name("kvarn_k4v2_g128")
    assert page_bytes(s, 64, 30) == s.tile_bytes(64) == 7296
    with pytest.raises(ValueError, match="head_dim 80 is not supported"):
        page_bytes(s, 80, 30)
    with pytest.raises(ValueError, match="layer 0 is unquantized"):
        page_bytes(Scheme.from_name("kvarn_k4v2_g128_L0fp16"), 64, 30)
    with pytest.raises(ValueError, match="sink_tile"):
        page_bytes(Scheme.from_name("kvarn_k4v2_g128_sink"), 64, 30)
    mixed = Scheme.from_name("kvarn_k4v2_g128_L0-1k4v4")  # wider layers set the page size
    assert page_bytes(mixed, 64, 30) == Scheme(4, 4, 128).tile_bytes(64)


def test_triton_path_matches_torch_path_mixed_batch() -> None:
    """The kernels' path (Triton interpreter on CPU) gives the torch path's outputs on a mixed batch."""
    torch.manual_seed(1)
    scheme = Scheme(4, 2, T)
    h, hq, d = 1, 2, 64
    caches = [torch.zeros(8, h, 1, scheme.tile_bytes(d), dtype=torch.uint8) for _ in range(2)]
    stages = [(torch.zeros(2, h, T, d), torch.zeros(2, h, T, d)) for _ in range(2)]
    pools = [StagingPool(2, T), StagingPool(2, T)]
    tables = [[1, 2], [3, 4]]
    # prefill + prefill; decode + chunk (prefill kernel); decode + decode (decode kernel)
    steps = [([0, 40, 50], [40, 10]), ([0, 1, 21], [41, 30]), ([0, 1, 2], [42, 31])]
    for qsl, lens in steps:
        n = qsl[-1]
        q, k, v = torch.randn(n, hq, d), torch.randn(n, h, d), torch.randn(n, h, d)
        outs = []
        for path, cache, (sk, sv), pool in zip((torch_path, triton_path), caches, stages, pools, strict=True):
            plans = pool.plan(qsl, lens, [row[: (s + T - 1) // T] for row, s in zip(tables, lens, strict=True)])
            o = torch.zeros(n, hq, d)
            path.attend(q, k, v, cache, sk, sv, plans, scheme, 0.125, o)
            path.commit(k, v, cache, sk, sv, plans, scheme)
            outs.append(o)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
