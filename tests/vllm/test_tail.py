"""Paged 16-bit tails (kvarn.vllm.tail): the layout, the spec and manager vLLM allocates by, and the
rows a step loads and saves, against the exact rows, through prefill chunks, decode and rollbacks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.schemes import Scheme  # noqa: E402
from kvarn.vllm.tail import TailLayout, load_rows, plan_tails, save_rows, tail_layout  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("name", "head_dim", "rows", "blocks"),
    [
        ("kvarn_k4v2_g128", 64, 28, 5),  # SmolLM2 (docs/tail_design.md)
        ("kvarn_k4v2_g128", 128, 27, 5),  # Llama-3-8B
        ("kvarn_k4v4_g128", 128, 35, 4),
        ("kvarn_k4v2_g64", 128, 14, 5),
    ],
)
def test_layout_of_known_shapes(name: str, head_dim: int, rows: int, blocks: int) -> None:
    s = Scheme.from_name(name)
    layout = tail_layout(s, head_dim, 30, torch.bfloat16)
    assert layout.rows_per_page == s.tile_bytes(head_dim) // (4 * head_dim) == rows
    assert layout.blocks == math.ceil(s.group_size / rows) == blocks
    assert tail_layout(s, head_dim, 30, torch.float32).rows_per_page == rows // 2  # rows of 4-byte numbers


def test_layout_takes_the_smallest_page_of_a_mixed_preset() -> None:
    s = Scheme.from_name("kvarn_k4v2_g128_L0k2v2_L1fp16")
    small = Scheme.from_name("kvarn_k2v2_g128").tile_bytes(64) // 256
    assert tail_layout(s, 64, 4, torch.bfloat16).rows_per_page == small
    assert tail_layout(s, 64, 1, torch.bfloat16).rows_per_page == small  # layer 0 only


def test_layout_refuses_more_speculative_tokens_than_a_page_survives() -> None:
    s = Scheme.from_name("kvarn_k4v2_g128")
    tail_layout(s, 64, 30, torch.bfloat16, max_rollback=27)
    with pytest.raises(ValueError, match=r"holds 28 16-bit rows .* more than the 28 speculative tokens"):
        tail_layout(s, 64, 30, torch.bfloat16, max_rollback=28)


@pytest.mark.parametrize("rows", [28, 27, 35, 25, 7])
def test_addresses_stay_in_the_lookahead_and_survive_the_next_tile(rows: int) -> None:
    """Tile j's rows fill distinct places of blocks j+1..j+L; the next tile's first rows_per_page - 1
    rows never land on them (a rollback into tile j still finds all of its rows)."""
    t = 128
    layout = TailLayout(t, rows, math.ceil(t / rows), 64, torch.bfloat16)
    mine = {layout.address(3, r) for r in range(t)}
    assert len(mine) == t and {k for k, _ in mine} <= set(range(4, 4 + layout.blocks))
    nxt = {layout.address(4, r) for r in range(rows - 1)}
    assert not mine & nxt
    assert mine & {layout.address(4, r) for r in range(t)}  # later rows of the next tile do reuse them


@pytest.mark.parametrize("rows", [28, 27, 35, 25, 7])
def test_forward_rows_fill_the_tiles_own_block_then_the_next_ones(rows: int) -> None:
    """Without rollback tile j's rows fill blocks j, j+1, .. in order: a request holds L blocks beyond
    its complete tiles, one fewer than in the backward order while a tile is partial."""
    t = 128
    layout = TailLayout(t, rows, math.ceil(t / rows), 64, torch.bfloat16, forward=True)
    mine = [layout.address(3, r) for r in range(t)]
    assert len(set(mine)) == t and mine[0] == (3, 0) and mine[rows] == (4, 0)
    assert {k for k, _ in mine} == set(range(3, 3 + layout.blocks))
    for n in range(1, 6 * t):
        used = {layout.address(n // t, r)[0] for r in range(n % t)}
        assert layout.table_blocks(n) >= max(used, default=0) + 1
        assert layout.table_blocks(n) == n // t + layout.blocks
    back = TailLayout(t, rows, math.ceil(t / rows), 64, torch.bfloat16)
    assert [back.table_blocks(n) for n in (0, 1, t, t + 1)] == [0, 1 + back.blocks, 1 + back.blocks, 2 + back.blocks]
    assert [layout.table_blocks(n) for n in (0, 1, t, t + 1)] == [0, back.blocks, 1 + back.blocks, 1 + back.blocks]


def _run_steps(steps: list[tuple[int, int]], layout: TailLayout, seed: int = 0, pad: int = 5) -> int:
    """Run ``(ctx, q_len)`` steps of one request through plan/load/save; after each step check that
    what the next step loads equals the exact rows of those positions (the rows of the step that
    wrote them last: a rolled-back position is written again). Pages are ``pad`` bytes longer than
    their rows (5: rows move as bytes into float32 scratch; 16: as int64 words into scratch of the
    rows' dtype, copied whole). Returns how many loaded rows were compared."""
    t, h, d = layout.group_size, 2, layout.head_dim
    blocks = [9, 3, 7, 1, 12, 5, 8, 2, 11, 4, 10, 6, 13]  # the request's block row: tiles, then ahead
    pages = torch.full((14, h, layout.rows_per_page * layout.row_bytes + pad), 255, dtype=torch.uint8)
    truth: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    compared = 0
    for ctx, q_len in steps:
        seq = ctx + q_len
        plans, moves = plan_tails([0, q_len], [seq], [blocks], layout, torch.device("cpu"))
        p = plans[0]
        assert p.row == blocks[: math.ceil(seq / t)]
        k, v = torch.randn(q_len, h, d, generator=gen), torch.randn(q_len, h, d, generator=gen)
        dtype = layout.dtype if pad % 8 == 0 else torch.float32
        scratch = (torch.zeros(moves.slots, h, t, d, dtype=dtype), torch.zeros(moves.slots, h, t, d, dtype=dtype))
        load_rows(pages, scratch, moves, layout)
        for r in range(ctx % t):  # the staged rows of tile ctx // t, exactly (bf16 rows)
            want = truth[ctx - ctx % t + r]
            torch.testing.assert_close(scratch[0][p.read_slot, :, r].float(), want[0], rtol=0, atol=0)
            torch.testing.assert_close(scratch[1][p.read_slot, :, r].float(), want[1], rtol=0, atol=0)
            compared += 1
        save_rows(pages, k, v, moves, layout)
        for i in range(q_len):
            truth[ctx + i] = (k[i].bfloat16().float(), v[i].bfloat16().float())
    return compared


@pytest.mark.parametrize("pad", [5, 16])
def test_forward_rows_round_trip_through_chunks_and_decode(pad: int) -> None:
    layout = tail_layout(Scheme.from_name("kvarn_k4v2_g128"), 64, 30, torch.bfloat16)
    assert layout.forward
    steps = [(0, 100), (100, 1), (101, 20), (121, 4), (125, 2), (127, 1), (128, 3), (131, 27), (158, 1)]
    steps += [(159, 200), (359, 25), (384, 1), (385, 50), (435, 4), (439, 2)]  # across tiles, decode
    assert _run_steps(steps, layout, pad=pad) == sum(ctx % 128 for ctx, _ in steps)


@pytest.mark.parametrize("pad", [5, 16])
def test_rows_round_trip_through_chunks_decode_and_rollbacks(pad: int) -> None:
    layout = tail_layout(Scheme.from_name("kvarn_k4v2_g128"), 64, 30, torch.bfloat16, max_rollback=4)
    assert not layout.forward
    steps = [(0, 100), (100, 1), (101, 20), (121, 4)]  # a chunk, decode, a chunk, speculative step
    steps += [(122, 4), (125, 4)]  # rolled back to 122, then a step that completes tile 0 and starts tile 1
    steps += [(126, 4), (127, 1)]  # rolled back into tile 0 twice: its rows must still be there
    steps += [(128, 3), (129, 200), (329, 1), (330, 50), (380, 4), (381, 2)]  # across tiles, decode
    # every step loaded and matched the staged rows of its partial tile (1,219 rows in all)
    assert _run_steps(steps, layout, pad=pad) == sum(ctx % 128 for ctx, _ in steps) == 1219


@pytest.mark.parametrize("rollback", [0, 1])
def test_a_step_over_many_tiles_saves_only_what_later_steps_read(rollback: int) -> None:
    layout = tail_layout(Scheme.from_name("kvarn_k4v4_g128"), 64, 30, torch.bfloat16, max_rollback=rollback)
    plans, moves = plan_tails([0, 700], [700], [list(range(1, 12))], layout, torch.device("cpu"))
    assert moves.loads is None and moves.saves is not None
    assert moves.saves[0].tolist() == list(range(640, 700))  # tile 5's 60 rows (>= rows_per_page)
    plans, moves = plan_tails([0, 645], [645], [list(range(1, 12))], layout, torch.device("cpu"))
    # backward: tile 4 too (a rollback may return to it); forward: its rows would overwrite its record
    assert moves.saves is not None and moves.saves[0].tolist() == list(range(512 if rollback else 640, 645))
    plans, moves = plan_tails([0, 1], [640], [list(range(1, 12))], layout, torch.device("cpu"))
    # tile 4's 127 staged rows load from its block on: entries 4..7 (forward) or 5..8 (backward)
    assert moves.loads is not None and moves.loads[2].max() == 8 + bool(rollback)
    with pytest.raises(RuntimeError, match="its 640 tokens need 9 with their tail"):
        plan_tails([0, 1], [640], [list(range(1, 6))], tail_layout(Scheme.from_name("kvarn_k4v4_g128"), 64, 30,
                   torch.bfloat16), torch.device("cpu"))  # fmt: skip
    # a step that fills tile 4: backward keeps its rows for a rollback; forward saves none (its first rows'
    # block now holds its record, and the table holds no block past it)
    assert (moves.saves is not None) == bool(rollback)


def test_spec_and_manager_add_the_lookahead() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvarn.vllm.tail_spec import TailManager, TailSpec, with_tail

    base = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    spec = with_tail(base, TailLayout(128, 28, 5, 64, torch.bfloat16))
    assert isinstance(spec, TailSpec) and spec.tail_blocks == 5 and spec.page_size_bytes == base.page_size_bytes
    assert not spec.tail_forward
    from types import SimpleNamespace

    cfg: Any = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    assert spec.max_num_blocks_per_req(cfg, 1000) == base.max_num_blocks_per_req(cfg, 1000) + 5 == 13
    assert TailSpec.merge([spec, spec]).tail_blocks == 5
    window = SlidingWindowSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=512)
    assert with_tail(window, TailLayout(128, 28, 5, 64, torch.bfloat16)) is window  # only full attention

    class Pool:  # the part of vLLM's BlockPool the manager uses here
        def __init__(self) -> None:
            self.next = 1

        def get_new_blocks(self, n: int) -> list[Any]:
            out = [SimpleNamespace(block_id=self.next + i) for i in range(n)]
            self.next += n
            return out

    def manager_of(spec: Any) -> TailManager:
        manager = object.__new__(TailManager)
        manager.kv_cache_spec, manager.block_size = spec, 128
        manager.req_to_blocks, manager._partial_hit_reqs = {"r": []}, {}
        manager._record_new_block_ids, manager.block_pool = False, Pool()
        manager.num_cached_block = {"r": 0}
        return manager

    manager = manager_of(spec)
    assert manager.get_num_blocks_to_allocate("r", 300, [], 0, 0, 300) == 3 + 5
    assert len(manager.allocate_new_blocks("r", 300, 300)) == 8
    assert len(manager.allocate_new_blocks("r", 390, 390)) == 1  # a fourth tile, so one more block ahead
    assert manager.get_num_blocks_to_allocate("r", 0, [], 0, 0, 0) == 0

    forward = manager_of(with_tail(base, TailLayout(128, 28, 5, 64, torch.bfloat16, forward=True)))
    assert forward.kv_cache_spec.tail_forward
    assert forward.get_num_blocks_to_allocate("r", 300, [], 0, 0, 300) == 2 + 5  # 2 whole tiles, 44 rows
    assert len(forward.allocate_new_blocks("r", 300, 300)) == 7
    assert len(forward.allocate_new_blocks("r", 383, 383)) == 0  # tile 2's rows: the same 7 blocks
    assert len(forward.allocate_new_blocks("r", 384, 384)) == 1  # tile 3 begins: 5 beyond 3 whole tiles


def test_a_block_row_without_tail_blocks_is_an_error_not_garbage() -> None:
    layout = tail_layout(Scheme.from_name("kvarn_k4v2_g128"), 64, 30, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"3 entries; its 200 tokens need 6 with their tail .*TailSpec"):
        plan_tails([0, 1], [200], [[3, 5, 7]], layout, torch.device("cpu"))


def _config(max_model_len: int) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def test_vllms_per_request_memory_counts_the_tail_where_counted() -> None:
    """vLLM's worst case per request (``max_memory_usage_bytes``, behind its logged concurrency and its
    check that max_model_len fits) is what a request of max_model_len holds with its tail where the
    spec is ``counted`` (a model of full-attention layers only), else its tiles; page and block
    unchanged by the tail; :func:`request_blocks` (kvarn's start-up line) says the same."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from kvarn.vllm.tail_cost import request_blocks
    from kvarn.vllm.tail_spec import with_tail

    base = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    forward = TailLayout(128, 28, 5, 64, torch.bfloat16, forward=True)
    backward = TailLayout(128, 28, 5, 64, torch.bfloat16)
    cfg, page = _config(1536), base.page_size_bytes
    assert base.max_memory_usage_bytes(cfg) == with_tail(base, forward).max_memory_usage_bytes(cfg) == 12 * page
    assert with_tail(base, forward, counted=True).max_memory_usage_bytes(cfg) == (12 + 5) * page
    assert with_tail(base, backward, counted=True).max_memory_usage_bytes(cfg) == (12 + 5) * page
    assert request_blocks(1536, 128, forward) == request_blocks(1536, 128, backward) == 12 + 5
    assert with_tail(base, forward, counted=True).max_memory_usage_bytes(_config(1500)) == (11 + 5) * page
    assert with_tail(base, backward, counted=True).max_memory_usage_bytes(_config(1500)) == (12 + 5) * page
    spec = with_tail(base, forward, counted=True)
    assert (spec.page_size_bytes, spec.block_size) == (base.page_size_bytes, base.block_size)
    mla = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    three = TailLayout(128, 43, 3, 576, torch.bfloat16, vectors=1, forward=True)
    assert with_tail(mla, three).max_memory_usage_bytes(cfg) == 12 * mla.page_size_bytes
    assert with_tail(mla, three, counted=True).max_memory_usage_bytes(cfg) == (12 + 3) * mla.page_size_bytes


def test_request_blocks_and_requests_that_fit() -> None:
    """A request holds its tokens' blocks plus L tail blocks from its first token: beyond its complete
    tiles in the forward order, beyond every tile it touches in the backward one. vLLM's pool keeps
    one block back (the null block); the start-up line says both for 1,024 tokens and max_model_len."""
    from kvarn.vllm.tail_cost import describe, request_blocks, requests_that_fit

    sizes = (0, 1, 128, 129, 1000, 1024, 1280, 8192)
    backward = tail_layout(Scheme.from_name("kvarn_k4v2_g128"), 64, 30, torch.bfloat16, max_rollback=1)
    assert [request_blocks(n, 128, backward) for n in sizes] == [0, 6, 6, 7, 13, 13, 15, 69]
    layout = tail_layout(Scheme.from_name("kvarn_k4v2_g128"), 64, 30, torch.bfloat16)
    assert [request_blocks(n, 128, layout) for n in sizes] == [0, 5, 6, 6, 12, 13, 15, 69]
    assert request_blocks(1280, 128) == 10
    assert requests_that_fit(404, 17) == 23 and requests_that_fit(91, 10) == 9 and requests_that_fit(1, 5) == 0
    line = describe(layout, 30 * 3 * 7296, 128, 1536, 404)
    assert "holds 5 blocks beyond its complete tiles" in line
    assert "1,024 tokens: 13 blocks, 31 at once in 404 blocks" in line
    assert "1,536 tokens (max_model_len): 17 blocks, 23 at once in 404 blocks" in line
    assert "holds 5 blocks beyond its tiles" in describe(backward, 30 * 3 * 7296, 128, 1536, 404)
    assert "at once" not in describe(layout, 30 * 3 * 7296, 128, 1536)
