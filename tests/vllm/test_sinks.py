"""Sink tokens in the vLLM backend (no engine): the sink-slot planner and the torch path's reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.codec import dequantize_tiles, quantize_tiles  # noqa: E402
from kvarn.schemes import Scheme  # noqa: E402
from kvarn.vllm import staging, torch_path  # noqa: E402
from kvarn.vllm.sinks import SinkPool  # noqa: E402
from kvarn.vllm.staging import RequestPlan, StagingPool  # noqa: E402

pytestmark = pytest.mark.vllm
T = 32  # a small tile keeps these tests fast


class Planner:
    """The metadata builder's planning: staging, then sink slots, for one step."""

    def __init__(self, slots: int, sink_tokens: int, max_slots: int = 0) -> None:
        self.staging = StagingPool(slots, T, max_slots=max_slots)
        self.sinks = SinkPool(slots, sink_tokens, max_slots=max_slots)

    def plan(self, qsl: list[int], lens: list[int], rows: list[list[int]]) -> list[RequestPlan]:
        rows = [row[: (s + T - 1) // T] for row, s in zip(rows, lens, strict=True)]
        plans = self.staging.plan(qsl, lens, rows)
        self.sinks.plan(plans, lens, rows)
        return plans


def _sink(p: RequestPlan) -> tuple[int, int, int]:
    return p.sink_slot, p.sink_write, p.sink_read


def test_sink_slot_written_with_the_first_tokens_then_read_once_tile0_is_packed() -> None:
    pl = Planner(2, sink_tokens=4)
    (p,) = pl.plan([0, 40], [40], [[5, 6]])  # prefill: tile 0 (block 5) fills, its first 4 tokens kept
    slot = p.sink_slot
    assert slot >= 0 and _sink(p) == (slot, 4, 0) and pl.sinks.slot_of_block == {5: slot}
    (p,) = pl.plan([0, 1], [41], [[5, 6]])  # decode: tile 0 is a packed context tile
    assert _sink(p) == (slot, 0, 4)
    # a prompt arriving one token per step: tile 0 staged (no read), the copies fill in pieces
    (a, b) = pl.plan([0, 1, 3], [1, 2], [[8], [9]])
    assert (a.sink_write, b.sink_write, a.sink_read) == (1, 2, 0)
    (a,) = pl.plan([0, 2], [3], [[8]])
    assert (a.sink_write, pl.sinks.fill[a.sink_slot]) == (2, 3)
    (a,) = pl.plan([0, 30], [33], [[8, 10]])  # position 3 completes the copies; tile 0 fills
    assert (a.sink_write, a.sink_read, pl.sinks.fill[a.sink_slot]) == (1, 0, 4)
    (a,) = pl.plan([0, 1], [34], [[8, 10]])
    assert (a.sink_write, a.sink_read) == (0, 4)
    (a,) = pl.plan([0, 1], [35], [[8, 10]])  # ... at every step
    assert (a.sink_write, a.sink_read) == (0, 4)


def test_sink_slots_reused_by_block_id_grown_for_live_and_reclaimed_from_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pl = Planner(1, sink_tokens=1, max_slots=4)
    monkeypatch.setitem(staging.LIVE_BLOCKS, "first", {3})
    (a,) = pl.plan([0, 40], [40], [[3, 4]])  # A: first block 3
    monkeypatch.setitem(staging.LIVE_BLOCKS, "first", {3, 7})
    (b,) = pl.plan([0, 40], [40], [[7, 8]])  # B: A is live (unscheduled now): the pool grows
    assert pl.sinks.num_slots == 2 and pl.sinks.growths == [2] and b.sink_slot != a.sink_slot
    monkeypatch.setitem(staging.LIVE_BLOCKS, "first", {7, 11, 12})  # A finished
    (c, d) = pl.plan([0, 5, 10], [5, 5], [[11], [12]])  # C reclaims A's slot; D needs a growth
    assert c.sink_slot == a.sink_slot and pl.sinks.num_slots == 4
    assert set(pl.sinks.slot_of_block) == {7, 11, 12}
    # E gets block 11 as its first block after C ended (no cache hit: it computes token 0): same slot
    monkeypatch.setitem(staging.LIVE_BLOCKS, "first", {11})
    (e,) = pl.plan([0, 3], [3], [[11]])
    assert _sink(e) == (c.sink_slot, 1, 0)


def test_sink_slots_at_the_bound_never_block_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    pl = Planner(1, sink_tokens=2)
    pl.staging = StagingPool(2, T)  # staging is not under test: enough slots for two requests
    monkeypatch.setitem(staging.LIVE_BLOCKS, "first", {3, 4})
    a, b = pl.plan([0, 5, 10], [5, 5], [[3], [4]])  # two new requests in one step, one sink slot
    assert (a.sink_write, b.sink_slot, b.sink_write) == (2, -1, 0)  # B keeps no copies, but runs
    pl.plan([0, 40], [45], [[4, 6]])
    (b,) = pl.plan([0, 1], [46], [[4, 6]])  # B reads its packed tile 0 quantized
    assert b.ctx_blocks == [4] and _sink(b) == (-1, 0, 0) and pl.sinks.missing == 1
    (p,) = pl.plan([0, 1], [1], [[0]])  # warm-up requests on the null block: no slot
    assert p.dummy and _sink(p) == (-1, 0, 0)


def test_prefix_cache_hit_reads_a_surviving_slot_else_tile0_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    pl = Planner(1, sink_tokens=2)
    (a,) = pl.plan([0, 40], [40], [[5, 6]])  # A computes tokens 0..39 and ends
    monkeypatch.setitem(staging.LIVE_BLOCKS, "first", set())
    # B: same first 32 tokens, block 5 is a prefix-cache hit: B starts at ctx = 32
    (b,) = pl.plan([0, 10], [42], [[5, 9]])
    assert b.ctx_blocks == [5] and _sink(b) == (a.sink_slot, 0, 2) and pl.sinks.missing == 0
    pl.plan([0, 5], [5], [[20]])  # C (first block 20) needs the only slot: A's is reclaimed
    (d,) = pl.plan([0, 10], [42], [[5, 9]])  # D hits block 5 again: reads tile 0 quantized
    assert d.ctx_blocks == [5] and _sink(d) == (-1, 0, 0) and pl.sinks.missing == 1


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_ctx: int, scale: float) -> torch.Tensor:
    """Float32 GQA attention of ``q`` [n, Hq, D] (the last n positions) over k/v [L, H, D], causal."""
    n, g = q.shape[0], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
    mask = torch.ones(n, k.shape[0], dtype=torch.bool).tril(diagonal=n_ctx)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _round_trip(x_k: torch.Tensor, x_v: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference codec over the full tiles of ``[L, H, D]`` keys/values; the tail stays exact."""
    n, h, d = x_k.shape
    full = n // T
    if not full:
        return x_k, x_v
    tiles = [x[: full * T].view(full, T, h, d).permute(0, 2, 1, 3).reshape(-1, T, d) for x in (x_k, x_v)]
    kd, vd = dequantize_tiles(quantize_tiles(tiles[0], tiles[1], scheme), scheme, d)
    back = [y.view(full, h, T, d).permute(0, 2, 1, 3).reshape(-1, h, d) for y in (kd, vd)]
    return torch.cat([back[0], x_k[full * T :]]), torch.cat([back[1], x_v[full * T :]])


@pytest.mark.parametrize(("sink_tokens", "chunks"), [(1, [40, 30, 1, 1]), (4, [1, 2, 37, 3]), (2, [32, 33, 7])])
def test_torch_path_reads_exact_sink_tokens_over_packed_tile0(sink_tokens: int, chunks: list[int]) -> None:
    """Two requests per step; each chunk's attention equals the reference codec's round trip of the
    tiles completed before it, with positions < sink_tokens exact, and differs from tile 0 quantized."""
    torch.manual_seed(0)
    scheme = Scheme(4, 2, T, sink_tokens=sink_tokens)
    h, hq, d, n, scale = 2, 4, 64, sum(chunks), 0.125
    data = [(torch.randn(n, hq, d), torch.randn(n, h, d), torch.randn(n, h, d)) for _ in range(2)]
    rows = [[7, 2, 9], [4, 1, 3]]
    cache = torch.zeros(10, h, 1, scheme.tile_bytes(d), dtype=torch.uint8)
    stage = torch.zeros(4, h, T, d), torch.zeros(4, h, T, d)
    sink = torch.zeros(4, h, sink_tokens, d), torch.zeros(4, h, sink_tokens, d)
    pl = Planner(4, sink_tokens)
    outs = [torch.zeros(n, hq, d) for _ in data]
    done = 0
    for c in chunks:
        sl = slice(done, done + c)
        q, k, v = (torch.cat([x[sl] for x in xs]) for xs in zip(*data, strict=True))
        plans = pl.plan([0, c, 2 * c], [done + c] * 2, rows)
        o = torch.zeros(2 * c, hq, d)
        torch_path.attend(q, k, v, cache, *stage, plans, scheme, scale, o, sink=sink)
        torch_path.commit(k, v, cache, *stage, plans, scheme, sink=sink)
        outs[0][sl], outs[1][sl] = o[:c], o[c:]
        done += c
    for (q, k, v), out in zip(data, outs, strict=True):
        done, far = 0, 0.0
        for c in chunks:  # a chunk reads quantized only the tiles completed before it started
            n_q = done // T * T
            kq, vq = _round_trip(k[:n_q], v[:n_q], scheme)
            exact = min(sink_tokens, n_q)
            ks = torch.cat([k[:exact], kq[exact:], k[n_q : done + c]])
            vs = torch.cat([v[:exact], vq[exact:], v[n_q : done + c]])
            ref = _attention(q[done : done + c], ks, vs, done, scale)
            torch.testing.assert_close(out[done : done + c], ref, atol=2e-5, rtol=1e-4)
            quantized = _attention(
                q[done : done + c], torch.cat([kq, ks[n_q:]]), torch.cat([vq, vs[n_q:]]), done, scale
            )
            far = max(far, (out[done : done + c] - quantized).abs().max().item())
            done += c
        assert far > 1e-3, far  # reading tile 0 quantized would fail the check above


def test_triton_path_matches_torch_path_with_sink_tokens() -> None:
    """The kernels' path (Triton interpreter on CPU) passes the sink slots as the kernels' sink
    arguments: on the same cache state it gives the torch path's outputs, on prefill, mixed and
    decode batches, and its commit writes the same sink copies."""
    from kvarn.vllm import triton_path

    torch.manual_seed(2)
    scheme = Scheme(4, 2, T, sink_tokens=2)
    h, hq, d = 1, 2, 64
    cache = torch.zeros(8, h, 1, scheme.tile_bytes(d), dtype=torch.uint8)
    assert triton_path.usable(cache, scheme, d)
    stage = torch.zeros(4, h, T, d), torch.zeros(4, h, T, d)
    sink = torch.zeros(4, h, 2, d), torch.zeros(4, h, 2, d)
    pl = Planner(4, 2)
    rows = [[1, 2], [3, 4]]
    # prefill + prefill; chunk + chunk (prefill kernel, one reads tile 0); decode + decode (decode kernel)
    steps = [([0, 40, 50], [40, 10]), ([0, 5, 35], [45, 40]), ([0, 1, 2], [46, 41])]
    reads = []
    for qsl, lens in steps:
        n = qsl[-1]
        q, k, v = torch.randn(n, hq, d), torch.randn(n, h, d), torch.randn(n, h, d)
        plans = pl.plan(qsl, lens, rows)
        reads.append([p.sink_read for p in plans])
        outs = [torch.zeros(n, hq, d) for _ in range(2)]
        for path, o in zip((torch_path, triton_path), outs, strict=True):
            path.attend(q, k, v, cache, *stage, plans, scheme, 0.125, o, sink=sink)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
        # (store_tiles and quantize_tiles may round a few codes apart: commit through one path)
        mirror = [x.clone() for x in (*stage, *sink)]
        triton_path.commit(k, v, cache.clone(), mirror[0], mirror[1], plans, scheme, sink=(mirror[2], mirror[3]))
        torch_path.commit(k, v, cache, *stage, plans, scheme, sink=sink)
        assert torch.equal(mirror[2], sink[0]) and torch.equal(mirror[3], sink[1])
    assert reads == [[0, 0], [2, 0], [2, 2]]


def test_sink_token_presets_pass_start_up_checks_sink_tiles_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    from kvarn.vllm import plugin
    from kvarn.vllm.backend import page_bytes
    from kvarn.vllm.synthetic import write_config_only

    sink4 = Scheme.from_name("kvarn_k4v2_g128_sink4")
    assert page_bytes(sink4, 64, 30) == page_bytes(Scheme.from_name("kvarn_k4v2_g128"), 64, 30)
    plugin.register()
    monkeypatch.delenv(plugin.RESOLVED_ENV, raising=False)
    model = str(write_config_only(tmp_path / "m"))
    config = EngineArgs(model=model, kv_cache_dtype="kvarn_k4v2_g128_sink4").create_engine_config()
    assert config.cache_config.cache_dtype == "kvarn_k4v2_g128_sink4" and config.cache_config.block_size == 128
    # a canonical name no preset file lists reaches the processes vLLM spawns through the environment
    assert "kvarn_k4v2_g128_sink4" in os.environ[plugin.RESOLVED_ENV].split(",")
    monkeypatch.setenv(plugin.RESOLVED_ENV, "kvarn_k3v3_g64_sink8,kvarn_bogus")
    plugin.register()
    assert STR_DTYPE_TO_TORCH_DTYPE["kvarn_k3v3_g64_sink8"] == torch.uint8
    with pytest.raises(ValueError, match=r"sink_tile presets .* use kvarn_k4v2_g128_sink1"):
        EngineArgs(model=model, kv_cache_dtype="kvarn_k4v2_g128_sink").create_engine_config()
