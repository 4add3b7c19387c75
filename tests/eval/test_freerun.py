"""``kvarn eval --task freerun``: the scores on hand-made token lists, the shipped prompts, and a short
run on the real SmolLM2-135M."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvarn.cli import main
from kvarn.eval.freerun import (
    KINDS,
    MODES,
    FreerunTask,
    distinct,
    load_prompts,
    mean_interval,
    ratio_interval,
    repetition,
    top_p_sample,
)
from kvarn.eval.harness import Evaluator
from kvarn.eval.metrics import leading_matches

TOKENS = 12


def test_a_loop_repeats_what_its_period_says() -> None:
    loop = [1, 2, 3, 4, 5] * 8  # 40 tokens, period 5: 37 4-grams, 5 distinct
    assert repetition(loop) == pytest.approx(32 / 37)
    assert distinct(loop) == pytest.approx(5 / 39)
    fresh = list(range(40))
    assert repetition(fresh) == 0.0 and distinct(fresh) == 1.0
    assert repetition([7] * 10) == pytest.approx(6 / 7)  # one 4-gram, seven times
    assert distinct([1, 2, 1, 2, 3]) == pytest.approx(3 / 4)  # (1,2) twice, (2,1), (2,3)
    with pytest.raises(ValueError, match="3 tokens hold no 4-gram"):
        repetition([1, 2, 3])


def test_divergence_counts_the_shared_tokens_before_the_first_difference() -> None:
    assert leading_matches([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert leading_matches([5, 6, 7], [5, 6, 7]) == 3
    assert leading_matches([1], [2]) == 0


def test_the_interval_holds_the_mean_and_is_reproducible() -> None:
    values = [0.1, 0.4, 0.2, 0.9, 0.3, 0.5]
    mean, lo, hi = mean_interval(values)
    assert mean == pytest.approx(0.4) and lo < mean < hi and lo >= 0.1 and hi <= 0.9
    assert mean_interval(values) == (mean, lo, hi)
    assert mean_interval([2.0] * 5) == (2.0, 2.0, 2.0)
    assert ratio_interval([2 * v for v in values], values) == pytest.approx((2.0, 2.0, 2.0))  # paired: exact
    ratio, lo, hi = ratio_interval([0.5, 0.1, 0.3], [0.1, 0.5, 0.3])
    assert ratio == pytest.approx(1.0) and lo < 1.0 < hi


def test_the_sampler_keeps_to_the_nucleus_and_its_quantile() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1: top-p 0.9 keeps the first three
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4, 1)
    u = torch.tensor([0.0, 0.6, 0.9, 0.999])  # quantiles of 0.5/0.95, 0.3/0.95, 0.15/0.95
    assert top_p_sample(logits, u, temperature=1.0, top_p=0.9).tolist() == [0, 1, 2, 2]
    wide = torch.zeros(2, 5000)  # flat: the nucleus is larger than the first tokens sorted
    assert top_p_sample(wide, torch.tensor([0.0, 0.999]), temperature=1.0, top_p=0.95).max() < 5000


def test_the_shipped_prompts_cover_three_kinds() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 50 and {p.kind for p in prompts} == set(KINDS)
    assert all(p.text.strip() for p in prompts) and len({p.text for p in prompts}) == len(prompts)
    assert [p.kind for p in load_prompts(count=6)] == list(KINDS) * 2  # the kinds in turn
    assert {p.kind for p in load_prompts(["code"])} == {"code"}
    with pytest.raises(ValueError, match="unknown prompt kinds \\['poetry'\\]"):
        load_prompts(["poetry"])
    with pytest.raises(ValueError, match="1000 prompts asked for"):
        load_prompts(count=1000)


@pytest.fixture(scope="module")
def task() -> FreerunTask:
    return FreerunTask(Evaluator("smollm2-135m", tokens=10**6, chunk=16), prompts=3, tokens=TOKENS)


def test_fp16_against_itself_never_diverges_and_its_scores_are_finite(task: FreerunTask) -> None:
    r = task.evaluate("fp16", progress=False)
    assert r.kinds == list(KINDS) and r.bits_per_element == 16.0 and r.tokens == TOKENS
    for mode in MODES:
        assert r.scores[mode]["divergence"] == [float(TOKENS)] * 3
        assert all(math.isfinite(x) and x >= 1.0 for x in r.scores[mode]["ppl"])
        assert all(0.0 <= x <= 1.0 for k in ("repetition", "distinct2") for x in r.scores[mode][k])
        assert len(r.texts[mode]) == 3
    # the prompts differ in length: the shorter ones generated while the longer were still read
    assert task.lo < task.hi


def test_rows_of_a_batch_generate_as_they_would_alone(task: FreerunTask) -> None:
    alone = FreerunTask(task.ev, prompts=1, tokens=TOKENS)
    together = task.evaluate("fp16", progress=False)
    assert alone.evaluate("fp16", progress=False).texts == {m: t[:1] for m, t in together.texts.items()}


def test_cli_freerun_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f.json"
    args = ["eval", "--task", "freerun", "--schemes", "fp16", "--prompts", "2", "--kinds", "chat"]
    assert main([*args, "--freerun-tokens", "6", "--chunk", "16", "--json", str(out), "--no-progress"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["task"] == "freerun" and row["kinds"] == ["chat", "chat"]
    assert row["mean_low_high"]["greedy_divergence"] == [6.0, 6.0, 6.0]
    table = capsys.readouterr().out
    assert "greedy rep-4" in table and "sampled rep-4 / fp16" in table
