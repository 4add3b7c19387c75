"""Serving under vLLM's scheduler on CPU (SmolLM2-135M, kvarn with the exact first token):
prefix-cache and chunking invariance, mixed prefill/decode batches, a request aborted mid-tile,
preemption, ngram speculative decoding.

Tile-causal attention makes a request's tokens independent of how its prompt was computed. Where
the two runs take the same kernels the greedy tokens must be *identical*: a cached prefix vs none,
chunk boundaries moved, a batch vs the same batch after an abort reused its slots. Where a token is
computed by the decode kernel in one run and by the prefill kernel in the other (a batch vs alone,
preempted and recomputed vs not, speculative verification vs decode) the two kernels round float32
differently, so the tokens must be identical or first differ at a near-tie
(:func:`kvarn.testing.greedy.agree`).
Three engines, each started once (module fixtures), short prompts and few tokens; the first two run
the model in :data:`~tests.vllm.engines.ENGINE_DTYPE`, the third in its own bfloat16 (its claim is
about the capacity at vLLM's defaults).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvarn.testing.greedy import TOP, agree, greedy
from tests.vllm.engines import ENGINE_DTYPE

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256  # max_num_batched_tokens
GEN = 24  # greedy tokens per request


def _scheme_name() -> str:
    from kvarn.schemes import Scheme

    return Scheme(4, 2, 128, sink_tokens=1).name  # explicit: built-in names may change their defaults


def _text_ids() -> list[int]:
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    text = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = tok(text)["input_ids"]
    return ids


@contextmanager
def _engine(**kw: Any) -> Iterator[Any]:
    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    kw.setdefault("kv_cache_memory_bytes", 2**30)
    with cpu_engine(
        str(resolve_model("smollm2-135m")),
        _scheme_name(),
        max_num_seqs=4,
        max_num_batched_tokens=CHUNK,
        enable_chunked_prefill=True,
        dtype=ENGINE_DTYPE,
        **kw,
    ) as llm:
        yield llm


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int = GEN) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP)
    return list(llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False))


def _prompts() -> dict[str, list[int]]:
    ids = _text_ids()
    return {"P": ids[:600], "Q": ids[1000:1500], "S1": ids[2000:2050], "S2": ids[2500:2630], "S3": ids[3000:3260]}


def _crowd() -> list[list[int]]:
    """8 prompts of 300-384 tokens: 4 blocks each once 100 tokens are generated."""
    ids = _text_ids()
    return [ids[4000 + i * 450 : 4000 + i * 450 + 300 + 12 * i] for i in range(8)]


CROWD_GEN, ALONE = 100, 3  # tokens per crowd request; crowd requests also run alone


@pytest.fixture(scope="module")
def main_run() -> dict[str, Any]:
    """Engine 1: prefix cache, moved chunk boundaries, a mixed batch, an abort mid-tile."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    pr = _prompts()
    r: dict[str, Any] = {}
    with _engine() as llm:
        llm.reset_prefix_cache()
        a, b = _generate(llm, [pr["P"]]), _generate(llm, [pr["P"]])  # the second reads 4 tiles from the cache
        r["prefix"] = (greedy(a)[0], greedy(b)[0], int(b[0].num_cached_tokens or 0))
        llm.reset_prefix_cache()
        fresh = greedy(_generate(llm, [pr["Q"]]))[0]  # chunks 0-255, 256-499
        llm.reset_prefix_cache()
        _generate(llm, [pr["Q"][:200]], max_tokens=1)  # caches tile 0 of Q
        moved = _generate(llm, [pr["Q"]])  # chunks 128-383, 384-499
        r["chunks"] = (fresh, greedy(moved)[0], int(moved[0].num_cached_tokens or 0))
        batch = [pr["Q"], pr["S1"], pr["S2"], pr["S3"]]
        solo = []
        for p in batch:
            llm.reset_prefix_cache()
            solo.append(greedy(_generate(llm, [p]))[0])
        llm.reset_prefix_cache()
        r["batch"] = greedy(_generate(llm, batch))  # prefill chunks of some while others decode
        r["solo"] = solo
        # abort a request mid-tile (a tile staged, decode running), then serve the batch again
        llm.reset_prefix_cache()
        engine = llm.llm_engine
        engine.add_request("abort-me", TokensPrompt(prompt_token_ids=pr["P"][:200]), SamplingParams(max_tokens=64))
        produced = 0
        while produced < 3:
            for out in engine.step():
                produced = len(out.outputs[0].token_ids)
        engine.abort_request(["abort-me"])
        while engine.has_unfinished_requests():
            engine.step()
        llm.reset_prefix_cache()
        r["after_abort"] = greedy(_generate(llm, batch))
        r["aborted_at"] = produced
        r["crowd_alone"] = []
        for p in _crowd()[:ALONE]:
            llm.reset_prefix_cache()
            r["crowd_alone"].append(greedy(_generate(llm, [p], max_tokens=CROWD_GEN))[0])
    return r


def test_prefix_cache_hit_gives_the_same_greedy_tokens(main_run: dict[str, Any]) -> None:
    first, second, cached = main_run["prefix"]
    assert cached == 512  # 4 full tiles read from the cache, 88 tokens computed
    assert second.tokens == first.tokens


def test_moved_chunk_boundaries_give_the_same_greedy_tokens(main_run: dict[str, Any]) -> None:
    fresh, moved, cached = main_run["chunks"]
    assert cached == 128
    assert moved.tokens == fresh.tokens


def test_mixed_prefill_decode_batch_and_abort_mid_tile(main_run: dict[str, Any]) -> None:
    """A batch (a 500-token prompt prefilled in chunks while short ones decode) gives each request's
    solo tokens; after a request is aborted with a staged tile, the same batch gives them again."""
    assert main_run["aborted_at"] >= 3
    for got, solo in zip(main_run["batch"], main_run["solo"], strict=True):
        assert agree(got, solo) is None, agree(got, solo)
    assert [g.tokens for g in main_run["after_abort"]] == [g.tokens for g in main_run["batch"]]


def _fluent(tokens: list[int]) -> bool:
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    words = re.findall(r"[A-Za-z]+", tok.decode(tokens))
    text = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text().lower()
    vocab = set(re.findall(r"[a-z]+", text))
    # the crowd prompts include numbered license sections: digits are frequent, words still English
    return len(words) >= 8 and sum(w.lower() in vocab for w in words) / len(words) >= 0.6


@pytest.fixture(scope="module")
def crowd_run() -> dict[str, Any]:
    """Engine 2: ngram speculative decoding (3 draft tokens) and KV space for two requests of 3 tiles
    and their tail blocks, plus one block; the 8 crowd requests at once (two admitted with 3 tiles
    each grow to 4 tiles: vLLM preempts and recomputes), then some alone."""
    import torch

    from kvarn.schemes import Scheme
    from kvarn.vllm.pools import pool_bytes
    from kvarn.vllm.tail import tail_layout

    dtype = getattr(torch, ENGINE_DTYPE)
    scheme = Scheme.from_name(_scheme_name())
    page = scheme.tile_bytes(64) * 3 * 30  # SmolLM2: 3 KV heads, 30 layers
    pools = 30 * pool_bytes(scheme, 3, 64, dtype, 4)  # the sink pool only
    blocks = 2 * (3 + tail_layout(scheme, 64, 30, dtype, max_rollback=3).blocks) + 1
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    r: dict[str, Any] = {"expected_blocks": blocks}
    with _engine(kv_cache_memory_bytes=pools + blocks * page, speculative_config=spec, disable_log_stats=False) as llm:
        r["blocks"] = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
        r["together"] = greedy(_generate(llm, _crowd(), max_tokens=CROWD_GEN))
        metrics = {m.name: m for m in llm.get_metrics()}
        r["preemptions"] = int(getattr(metrics.get("vllm:num_preemptions"), "value", 0) or 0)
        r["alone"] = []
        for p in _crowd()[:ALONE]:
            llm.reset_prefix_cache()
            r["alone"].append(greedy(_generate(llm, [p], max_tokens=CROWD_GEN))[0])
        metrics = {m.name: m for m in llm.get_metrics()}
        r["accepted"] = int(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens"), "value", 0) or 0)
    return r


def test_preemption_keeps_requests_fluent_and_exact(crowd_run: dict[str, Any]) -> None:
    """Preempted requests recompute their tiles: the same greedy tokens as alone, and fluent."""
    assert crowd_run["blocks"] == crowd_run["expected_blocks"]  # the sink pool was counted against the KV memory
    assert crowd_run["preemptions"] > 0
    for got in crowd_run["together"]:
        assert len(got.tokens) == CROWD_GEN and _fluent(got.tokens)
    for got, alone in zip(crowd_run["together"], crowd_run["alone"], strict=False):
        assert agree(got, alone) is None, agree(got, alone)


def test_ngram_speculative_decoding_gives_the_greedy_tokens(
    crowd_run: dict[str, Any], main_run: dict[str, Any]
) -> None:
    """Draft tokens are verified tile-causally like decode tokens (a tile they complete is committed,
    and re-committed if they are rejected): the tokens of the engine without speculation."""
    assert crowd_run["accepted"] > 0, "no draft token was accepted: the test did not exercise speculation"
    for spec, plain in zip(crowd_run["alone"], main_run["crowd_alone"], strict=True):
        assert agree(spec, plain) is None, agree(spec, plain)


ALONE_SAMPLE = (*range(0, 248, 31), *range(248, 256))  # requests of engine 3 also run alone


@pytest.fixture(scope="module")
def default_settings_run() -> dict[str, Any]:
    """Engine 3: vLLM's default scheduler settings (max_num_seqs 256 on CPU), the model's bfloat16
    and 1 GiB of KV memory; 256 distinct requests at once (8 of them over a tile), then
    :data:`ALONE_SAMPLE` of them alone on an empty prefix cache: the 8 over a tile and every 31st other;
    the KV capacity vLLM reports (packed tokens, and its own figure that counts the tail)."""
    from kvarn.models import resolve_model
    from kvarn.vllm.context import layout_for
    from kvarn.vllm.engine import cpu_engine, kv_tokens, logged_kv_tokens
    from kvarn.vllm.tail_cost import request_blocks

    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    ids = _text_ids()
    prompts = [ids[i * 29 % 4000 :][: 6 + i % 7] for i in range(248)]
    prompts += [ids[4500 + i * 350 :][: 130 + 9 * i] for i in range(8)]
    r: dict[str, Any] = {"prompts": prompts, "sample": ALONE_SAMPLE}
    with cpu_engine(str(resolve_model("smollm2-135m")), _scheme_name(), kv_cache_memory_bytes=2**30) as llm:
        r["max_num_seqs"] = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        r["kv_tokens"] = kv_tokens(llm)
        config = llm.llm_engine.vllm_config
        r["logged"], r["blocks"] = logged_kv_tokens(llm), int(config.cache_config.num_gpu_blocks)
        r["max_model_len"] = int(config.model_config.max_model_len)
        r["per_request"] = request_blocks(r["max_model_len"], 128, layout_for(config))
        r["together"] = greedy(_generate(llm, prompts, max_tokens=8))
        r["alone"] = []
        for i in ALONE_SAMPLE:
            llm.reset_prefix_cache()
            r["alone"].append(greedy(_generate(llm, [prompts[i]], max_tokens=8))[0])
    return r


def test_vllm_defaults_serve_256_requests_at_once(default_settings_run: dict[str, Any]) -> None:
    """At vLLM's default max_num_seqs every request runs (each holds its own tail blocks; no pool caps
    the concurrency), with the greedy tokens it gets alone up to a near-tie (each request of
    :data:`ALONE_SAMPLE`, every kind of prompt); the packed KV tokens are at least 4.3x the 16-bit
    cache's 46,592, and vLLM's logged figure counts each max_model_len request's tail."""
    r = default_settings_run
    assert r["max_num_seqs"] == 256 and len(r["prompts"]) == 256
    assert len({tuple(p) for p in r["prompts"]}) == 256
    assert r["kv_tokens"] >= 4.3 * 46592, r["kv_tokens"]
    # vLLM's own "KV cache size" counts a max_model_len request's tail: its logged concurrency is the
    # blocks over what such a request holds with its tail (64 tiles and 5 tail blocks at 8,192 tokens)
    assert r["per_request"] == r["max_model_len"] // 128 + 5
    assert r["logged"] == int(r["blocks"] / r["per_request"] * r["max_model_len"]), r
    assert all(len(got.tokens) == 8 for got in r["together"])
    for i, alone in zip(r["sample"], r["alone"], strict=True):
        assert agree(r["together"][i], alone) is None, (i, agree(r["together"][i], alone))
