"""The CUDA serving path as a whole, on CPU: a vLLM engine whose kvarn layers launch the Triton ops
(``KVARN_OPS=triton``; the kernels run under Triton's interpreter) gives the greedy tokens of the
same engine on the CPU ops. So the Triton store, prefill and decode kernels, their launchers and the
paged tails meet in a real engine before a GPU first runs them; the compile gate
(``tests/kernels/test_compile_gate.py``) checks that they build for sm_80 / sm_90."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvarn.testing.greedy import TOP, Greedy, agree, greedy  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _generate(model: Path, ops: str, monkeypatch: pytest.MonkeyPatch) -> Greedy:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine

    monkeypatch.setenv("KVARN_OPS", ops)  # read by the plugin in the engine's processes
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with cpu_engine(str(model), "kvarn_k4v2_g128", max_num_seqs=2, max_num_batched_tokens=256, dtype="float32") as llm:
        prompt = TokensPrompt(prompt_token_ids=list(range(2000, 2400)))  # 400 tokens: 3 full tiles + a tail
        sp = SamplingParams(max_tokens=6, temperature=0, logprobs=TOP)
        return greedy(llm.generate([prompt], sp, use_tqdm=False))[0]


def test_triton_ops_in_an_engine_match_the_cpu_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.testing.synthetic import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", head_dim=64, num_layers=2, num_heads=2, num_kv_heads=1)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu = _generate(model, "cpu", monkeypatch)
    triton = _generate(model, "triton", monkeypatch)
    assert len(triton.tokens) == 6
    assert agree(triton, cpu) is None, agree(triton, cpu)
    first = triton.tokens[0]
    assert abs(triton.top[0][first] - cpu.top[0][first]) < 1e-3  # the prompt's last token: prefill kernels
