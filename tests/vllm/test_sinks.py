"""Sink slots in the vLLM backend (no engine): the sink-slot planner, and start-up checks.

Attention over the slots (exact first tokens, sink tiles) is checked against the reference codec in
``test_tile_causal.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.schemes import Scheme  # noqa: E402
from kvarn.vllm.sinks import SinkPool  # noqa: E402
from kvarn.vllm.staging import LiveBlocks, RequestPlan  # noqa: E402
from kvarn.vllm.tail import TailLayout, plan_tails  # noqa: E402

pytestmark = pytest.mark.vllm
T = 32  # a small tile keeps these tests fast
LAYOUT = TailLayout(T, rows_per_page=T, blocks=1, head_dim=64, dtype=torch.float32)  # one lookahead block
AHEAD = 1000  # lookahead block ids: past every block id a test names


class Planner:
    """The metadata builder's planning (:class:`kvarn.vllm.planner.Planner`): tails, then sink slots,
    for one step."""

    def __init__(self, slots: int, capacity: int) -> None:
        self.live = LiveBlocks()  # the blocks live requests hold, as the engine publishes them
        self.sinks = SinkPool(slots, capacity, T, self.live)

    def plan(self, qsl: list[int], lens: list[int], rows: list[list[int]]) -> list[RequestPlan]:
        """``rows``: each request's tiles; its lookahead block is added as vLLM's block table has it."""
        table = [row + [AHEAD + i] for i, row in enumerate(rows)]
        plans, _ = plan_tails(qsl, lens, table, LAYOUT, torch.device("cpu"))
        self.sinks.plan(plans)
        return plans


def _sink(p: RequestPlan) -> tuple[int, int, int]:
    return p.sink_slot, p.sink_write, p.sink_read


def test_sink_slot_written_with_the_first_tokens_then_read_once_tile0_is_packed() -> None:
    pl = Planner(2, capacity=4)
    (p,) = pl.plan([0, 40], [40], [[5, 6]])  # prefill: tile 0 (block 5) fills; tile 1 reads the copies
    slot = p.sink_slot
    assert slot >= 0 and _sink(p) == (slot, 4, 4) and pl.sinks.slot_of_block == {5: slot}
    (p,) = pl.plan([0, 1], [41], [[5, 6]])  # decode: tile 0 is a packed context tile
    assert _sink(p) == (slot, 0, 4)
    # a prompt arriving a few tokens per step: tile 0 staged (no read), the copies fill in pieces
    (a, b) = pl.plan([0, 1, 3], [1, 2], [[8], [9]])
    assert (a.sink_write, b.sink_write, a.sink_read) == (1, 2, 0)
    (a,) = pl.plan([0, 2], [3], [[8]])
    assert (a.sink_write, pl.sinks.fill[a.sink_slot]) == (2, 3)
    (a,) = pl.plan([0, 29], [32], [[8]])  # position 3 completes the copies; tile 0 fills, nothing reads it yet
    assert (a.sink_write, a.sink_read, pl.sinks.fill[a.sink_slot]) == (1, 0, 4)
    (a,) = pl.plan([0, 1], [33], [[8, 10]])
    assert (a.sink_write, a.sink_read) == (0, 4)


def test_sink_tile_slot_holds_the_whole_first_tile() -> None:
    pl = Planner(2, capacity=T)
    (p,) = pl.plan([0, 20], [20], [[5]])
    assert _sink(p) == (p.sink_slot, 20, 0)
    (p,) = pl.plan([0, 20], [40], [[5, 6]])  # completes tile 0 (12 more copies) and reads it in tile 1
    assert _sink(p) == (p.sink_slot, 12, T)


def test_sink_slots_reclaimed_from_dead_requests_first() -> None:
    pl = Planner(2, capacity=1)
    pl.live.first = {3, 7}
    (a,) = pl.plan([0, 40], [40], [[3, 4]])
    (b,) = pl.plan([0, 40], [40], [[7, 8]])
    pl.plan([0, 1], [41], [[7, 8]])  # B used more recently than A
    pl.live.first = {3, 11}  # B finished
    (c,) = pl.plan([0, 5], [5], [[11]])  # no free slot: B's (dead) is taken, not A's (live, older)
    assert c.sink_slot == b.sink_slot and set(pl.sinks.slot_of_block) == {3, 11}
    # E gets block 11 as its first block after C ended (no cache hit: it computes token 0): same slot
    pl.live.first = {11}
    (e,) = pl.plan([0, 3], [3], [[11]])
    assert _sink(e) == (c.sink_slot, 1, 0)


def test_sink_slots_at_the_bound_never_block_a_request() -> None:
    pl = Planner(1, capacity=2)
    pl.live.first = {3, 4}
    a, b = pl.plan([0, 5, 10], [5, 5], [[3], [4]])  # two new requests in one step, one sink slot
    assert (a.sink_write, b.sink_slot, b.sink_write) == (2, -1, 0)  # B keeps no copies, but runs
    pl.plan([0, 40], [45], [[4, 6]])
    (b,) = pl.plan([0, 1], [46], [[4, 6]])  # B reads its packed tile 0 quantized
    assert _sink(b) == (-1, 0, 0) and pl.sinks.missing >= 1
    (p,) = pl.plan([0, 1], [1], [[0]])  # warm-up requests on the null block: no slot
    assert p.dummy and _sink(p) == (-1, 0, 0)


def test_prefix_cache_hit_reads_a_surviving_slot_else_tile0_quantized() -> None:
    pl = Planner(1, capacity=2)
    (a,) = pl.plan([0, 40], [40], [[5, 6]])  # A computes tokens 0..39 and ends
    pl.live.first = set()
    # B: same first 32 tokens, block 5 is a prefix-cache hit: B starts at ctx = 32
    (b,) = pl.plan([0, 10], [42], [[5, 9]])
    assert _sink(b) == (a.sink_slot, 0, 2) and pl.sinks.missing == 0
    pl.plan([0, 5], [5], [[20]])  # C (first block 20) needs the only slot: A's is reclaimed
    (d,) = pl.plan([0, 10], [42], [[5, 9]])  # D hits block 5 again: reads tile 0 quantized
    assert _sink(d) == (-1, 0, 0) and pl.sinks.missing == 1


def test_a_reclaimed_slot_takes_its_first_block_out_of_the_prefix_cache() -> None:
    """Where the engine connects it (``LiveBlocks.uncache``), reclaiming a dead sequence's slot drops its
    first block from vLLM's prefix cache, so no request reads that block as a hit without its rows."""
    pl = Planner(1, capacity=2)
    dropped: list[int] = []
    pl.live.uncache = dropped.append
    pl.plan([0, 40], [40], [[5, 6]])  # A computes tokens 0..39 and ends
    pl.live.first = set()
    pl.plan([0, 10], [42], [[5, 9]])  # B hits block 5 while A's slot survives: nothing dropped
    assert dropped == []
    pl.plan([0, 5], [5], [[20]])  # C needs the only slot: A's sequence loses it, block 5 leaves the cache
    assert dropped == [5]


def test_lost_sinks_leave_the_prefix_cache_before_a_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker flags a kernel block in the engine's file; the scheduler's next prefix-cache lookup
    evicts its vLLM block (kernel block // stride: a hybrid model's block holds 4 tiles here) first."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    import kvarn.vllm.tail_spec as tail
    from kvarn.vllm.lost_sinks import LostSinks

    class Pool:
        evicted: list[set[int]] = []

        def evict_blocks(self, blocks: set[int]) -> None:
            self.evicted.append(blocks)

    looked: list[object] = []
    monkeypatch.setattr(FullAttentionManager, "find_longest_cache_hit",
                        classmethod(lambda cls, *a, **k: looked.append(a[3]) or ((), 0)))  # fmt: skip
    pool, path = Pool(), str(tmp_path / "flags")
    monkeypatch.setitem(tail._LOST, pool, (LostSinks.create(path, 64), 4))
    worker = LostSinks(path)  # the worker's view of the same file
    worker.mark(9)
    worker.mark(11)
    worker.mark(64)  # past the pool: ignored
    assert tail.TailManager.find_longest_cache_hit([], 128, [0], pool, None, False, 128) == ((), 0)
    assert pool.evicted == [{2}] and looked == [pool]
    tail.TailManager.find_longest_cache_hit([], 128, [0], pool, None, False, 128)
    assert pool.evicted == [{2}]  # taken once


def test_same_step_hit_on_a_first_block_another_request_fills() -> None:
    """vLLM may schedule a prefix-cache hit on a block a request of the same step computes: writers
    are planned first, so the reader (placed first in the batch) still finds the copies."""
    pl = Planner(2, capacity=1)
    b, a = pl.plan([0, 10, 50], [42, 40], [[5, 9], [5, 6]])
    assert a.sink_write == 1 and _sink(b) == (a.sink_slot, 0, 1)


def test_sink_presets_pass_start_up_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    from kvarn.testing.synthetic import write_config_only
    from kvarn.vllm import plugin
    from kvarn.vllm.pages import page_bytes

    plain = Scheme(4, 2, 128, sink_tokens=0)
    for sink in (Scheme(4, 2, 128, sink_tokens=4), Scheme(4, 2, 128, sink_tile=True)):
        assert page_bytes(sink, 64, 30) == page_bytes(plain, 64, 30)  # the copies live outside the pages
    plugin.register()
    monkeypatch.delenv(plugin.RESOLVED_ENV, raising=False)
    model = str(write_config_only(tmp_path / "m"))
    for name in ("kvarn_k4v2_g128_sink4", "kvarn_k4v2_g128_sink"):
        config = EngineArgs(model=model, kv_cache_dtype=name).create_engine_config()
        assert config.cache_config.cache_dtype == name and config.cache_config.block_size == 128
    # a canonical name no preset file lists reaches the processes vLLM spawns through the environment
    assert "kvarn_k4v2_g128_sink4" in os.environ[plugin.RESOLVED_ENV].split(",")
    monkeypatch.setenv(plugin.RESOLVED_ENV, "kvarn_k3v3_g64_sink8,kvarn_bogus")
    plugin.register()
    assert STR_DTYPE_TO_TORCH_DTYPE["kvarn_k3v3_g64_sink8"] == torch.uint8
