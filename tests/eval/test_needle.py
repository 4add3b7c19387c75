"""``kvarn eval --task needle`` on the real SmolLM2-135M with short prompts (256 tokens, chunk 64)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvarn.cli import main
from kvarn.eval.harness import Evaluator, make_cache
from kvarn.eval.needle import NEEDLE, NeedleTask, build_prompts, needle_depths, needle_keys, retrieved

LENGTH, CHUNK = 256, 64


@pytest.fixture(scope="module")
def ev() -> Evaluator:
    return Evaluator("smollm2-135m", tokens=LENGTH, chunk=CHUNK)


def test_prompts_hold_the_key_at_a_line_start_and_share_what_precedes_it(ev: Evaluator) -> None:
    filler = ev.ids[0].tolist()
    prompts = build_prompts(ev.tokenizer, filler, LENGTH, needle_depths(4))
    assert [p.depth for p in prompts] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert [p.key for p in prompts] == needle_keys(4) and all(10000 <= k <= 99999 for k in needle_keys(4))
    shared = [p.shared for p in prompts]
    assert shared == sorted(shared) and len(set(shared)) == 4  # deeper needles come later
    deepest = prompts[-1].ids[0]
    for p in prompts:
        ids = p.ids[0]
        assert ids.shape == (LENGTH,)
        assert torch.equal(ids[: p.shared], deepest[: p.shared])  # the part a forked cache reuses
        text = ev.tokenizer.decode(ids)
        line = NEEDLE.format(key=p.key)
        assert text.count(line) == 1 and ("\n" + line in text or p.depth == 0.0)
        assert text.endswith("What is the pass key? The pass key is")
    with pytest.raises(ValueError, match="needle length 20: too short"):
        build_prompts(ev.tokenizer, filler, 20, [0.5])
    with pytest.raises(ValueError, match=r"filler text has 256 tokens, \d+ are needed"):
        build_prompts(ev.tokenizer, filler, 1024, [0.5])


def test_answers_are_scored_by_their_first_number() -> None:
    assert retrieved(" 60494.\n", 60494) and retrieved(" 60494. Remember", 60494)
    assert not retrieved(" 6049.", 60494) and not retrieved(" the pass key. 60494", 60494 + 1)
    assert not retrieved(" the pass key.\n\nThe pass", 60494)
    assert needle_depths(1) == [0.5]
    with pytest.raises(ValueError, match="depths=0"):
        needle_depths(0)


def test_fp16_finds_every_key_and_forked_caches_match_separate_runs(ev: Evaluator) -> None:
    task = NeedleTask(ev, lengths=[LENGTH], depths=3)
    fp16 = task.evaluate("fp16", progress=False)
    assert fp16.rates == [1.0] and fp16.bits_per_element == 16.0
    # 2-bit keys and values: answers change, so a fork that read the wrong cache would show
    r = task.evaluate("kvarn_k2v2_g64", progress=False)
    assert r.lengths == [LENGTH] and len(r.retrieved[0]) == 3 and r.bits_per_element < 4.0
    for p, answer in zip(task.prompts[LENGTH], r.answers[0], strict=True):
        cache = make_cache("kvarn_k2v2_g64", ev.model.config)
        last = torch.empty(0)
        for _, lp in ev.feed(cache, p.ids, _NoBar()):
            last = lp[-1]
        assert ev.tokenizer.decode(ev.greedy(cache, last, 8, _NoBar())) == answer


def test_lengths_beyond_the_context_or_the_text_are_refused(ev: Evaluator) -> None:
    with pytest.raises(ValueError, match="needle length 9000: beyond smollm2-135m's context of 8192"):
        NeedleTask(ev, lengths=[9000])
    with pytest.raises(ValueError, match="needle: no lengths"):
        NeedleTask(ev, lengths=[])


def test_cli_needle_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "n.json"
    args = ["eval", "--task", "needle", "--schemes", "kvarn_k4v4_g64", "--lengths", "192", "--depths", "2"]
    assert main([*args, "--chunk", "64", "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())
    assert [r["scheme"] for r in rows] == ["fp16", "kvarn_k4v4_g64"]  # fp16 joins to stand beside
    assert rows[0]["task"] == "needle" and rows[0]["retrieved"] == [[True, True]] and rows[0]["rates"] == [1.0]
    assert rows[1]["lengths"] == [192] and len(rows[1]["answers"][0]) == 2
    table = capsys.readouterr().out
    assert "192 tokens" in table and "2/2" in table


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lengths", "2048,abc"], ["'abc' is not one"]),
        (["--lengths", "32"], ["32 is too short"]),
        (["--task", "haystack"], ["invalid choice: 'haystack'", "perplexity", "needle", "drift"]),
        (["--depths", "0"], ["--depths must be >= 1, got 0"]),
    ],
)
def test_bad_arguments_name_the_value(extra: list[str], message: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["eval", "--task", "needle", "--no-progress", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(m in err for m in message)


def test_plot_belongs_to_the_perplexity_task(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--task", "needle", "--plot", "x.png", "--no-progress"]) == 2
    assert "--plot draws bits/element vs KL of --task perplexity, not of --task needle" in capsys.readouterr().err


class _NoBar:
    def update(self, n: int) -> None:
        pass
