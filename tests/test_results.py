"""The README's table of measured figures is the rendering of ``docs/results.json``, and every number
in it is the number of the docs section that measured it (and of the pages that repeat it): a figure
edited in one place only fails here."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvarn.bench.results import Record, agrees, load, problems, rendered_readme, section, slug

ROOT = Path(__file__).resolve().parents[1]
RECORDS = load(ROOT / "docs" / "results.json")


def read(page: str) -> str:
    return (ROOT / page).read_text()


def edited(page: str, old: str, new: str) -> Callable[[str], str]:
    """A reader of the checkout with ``old`` replaced by ``new`` in ``page`` (which must hold it)."""
    assert old in read(page), (page, old)
    return lambda p: read(p).replace(old, new) if p == page else read(p)


def with_value(record: Record, which: str, **change: object) -> Record:
    values = tuple(dataclasses.replace(v, **change) if v.shown == which else v for v in record.values)
    return dataclasses.replace(record, values=values)


def test_readme_table_is_the_rendering_of_results_json() -> None:
    readme = read("README.md")
    assert rendered_readme(readme, RECORDS) == readme, "run: python tools/results.py"


def test_every_figure_is_the_number_of_the_section_it_cites() -> None:
    assert problems(RECORDS, read) == []


def test_every_record_states_its_conditions_and_runs() -> None:
    assert len({r.key for r in RECORDS}) == len(RECORDS)
    for r in RECORDS:
        assert all((r.what, r.figure, r.model, r.model_dtype, r.baseline, r.favours, r.machine)), r.key
        assert r.sources, r.key
        for s in r.sources:
            assert all((s.date, s.commit, s.machine, s.runs, s.command)), (r.key, s.key)
            assert re.match(r"\d{4}-\d\d-\d\d", s.date), (r.key, s.date)


def test_a_figure_edited_in_the_readme_only_fails() -> None:
    readme = read("README.md").replace("1.59x with 1,024 (24 requests)", "1.58x with 1,024 (24 requests)")
    assert rendered_readme(readme, RECORDS) != readme


def test_a_figure_edited_in_its_docs_section_only_fails() -> None:
    found = problems(RECORDS, edited("docs/serving.md", "| 20.3 | 1.59x |", "| 20.3 | 1.58x |"))
    assert len(found) == 1 and "burst-long-llama-fp32" in found[0], found


def test_a_figure_edited_in_a_page_that_repeats_it_only_fails() -> None:
    found = problems(RECORDS, edited("docs/overview.md", "1.59x (1,024, 24 requests", "1.58x (1,024, 24 requests"))
    assert found and all("docs/overview.md" in f for f in found), found


def test_a_figure_edited_in_results_json_only_fails() -> None:
    key = "serve-load-fp32"
    records = [
        with_value(dataclasses.replace(r, figure=r.figure.replace("1.59x", "1.58x")), "1.59x", shown="1.58x")
        if r.key == key else r
        for r in RECORDS
    ]  # fmt: skip
    assert any("'1.58x' does not round or span" in p for p in problems(records, read))
    readme = read("README.md")
    assert rendered_readme(readme, records) != readme
    records = [with_value(r, "1.59x", measured=("1.58x",)) if r.key == key else r for r in RECORDS]
    assert any("is in none of its quotes" in p for p in problems(records, read))


@pytest.mark.parametrize(
    ("shown", "measured", "ok"),
    [
        ("4.47x", ["4.47x"], True),
        ("3.79", ["3.785"], True),
        ("3.38", ["3.375"], True),
        ("0.199", ["0.1990"], True),
        ("833,536", ["833,536"], True),
        ("+0.91%", ["+0.91"], True),
        ("0.66-0.71x", ["0.70x", "0.66x", "0.71x"], True),
        ("1.58x", ["1.59x"], False),
        ("3.7", ["3.785"], False),
        ("0.66-0.70x", ["0.70x", "0.66x", "0.71x"], False),
        ("1.32x", ["1.32x", "1.33x"], False),
    ],
)
def test_agrees_accepts_the_number_its_rounding_or_range_only(shown: str, measured: list[str], ok: bool) -> None:
    assert agrees(shown, measured) is ok


def test_section_is_the_heading_or_the_marker_inside_it() -> None:
    page = "# T\n## A b (1)\nx\n```\n# not a heading\n```\n### Sub\n<!-- m -->\ny\n<!-- /m -->\n## Next\nz\n"
    assert slug("A b (1)") == "a-b-1"
    assert section(page, "a-b-1").splitlines() == page.splitlines()[1:10]
    assert section(page, "a-b-1", "m") == "y\n"
    with pytest.raises(KeyError, match="#next"):
        section(page, "next", "m")
    with pytest.raises(KeyError, match="#missing"):
        section(page, "missing")
