"""Budget parsing and constraint values."""

from __future__ import annotations

import pytest

from kvarn.autotune.budget import BudgetError, parse_budget
from kvarn.autotune.tuner import derived_name, split_text


@pytest.mark.parametrize(
    ("text", "metric", "limit", "slug"),
    [("1%", "ppl", 1.0, "1pct"), (" 0.5 % ", "ppl", 0.5, "0p5pct"), ("ppl=2%", "ppl", 2.0, "2pct"),
     ("kl=0.01", "kl", 0.01, "kl0p01"), ("KL = 1e-3", "kl", 0.001, "kl0p001"), ("greedy=200", "greedy", 200.0, "greedy200")],
)  # fmt: skip
def test_parse(text: str, metric: str, limit: float, slug: str) -> None:
    b = parse_budget(text)
    assert (b.metric, b.limit, b.slug) == (metric, limit, slug)


@pytest.mark.parametrize(
    ("text", "match"),
    [("0%", "positive"), ("kl=0", "positive"), ("greedy=0", "positive"), ("-1%", "not understood"),
     ("1", "not understood"), ("abc", "not understood"), ("kl=", "not understood"), ("greedy=1.5", "whole number"),
     ("", "not understood")],
)  # fmt: skip
def test_bad_budgets_fail_clearly(text: str, match: str) -> None:
    with pytest.raises(BudgetError, match=match) as e:
        parse_budget(text)
    if match == "not understood":
        assert "kl=0.01" in str(e.value) and "greedy=200" in str(e.value)  # lists the accepted forms


def test_violation_signs() -> None:
    assert parse_budget("1%").violation(1.2) == pytest.approx(0.2)
    assert parse_budget("1%").met(1.0)
    assert parse_budget("greedy=200").violation(150) == 50.0
    assert parse_budget("greedy=200").met(256)
    assert parse_budget("kl=0.01").violation(float("nan")) == 1e9


def test_split_text_disjoint_and_complete() -> None:
    text = "".join(f"paragraph {i} words words words.\n\n" for i in range(100))
    a, b = split_text(text, 0.5, "contiguous")
    assert a + "\n\n" + b == text
    assert 0.45 < len(b) / len(text) < 0.55
    assert not a.endswith("\n") and b.startswith("paragraph")
    with pytest.raises(ValueError, match="holdout"):
        split_text(text, 1.0)
    with pytest.raises(ValueError, match="split mode 'random' is not known; allowed: interleaved, contiguous"):
        split_text(text, 0.5, "random")


def test_interleaved_split_deals_out_paragraphs() -> None:
    paras = [f"paragraph {i} words words words." for i in range(100)]
    a, b = split_text("\n\n".join(paras), 0.5)
    assert a.split("\n\n") == paras[0::2] and b.split("\n\n") == paras[1::2]
    a, b = split_text("\n\n".join(paras), 0.25)
    assert len(b.split("\n\n")) == 25 and not set(a.split("\n\n")) & set(b.split("\n\n"))
    short = "one two three.\n\nfour five six."
    assert split_text(short, 0.5) == split_text(short, 0.5, "contiguous")  # too few paragraphs


def test_derived_name() -> None:
    assert derived_name("smollm2-135m", parse_budget("1%")) == "kvarn_smollm2_135m_1pct"
    assert derived_name("/models/Qwen3-4B/", parse_budget("kl=0.01")) == "kvarn_qwen3_4b_kl0p01"


def test_bound_is_the_upper_end_of_the_interval_when_there_is_one() -> None:
    from types import SimpleNamespace

    m = SimpleNamespace(delta_ppl_pct=0.8, kl=0.01, greedy_agreement_tokens=100, delta_ppl_pct_ci=[0.5, 1.3])
    ppl, kl, greedy = parse_budget("1%"), parse_budget("kl=0.02"), parse_budget("greedy=50")
    assert ppl.value(m) == 0.8 and ppl.interval(m) == (0.5, 1.3) and ppl.bound(m) == 1.3
    assert not ppl.met(ppl.bound(m)) and ppl.met(ppl.value(m))  # the point meets 1%, the bound does not
    assert kl.interval(m) is None and kl.bound(m) == 0.01  # no kl_ci measured: the point value
    assert greedy.interval(m) is None and greedy.bound(m) == 100.0
