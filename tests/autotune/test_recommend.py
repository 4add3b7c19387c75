"""Which preset to use: the recommendation rule on made-up measurements, the shipped measurements,
`kvarn presets --model`, and the guide's table generated from the same file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.recommend import Record, by_scheme, load, models, recommend, table
from kvarn.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _rec(scheme: str, tokens: int, bits: float, kl: float, hi: float, model: str = "m") -> Record:
    return Record(model, scheme, tokens, bits, kl, (kl / 2, hi), 1.0, None, "test")


RECORDS = [
    _rec("kvarn_a", 2048, 3.0, 0.004, 0.012),  # point within 0.01, upper bound not
    _rec("kvarn_a", 8192, 3.0, 0.005, 0.006),
    _rec("kvarn_b", 2048, 3.5, 0.005, 0.006),
    _rec("kvarn_b", 8192, 3.5, 0.008, 0.009),
    _rec("kvarn_c", 2048, 2.0, 0.001, 0.002),  # cheapest and exact, but measured at one length only
    _rec("kvarn_d", 2048, 4.0, 0.002, 0.003),
    _rec("kvarn_d", 8192, 4.0, 0.003, 0.004),
]


def test_fewest_bits_whose_upper_bound_holds_at_every_length() -> None:
    pick = recommend("m", parse_budget("kl=0.01"), RECORDS)
    assert pick.holds and pick.scheme == "kvarn_b" and pick.bits_per_element == 3.5
    assert [r.tokens for r in pick.records] == [2048, 8192]
    assert "kvarn_b" in pick.sentence() and "kl=0.01" in pick.sentence()
    assert recommend("m", parse_budget("kl=0.02"), RECORDS).scheme == "kvarn_a"


def test_no_preset_holds_names_the_closest_and_the_tuner() -> None:
    pick = recommend("m", parse_budget("kl=0.001"), RECORDS)
    assert not pick.holds and pick.scheme is None and pick.closest == "kvarn_d"
    assert "kvarn-tune --model m --budget kl=0.001" in pick.sentence()


def test_unknown_model_and_greedy_budget_refused() -> None:
    with pytest.raises(ValueError, match=r"no preset measurements for model 'other'; measured: m"):
        recommend("other", parse_budget("kl=0.01"), RECORDS)
    with pytest.raises(ValueError, match="greedy"):
        recommend("m", parse_budget("greedy=100"), RECORDS)


def test_schemes_ordered_by_bits() -> None:
    assert list(by_scheme("m", RECORDS)) == ["kvarn_c", "kvarn_a", "kvarn_b", "kvarn_d"]


def test_shipped_measurements_cover_both_models_at_two_lengths() -> None:
    records = load()
    assert models(records) == ["smollm2-135m", "gemma3-270m"]
    for model in models(records):
        groups = by_scheme(model, records)
        assert "kvarn_k4v2_g128" in groups and {r.tokens for r in groups["kvarn_k4v2_g128"]} == {2048, 8192}
        for g in groups.values():
            for r in g:
                assert r.kl_ci is not None and r.kl_ci[0] <= r.kl <= r.kl_ci[1], r
        assert recommend(model, parse_budget("kl=0.01"), records).holds


def test_presets_model_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets", "--model", "smollm2-135m", "--budget", "kl=0.01"]) == 0
    out = capsys.readouterr().out
    pick = recommend("smollm2-135m", parse_budget("kl=0.01"))
    assert f"{pick.scheme}" in out and "<- kl=0.01" in out
    assert main(["presets", "--model", "smollm2-135m", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["scheme"] == pick.scheme and got["holds"] and got["budget"]["limit"] == 0.01
    assert main(["presets", "--model", "nope"]) == 2
    assert "measured: smollm2-135m, gemma3-270m" in capsys.readouterr().err


def test_guide_table_is_generated_from_the_shipped_file() -> None:
    page = (ROOT / "docs" / "guide" / "presets.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- preset-accuracy -->\n(.*?)\n<!-- /preset-accuracy -->", page, re.S)
    assert section is not None
    assert section[1] == table(load()), (
        "run: python tools/preset_accuracy.py <the eval JSON files> --doc docs/guide/presets.md"
    )
