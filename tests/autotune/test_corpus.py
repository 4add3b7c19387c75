"""Documents of different kinds: names, the ladder search over them, the held-out kind kept apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvarn.autotune.budget import BudgetError, parse_budget
from kvarn.autotune.config import TuneConfig
from kvarn.autotune.corpus import CALIBRATION_DOCS, HELDOUT_DOCS, document, documents
from kvarn.autotune.ladder import LadderSpace, rungs
from kvarn.autotune.result import Outcome
from kvarn.autotune.tuner import tune

from .conftest import HEAD_DIM, NUM_LAYERS, FakeFactory

DIMS = (NUM_LAYERS, HEAD_DIM)


def test_default_documents_are_of_different_kinds_and_the_heldout_kind_is_new() -> None:
    calib, held = documents(CALIBRATION_DOCS), documents(HELDOUT_DOCS)
    assert len({d.kind for d in calib}) == len(calib) >= 2
    assert {d.kind for d in held}.isdisjoint(d.kind for d in calib)
    assert all(len(d.text) > 20_000 for d in calib + held)  # thousands of tokens each
    assert "def " in document("kvarn-code").text and "GNU GENERAL PUBLIC LICENSE" in document("gpl-3").text


def test_python_docs_parts_split_the_whole() -> None:
    whole = document("python-docs").text
    parts = [document(f"python-docs:{i}/3").text for i in (1, 2, 3)]
    assert all(parts) and "\n\n".join(parts) == whole


@pytest.mark.parametrize(
    ("name", "match"),
    [("nope", "unknown document 'nope'; known: gpl-3"), ("kvarn-code:nope", "no such subpackage"),
     ("python-docs:4/3", "between 1 and 3"), ("legal=/nonexistent/file", "legal=/nonexistent/file")],
)  # fmt: skip
def test_bad_document_names_say_what_is_known(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        document(name)


def test_a_text_file_is_a_document_of_the_kind_named(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("some prose")
    d = document(f"prose={f}")
    assert (d.kind, d.text) == ("prose", "some prose")


def _config(tmp_path: Path, budget: str = "1%", **kw: object) -> TuneConfig:
    base: dict[str, object] = dict(budget=parse_budget(budget), tokens=1024, strategy="ladder", cache_dir=tmp_path,
                                   progress=False, compare_builtin=False, search_tiles=False)  # fmt: skip
    base.update(kw)
    return TuneConfig(**base)  # type: ignore[arg-type]


def test_ladder_finds_the_cheapest_feasible_rung_by_bisection(tmp_path: Path) -> None:
    f = FakeFactory()
    res = tune(_config(tmp_path), factory=f, dims=DIMS)
    assert res.outcome is Outcome.OK, res.message
    calib, held = f.made
    # the calibration part holds the calibration documents only, the held-out part the others
    assert calib.text == "\n\n".join(d.text for d in documents(CALIBRATION_DOCS))
    assert held.text == "\n\n".join(d.text for d in documents(HELDOUT_DOCS))
    ladder = rungs(lambda s: s.bits_per_element(HEAD_DIM, NUM_LAYERS, 512))
    # the top, then halves, then the rungs above the winner that the held-out check may fall back to
    measured = [name for name, n in calib.calls if n is None]
    assert len(measured) <= 1 + math.ceil(math.log2(len(ladder))) + 2
    met = [s.name for s in ladder if calib.evaluate(s).delta_ppl_pct <= 1.0]
    assert res.winner is not None and res.winner.scheme == met[0]  # the cheapest feasible rung
    names = [s.name for s in ladder]
    above = names.index(met[0]) + 1
    assert set(names[above : above + 2]) <= set(measured)  # --confirm 3: two fallbacks, next rungs up
    assert res.sensitivity == []  # one precision everywhere: no sensitivity pass
    assert res.config["calibration_docs"] == list(CALIBRATION_DOCS) and res.config["sequence_tokens"] == 512


def test_ladder_rungs_rise_in_bits_and_bits_count_each_documents_length() -> None:
    ladder = rungs(lambda s: s.bits_per_element(HEAD_DIM, NUM_LAYERS, 512))
    bits = [s.bits_per_element(HEAD_DIM, NUM_LAYERS, 512) for s in ladder]
    assert bits == sorted(bits) and ladder[0].name == "kvarn_k3v2_g128_s8" and ladder[-1].key_bits == 8
    space = LadderSpace(ladder)
    assert space.point(2) == {"rung": ladder[2].name} and space.ranking == ()
    assert TuneConfig(budget=parse_budget("1%"), tokens=4096).sequence_tokens == 2048
    assert TuneConfig(budget=parse_budget("1%"), tokens=1000).sequence_tokens == 384  # whole chunks


def test_a_greedy_budget_needs_one_text(tmp_path: Path) -> None:
    with pytest.raises(BudgetError, match="--text"):
        tune(_config(tmp_path, "greedy=100"), factory=FakeFactory(), dims=DIMS)
