"""End-to-end through ``vllm.LLM`` on the embedded SmolLM2-135M on CPU (issue 4, points 7a-7e).

One engine runs at a time: each module fixture starts an engine, makes every request the tests
need, shuts it down and returns plain data. All engines share the settings of :func:`_engine`
(1 GiB of KV space, 128-token blocks, chunks of 256 tokens), so the default cache and kvarn see
the same batches. kvarn attends tile-causally: a token in tile ``j`` reads tiles ``0..j-1``
quantized and its own tile exactly, whatever the chunking. Schemes are built from explicit fields
(built-in names may change their sink default).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256  # max_num_batched_tokens: a 600-token prompt prefills in 3 chunks
TILE = 128  # block size = tile: positions 1..127 (prompt logprobs 0..126) read no packed tile
PROMPT_START, PROMPT_LEN, GEN_LEN = 0, 600, 64  # the text's first tokens: the accuracy harness's too


def _name(key_bits: int, value_bits: int, sink_tokens: int = 0) -> str:
    from kvarn.schemes import Scheme

    return Scheme(key_bits, value_bits, TILE, sink_tokens=sink_tokens).name


@pytest.fixture(autouse=True, scope="module")
def _plugin() -> None:
    """vLLM loads the plugin when it builds an engine; tests that only build EngineArgs load it here."""
    from kvarn.vllm.plugin import register

    register()


@dataclass
class RunResult:
    kv_tokens: int  # what vLLM reports: num blocks x block size
    prompt_logprobs: list[float]  # per prompt token (the first has none)
    prompt_top1: list[int]  # the most likely token at each of those positions
    generated: list[int]  # greedy tokens after the prompt
    text: str
    forced_top1: list[int]  # top-1 token at each position of the default's continuation (teacher forcing)
    gen_logprobs: list[float]  # logprob of each greedy token
    repeat_cached: int = 0  # with repeat: prompt tokens of the repeated request read from the prefix cache
    repeat_generated: list[int] | None = None  # with repeat: its greedy tokens ...
    repeat_logprobs: list[float] | None = None  # ... and their logprobs


def _prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    text = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = tok(text)["input_ids"]
    return ids[PROMPT_START : PROMPT_START + PROMPT_LEN]


@contextmanager
def _engine(kv_cache_dtype: str, model: str | None = None) -> Iterator[Any]:
    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with cpu_engine(
        model or str(resolve_model("smollm2-135m")),
        kv_cache_dtype,
        max_num_seqs=4,
        max_num_batched_tokens=CHUNK,
        enable_chunked_prefill=True,
    ) as llm:
        yield llm


def _run(kv_cache_dtype: str, reference: list[int] | None = None, repeat: bool = False) -> RunResult:
    """One engine: the prompt with prompt logprobs and a greedy continuation; teacher forcing on
    ``reference``; with ``repeat``, the prompt again without prompt logprobs (vLLM then reads its
    full blocks from the prefix cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = _prompt_ids()
    with _engine(kv_cache_dtype) as llm:
        cfg = llm.llm_engine.vllm_config.cache_config
        kv_tokens = int(cfg.num_gpu_blocks) * int(cfg.block_size)
        sp = SamplingParams(max_tokens=GEN_LEN, temperature=0, prompt_logprobs=1, logprobs=0)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        top1 = [next(t for t, lp in d.items() if lp.rank == 1) for d in out.prompt_logprobs[1:]]
        forced: list[int] = []
        if reference is not None:  # teacher forcing on the default cache's continuation
            sp1 = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
            o = llm.generate([TokensPrompt(prompt_token_ids=ids + reference)], sp1, use_tqdm=False)[0]
            for d in o.prompt_logprobs[len(ids) : len(ids) + len(reference)]:
                forced.append(next(t for t, lp in d.items() if lp.rank == 1))
        again = None
        if repeat:
            sp = SamplingParams(max_tokens=GEN_LEN, temperature=0, logprobs=0)
            again = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    gen = out.outputs[0]
    result = RunResult(kv_tokens, lps, top1, list(gen.token_ids), gen.text, forced, _logprobs(gen))
    if again is not None:
        result.repeat_cached = int(again.num_cached_tokens or 0)
        result.repeat_generated = list(again.outputs[0].token_ids)
        result.repeat_logprobs = _logprobs(again.outputs[0])
    return result


def _logprobs(completion: Any) -> list[float]:
    return [d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True)]


@pytest.fixture(scope="module")
def k4v4_run() -> RunResult:
    return _run(_name(4, 4))


@pytest.fixture(scope="module")
def k4v2_run(default_run: RunResult) -> RunResult:
    return _run(_name(4, 2), reference=default_run.generated)


def test_a_prompt_logprobs_read_quantized_tiles(default_run: RunResult, k4v4_run: RunResult) -> None:
    """Tokens after the first tile read packed tiles: logprobs move, but stay close to the default's."""
    a, b = default_run.prompt_logprobs, k4v4_run.prompt_logprobs
    assert len(a) == len(b) == PROMPT_LEN - 1
    diff = [abs(x - y) for x, y in zip(a, b, strict=True)]
    first = sum(diff[: TILE - 1]) / (TILE - 1)  # tile 0: no packed tile read, only kernel differences
    later = sum(diff[TILE - 1 :]) / len(diff[TILE - 1 :])
    # measured 2026-11-30: first 0.056 (bf16 CPU_ATTN vs float32 torch path), later 0.099
    assert later > first * 1.3, (first, later)
    assert later < 0.2, later
    nll_a, nll_b = -sum(a) / len(a), -sum(b) / len(b)
    assert abs(nll_b - nll_a) < 0.05, (nll_a, nll_b)  # measured: 3.066 vs 3.076


def _check_fluent_and_agrees(run: RunResult, default_run: RunResult) -> float:
    """Fluency of ``run``'s greedy continuation; returns its teacher-forced top-1 agreement."""
    assert len(run.generated) == GEN_LEN
    data = Path(__file__).parents[2] / "kvarn" / "data"
    text = (data / "gpl-3.txt").read_text() + (data / "apache-2.0.txt").read_text()
    vocab = set(re.findall(r"[a-z]+", text.lower()))
    words = re.findall(r"[A-Za-z]+", run.text)
    assert len(words) >= 20, run.text
    known = sum(w.lower() in vocab for w in words) / len(words)
    # fluent: English words of the bundled license texts' vocabulary (measured 2026-11-30: 0.87 with
    # the GPL's vocabulary alone; the default cache's continuation scores alike), no stuck token
    assert known >= 0.8, (known, run.text)
    longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(run.generated))
    assert longest_run <= 8, run.text
    agree = sum(x == y for x, y in zip(run.forced_top1, default_run.generated, strict=True)) / GEN_LEN
    assert agree >= 0.75, agree  # teacher-forced top-1 agreement with the default cache
    return agree


def test_b_generation_is_fluent_and_agrees(default_run: RunResult, k4v2_run: RunResult) -> None:
    """64 greedy tokens after a 600-token (4.7-tile) prompt under k4v2 (no sink)."""
    _check_fluent_and_agrees(k4v2_run, default_run)


def _net_kv_tokens(key_bits: int, value_bits: int, sink_tokens: int = 0) -> int:
    """KV tokens of 1 GiB for SmolLM2 (30 layers, 3 KV heads, head_dim 64, bf16) once the sink pool
    (4 slots = max_num_seqs per layer; partial tiles wait in tail blocks, no staging pool) is taken
    from it: whole blocks of packed tiles."""
    import torch

    from kvarn.schemes import Scheme
    from kvarn.vllm.pools import pool_bytes

    scheme = Scheme(key_bits, value_bits, TILE, sink_tokens=sink_tokens)
    pools = 30 * pool_bytes(scheme, 3, 64, torch.bfloat16, 4)
    return (2**30 - pools) // (30 * 3 * scheme.tile_bytes(64)) * TILE


def test_c_capacity_vs_default(default_run: RunResult, k4v2_run: RunResult, k4v4_run: RunResult) -> None:
    """KV tokens vLLM reports for the same 1 GiB of KV memory, net of kvarn's sink pool."""
    from kvarn.schemes import Scheme

    ratio = k4v2_run.kv_tokens / default_run.kv_tokens
    assert default_run.kv_tokens == 46592  # bf16 SmolLM2, 1 GiB (ENVIRONMENT.md)
    assert k4v2_run.kv_tokens == _net_kv_tokens(4, 2)  # 0.1 MiB of sink pool out of 1 GiB
    assert k4v4_run.kv_tokens == _net_kv_tokens(4, 4)
    expected = Scheme(4, 2, 128).compression(64)  # 4.49x by the byte formula
    assert ratio == pytest.approx(expected, rel=0.005) and ratio >= 4.45, ratio


def test_d_user_sink_tile_preset_served_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_run: RunResult
) -> None:
    """A preset YAML in KVARN_PRESET_PATH, named without the kvarn_ prefix, with a 16-bit first tile
    (KVarN's sink), is served by name; a repeat reads tiles 0-1 from the prefix cache and tile 0's
    exact copy from the sink pool: same greedy tokens."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.schemes import Preset, Scheme, save_preset
    from kvarn.vllm.plugin import register_dtypes
    from kvarn.vllm.pools import pool_bytes

    scheme = Scheme(3, 3, 128, sink_tile=True)
    save_preset(Preset("acme_k3v3_tuned", scheme), tmp_path / "acme.yaml")
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    register_dtypes(["acme_k3v3_tuned"])  # this process registered at import; spawned ones scan anew
    prompt = [TokensPrompt(prompt_token_ids=_prompt_ids()[:300])]
    sp = SamplingParams(max_tokens=16, temperature=0)
    with _engine("acme_k3v3_tuned") as llm:
        cfg = llm.llm_engine.vllm_config.cache_config
        tokens = int(cfg.num_gpu_blocks) * int(cfg.block_size)
        out = llm.generate(prompt, sp, use_tqdm=False)[0]
        again = llm.generate(prompt, sp, use_tqdm=False)[0]
    pools = 30 * pool_bytes(scheme, 3, 64, torch.bfloat16, 4)  # 16-bit first tiles, 4 slots
    assert tokens == (2**30 - pools) // (30 * 3 * scheme.tile_bytes(64)) * 128
    assert len(out.outputs[0].token_ids) == 16 and re.search(r"[a-z]{3}", out.outputs[0].text)
    assert again.num_cached_tokens == 256 and again.outputs[0].token_ids == out.outputs[0].token_ids


def _engine_args_error(tmp_path: Path, kv_cache_dtype: str, block_size: int | None = 128, **config: Any) -> str:
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.models import resolve_model
    from kvarn.testing.synthetic import write_config_only

    model = str(write_config_only(tmp_path / "m", **config)) if config else str(resolve_model("smollm2-135m"))
    with pytest.raises((ValueError, KeyError)) as err:
        EngineArgs(model=model, kv_cache_dtype=kv_cache_dtype, block_size=block_size).create_engine_config()
    return str(err.value)


def test_e_bad_input_fails_at_start_up(tmp_path: Path) -> None:
    msg = _engine_args_error(tmp_path, "kvarn_k4v2_g100")
    assert "Known: kvarn_k4v2_g128" in msg
    assert "needs block_size=128" in _engine_args_error(tmp_path, "kvarn_k4v2_g128", block_size=64)
    assert "head_dim 96" in _engine_args_error(tmp_path, "kvarn_k4v2_g128", head_dim=96)
    msg = _engine_args_error(
        tmp_path, "kvarn_k4v2_g128", architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64
    )
    assert "sliding-window layers (window 64)" in msg


def test_e_unset_block_size_becomes_tile_size() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.models import resolve_model

    args = EngineArgs(model=str(resolve_model("smollm2-135m")), kv_cache_dtype="kvarn_k4v2_g64")
    assert args.block_size == 64


def test_f_vllm_and_harness_agree(default_run: RunResult, k4v4_run: RunResult) -> None:
    """Top-1 agreement and perplexity change of k4v4 vs the 16-bit cache: vLLM vs kvarn.eval.

    Same tokens (the text's first 600); the harness in chunks of one tile, which is exactly vLLM's
    tile-causal reading (each tile reads the tiles before it quantized, itself exactly). vLLM runs the model in bfloat16 on CPU_ATTN / the kvarn backend; the
    harness in float32 through transformers, so the two agree only within a tolerance.
    """
    import math

    from kvarn.eval import Evaluator

    harness = Evaluator("smollm2-135m", tokens=PROMPT_LEN, chunk=TILE, greedy_tokens=0).evaluate(_name(4, 4))
    n = len(default_run.prompt_top1)
    top1 = sum(a == b for a, b in zip(default_run.prompt_top1, k4v4_run.prompt_top1, strict=True)) / n
    nll_a, nll_b = -sum(default_run.prompt_logprobs) / n, -sum(k4v4_run.prompt_logprobs) / n
    dppl = 100 * (math.exp(nll_b - nll_a) - 1)
    assert harness.tokens == PROMPT_LEN
    assert abs(top1 - harness.top1_agreement) <= 0.06, (top1, harness.top1_agreement)
    assert abs(dppl - harness.delta_ppl_pct) <= 2.0, (dppl, harness.delta_ppl_pct)


@pytest.fixture(scope="module")
def sink1_run(default_run: RunResult) -> RunResult:
    return _run(_name(4, 2, sink_tokens=1), reference=default_run.generated, repeat=True)


def test_g_sink_tokens_served(default_run: RunResult, k4v2_run: RunResult, sink1_run: RunResult) -> None:
    """k4v2 with the exact first token: the pages of k4v2 (no sink), plus the exact first token.

    Agreeing like k4v2 (teacher-forced); its first tile (no packed tile read) is k4v2's exactly; later
    tiles read the packed tile 0 with its exact first token and are closer to the default cache.
    The repeated prompt reads its tiles from the prefix cache: its sink slot survived, so it
    generates what the first request did, with the same logprobs.
    """
    # teacher-forced agreement with the default cache's continuation (measured 2026-11-30: 0.95; k4v2 0.98).
    # Not the free-running fluency check: on this prompt the greedy path is chaotic in the last bits
    # (2026-12-01: native and torch decode agree to 1e-4 relative on every call of the run, yet the
    # native run's continuation loops after token 8 while the torch run's stays on topic)
    agree = sum(x == y for x, y in zip(sink1_run.forced_top1, default_run.generated, strict=True)) / GEN_LEN
    assert agree >= 0.75, agree
    assert sink1_run.kv_tokens == _net_kv_tokens(4, 2, sink_tokens=1)  # pages unchanged; copies in the pools
    a, b, c = default_run.prompt_logprobs, k4v2_run.prompt_logprobs, sink1_run.prompt_logprobs
    assert c[: TILE - 1] == b[: TILE - 1]
    later = slice(TILE - 1, None)
    diff_k4v2 = sum(abs(x - y) for x, y in zip(a[later], b[later], strict=True)) / len(a[later])
    diff_sink = sum(abs(x - y) for x, y in zip(a[later], c[later], strict=True)) / len(a[later])
    assert diff_sink < diff_k4v2, (diff_sink, diff_k4v2)  # measured 2026-11-30: 0.114 vs 0.188
    assert sink1_run.repeat_cached == PROMPT_LEN // 128 * 128, sink1_run.repeat_cached
    assert sink1_run.repeat_generated == sink1_run.generated
    assert sink1_run.repeat_logprobs is not None
    drift = max(abs(x - y) for x, y in zip(sink1_run.repeat_logprobs, sink1_run.gen_logprobs, strict=True))
    # measured 2026-11-30: 0.0; with the slot ignored on the hit (tile 0 read quantized), 2.59 and
    # a different continuation
    assert drift < 1e-3, drift


def test_h_sink_tokens_vllm_and_harness_agree(default_run: RunResult, sink1_run: RunResult) -> None:
    """Top-1 agreement and perplexity change of k4v2 with the exact first token vs the 16-bit cache:
    vLLM vs kvarn.eval (KVarNCache, same in-tile sink semantics, chunks of one tile), within test_f's
    tolerances."""
    import math

    from kvarn.eval import Evaluator

    name = _name(4, 2, sink_tokens=1)
    harness = Evaluator("smollm2-135m", tokens=PROMPT_LEN, chunk=TILE, greedy_tokens=0).evaluate(name)
    n = len(default_run.prompt_top1)
    top1 = sum(a == b for a, b in zip(default_run.prompt_top1, sink1_run.prompt_top1, strict=True)) / n
    nll_a, nll_b = -sum(default_run.prompt_logprobs) / n, -sum(sink1_run.prompt_logprobs) / n
    dppl = 100 * (math.exp(nll_b - nll_a) - 1)
    # measured 2026-11-30: top-1 0.950 (vLLM) vs 0.963 (harness), ppl change +0.02% vs +0.34%
    assert abs(top1 - harness.top1_agreement) <= 0.06, (top1, harness.top1_agreement)
    assert abs(dppl - harness.delta_ppl_pct) <= 2.0, (dppl, harness.delta_ppl_pct)
