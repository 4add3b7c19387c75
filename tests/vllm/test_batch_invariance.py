"""Batch invariance at temperature 0 (SmolLM2-135M on vLLM's CPU backend): a prompt's greedy tokens do
not depend on what else runs in its batch more often with kvarn than with vLLM's own 16-bit cache.

Six prompts of 150-400 tokens (each reads packed tiles once it decodes), 48 greedy tokens, in one
8-way batch that holds two of them twice, and each alone. Counted per cache: duplicate pairs whose
two answers differ, and prompts whose batched answer differs from their answer alone. kvarn's decode
splits a sequence's tiles the same way in any batch and verifies short segments with the decode
kernel (docs/cpu_serving.md), so its counts must not exceed the default cache's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GEN = 48
LENGTHS = (150, 210, 260, 300, 350, 400)
BATCH = (0, 1, 2, 3, 4, 5, 0, 3)  # prompts 0 and 3 twice


def _prompts() -> list[list[int]]:
    from tests.vllm.test_scheduling import _text_ids

    ids = _text_ids()
    return [ids[500 + 600 * i : 500 + 600 * i + n] for i, n in enumerate(LENGTHS)]


def _differences(kv_cache_dtype: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    prompts = _prompts()
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)

    def run(llm: Any, batch: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    with cpu_engine(
        str(resolve_model("smollm2-135m")),
        kv_cache_dtype,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        kv_cache_memory_bytes=2**30,
    ) as llm:
        llm.reset_prefix_cache()
        batched = run(llm, [prompts[i] for i in BATCH])
        alone = []
        for p in prompts:
            llm.reset_prefix_cache()
            alone.append(run(llm, [p])[0])
    first = {i: batched[BATCH.index(i)] for i in range(len(prompts))}
    twice = [j for j, i in enumerate(BATCH) if BATCH.index(i) != j]
    return {
        "duplicates": sum(batched[j] != first[BATCH[j]] for j in twice),
        "alone": sum(first[i] != alone[i] for i in range(len(prompts))),
    }


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, Any]]:
    from kvarn.schemes import Scheme

    return {"default": _differences("auto"), "kvarn": _differences(Scheme(4, 2, 128, sink_tokens=1).name)}


def test_duplicates_in_one_batch_differ_no_more_often_than_the_default_cache(counts: dict[str, Any]) -> None:
    assert counts["kvarn"]["duplicates"] <= counts["default"]["duplicates"], counts


def test_alone_vs_batched_differs_no_more_often_than_the_default_cache(counts: dict[str, Any]) -> None:
    assert counts["kvarn"]["alone"] <= counts["default"]["alone"], counts
