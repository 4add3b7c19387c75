"""``kvarn eval --task drift`` on the real SmolLM2-135M: one short prompt, a short free run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvarn.cli import main
from kvarn.eval.drift import DriftTask, prompt_starts
from kvarn.eval.harness import Evaluator
from kvarn.schemes import Scheme

PROMPT, TOKENS = 104, 25  # 128 tokens cached after the run: two whole 64-token tiles


@pytest.fixture(scope="module")
def task() -> DriftTask:
    return DriftTask(Evaluator("smollm2-135m", tokens=10**6, chunk=32), prompts=1, prompt_tokens=PROMPT, tokens=TOKENS)


def test_fp16_against_itself_never_diverges_and_its_kl_is_zero(task: DriftTask) -> None:
    r = task.evaluate("fp16", progress=False)
    assert r.divergence == [TOKENS] and r.bits_per_element == 16.0
    # its free run read one token at a time, compared with the chunked reading of the same text:
    # a position off by one would give KL of order 1
    assert abs(r.mean_kl) < 1e-6


def test_a_quantized_cache_drifts_and_fewer_bits_drift_further(task: DriftTask) -> None:
    k2v2 = task.evaluate("kvarn_k2v2_g64", progress=False)
    int8 = task.evaluate("int8", progress=False)
    assert 0 <= k2v2.divergence[0] <= TOKENS and k2v2.prompt_tokens == PROMPT and k2v2.tokens == TOKENS
    assert k2v2.mean_kl > 1e-3  # tiles were read: the distributions differ from fp16's
    assert 0.0 < int8.mean_kl < k2v2.mean_kl / 10  # 8 bits per number drift far less than 2
    assert int8.bits_per_element > 8.0
    assert k2v2.bits_per_element == pytest.approx(Scheme.from_name("kvarn_k2v2_g64").bits_per_element(64, context=128))


def test_prompts_start_on_lines_spread_over_the_text() -> None:
    ids = list(range(100))
    newline = [i % 10 == 9 for i in ids]  # a line starts every 10 tokens
    assert prompt_starts(ids, newline, 3, 20) == [0, 40, 80]
    assert prompt_starts(ids, newline, 1, 100) == [0]
    with pytest.raises(ValueError, match="the text has 100 tokens, fewer than --prompt-tokens 101"):
        prompt_starts(ids, newline, 1, 101)


def test_drift_refuses_what_it_cannot_measure(task: DriftTask, capsys: pytest.CaptureFixture[str]) -> None:
    ev = task.ev
    with pytest.raises(ValueError, match="exceed smollm2-135m's context of 8192"):
        DriftTask(ev, prompts=1, prompt_tokens=8000, tokens=512)
    with pytest.raises(ValueError, match="prompts=0, must be at least 1"):
        DriftTask(ev, prompts=0)
    with pytest.raises(ValueError, match="Use more --prompt-tokens or --drift-tokens"):
        DriftTask(ev, prompts=1, prompt_tokens=64, tokens=8).evaluate("kvarn_k4v2_g128", progress=False)


def test_cli_drift_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.json"
    args = ["eval", "--task", "drift", "--schemes", "fp16", "--prompts", "1", "--prompt-tokens", "64"]
    assert main([*args, "--drift-tokens", "8", "--chunk", "32", "--json", str(out), "--no-progress"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["task"] == "drift" and row["divergence"] == [8] and row["mean_divergence"] == 8.0
    assert abs(row["mean_kl"]) < 1e-6 and row["prompt_tokens"] == 64
    assert "divergence" in capsys.readouterr().out
