"""The README's table of measured figures, rendered from ``docs/results.json`` and checked against
the docs sections that measured each figure.

A record is one row of the table: what was measured, the figure as the README shows it, and the
conditions that make it true (model, model dtype, the baseline and what favours either side,
machine). Each number in the figure is a :class:`Value` that names its run (a :class:`Source`: page,
heading anchor, generated section, date, commit, command) and quotes the line of that section that
holds it, so a figure edited in one place only is found:

- the README's table differs from the rendering of the JSON (:func:`render`);
- a quote is no longer in its section (the docs changed);
- a measured number is not in its quote, or the shown number is not that number, its rounding, or
  the range of several (the JSON changed);
- a page that repeats the figure (``repeated_in``) no longer quotes it.

``python tools/results.py`` rewrites the README's table; ``--check`` exits 1 and names each problem.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import ROOT

RESULTS = ROOT / "docs" / "results.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- results -->", "<!-- /results -->"
HEADER = "| what | measured | model, dtype; baseline; machine | page |\n|---|---|---|---|"
NUM = r"\d[\d,]*(?:\.\d+)?"


@dataclass(frozen=True)
class Quote:
    """A line of ``page`` under the heading ``anchor`` that repeats a figure."""

    page: str
    anchor: str
    quote: str


@dataclass(frozen=True)
class Source:
    """One run: where its full table is, when and how it was measured."""

    key: str
    page: str
    anchor: str
    date: str
    commit: str
    machine: str
    runs: str
    command: str
    marker: str = ""


@dataclass(frozen=True)
class Value:
    """A number as the README shows it (``shown``) and the cells it comes from (``measured``, each
    inside one of ``quotes`` of the section of ``source``)."""

    shown: str
    source: str
    measured: tuple[str, ...]
    quotes: tuple[str, ...]
    repeated_in: tuple[Quote, ...] = ()


@dataclass(frozen=True)
class Record:
    """One row of the README's table."""

    key: str
    what: str
    figure: str
    model: str
    model_dtype: str
    baseline: str
    favours: str
    machine: str
    page: str
    anchor: str
    sources: tuple[Source, ...]
    values: tuple[Value, ...]
    combines: str = ""

    def row(self) -> str:
        """The README's table row: what, figure, conditions, link to the full table."""
        link = f"[{Path(self.page).stem}]({self.page}#{self.anchor})"
        return f"| {self.what} | {self.figure} | {self.model}, {self.model_dtype}; {self.baseline}; {self.machine} | {link} |"


def _record(d: dict[str, Any]) -> Record:
    values = tuple(
        Value(v["shown"], v["source"], tuple(v["measured"]), tuple(v["quotes"]),
              tuple(Quote(**q) for q in v.get("repeated_in", ())))
        for v in d["values"]
    )  # fmt: skip
    sources = tuple(Source(**s) for s in d["sources"])
    fields = {k: d[k] for k in ("key", "what", "figure", "model", "model_dtype", "baseline", "favours", "machine",
                                "page", "anchor")}  # fmt: skip
    return Record(**fields, sources=sources, values=values, combines=d.get("combines", ""))


def load(path: Path = RESULTS) -> list[Record]:
    """The records of ``docs/results.json`` (``{"records": [...]}``), in the README's order."""
    return [_record(d) for d in json.loads(path.read_text())["records"]]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading.

    Example:
        >>> slug("bfloat16 on a CPU with AMX, the users' setting (2026-12-07)")
        'bfloat16-on-a-cpu-with-amx-the-users-setting-2026-12-07'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def section(text: str, anchor: str, marker: str = "") -> str:
    """The text of a page under the heading whose anchor is ``anchor`` (up to the next heading of
    the same or a higher level; code blocks are not headings), or, with ``marker``, between
    ``<!-- marker -->`` and ``<!-- /marker -->`` inside it. Raises ``KeyError`` naming what is missing."""
    lines, level, out, fenced = text.splitlines(), 0, [], False
    for line in lines:
        fenced ^= line.lstrip().startswith("```")
        heading = None if fenced else re.match(r"(#+) (.*)", line)
        if heading and level and len(heading.group(1)) <= level:
            break
        if heading and not level and slug(heading.group(2)) == anchor:
            level = len(heading.group(1))
        if level:
            out.append(line)
    if not level:
        raise KeyError(f"no heading with anchor #{anchor}")
    body = "\n".join(out)
    if marker:
        m = re.search(rf"<!-- {re.escape(marker)} -->\n(.*?)<!-- /{re.escape(marker)} -->", body, re.S)
        if not m:
            raise KeyError(f"no section <!-- {marker} --> under #{anchor}")
        body = m.group(1)
    return body


def _flat(s: str) -> str:
    return " ".join(s.split())


def _close(shown: str, value: float) -> bool:
    """``shown`` is ``value`` rounded to ``shown``'s decimals."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return abs(float(shown.replace(",", "")) - value) <= 0.5 * 10.0**-decimals + 1e-9


def agrees(shown: str, measured: Sequence[str]) -> bool:
    """``shown`` is the number of each of ``measured`` (equal or rounded), or ``lo-hi`` their range.

    Example:
        >>> agrees("3.79", ["**3.785**"]), agrees("0.66-0.71x", ["0.70x", "0.66x", "0.71x"])
        (True, True)
        >>> agrees("1.58x", ["1.59x"])
        False
    """
    found = [re.search(NUM, m) for m in measured]
    if not found or not all(found):
        return False
    numbers = [float(m.group().replace(",", "")) for m in found if m]
    span = re.fullmatch(rf"\D*({NUM})\D*?-({NUM})\D*", shown)
    if span:
        return _close(span.group(1), min(numbers)) and _close(span.group(2), max(numbers))
    single = re.findall(NUM, shown)
    return len(single) == 1 and all(_close(single[0], n) for n in numbers)


def problems(records: Sequence[Record], read: Callable[[str], str]) -> list[str]:
    """Every disagreement between the records and the docs (``read(page)`` gives a page's text)."""
    out: list[str] = []

    def text_of(page: str, anchor: str, marker: str, where: str) -> str | None:
        try:
            return _flat(section(read(page), anchor, marker))
        except (KeyError, OSError) as e:
            out.append(f"{where}: {page}: {e}")
            return None

    for r in records:
        sources = {s.key: s for s in r.sources}
        text_of(r.page, r.anchor, "", f"{r.key}: the page it links")
        for run in r.sources:
            text_of(run.page, run.anchor, run.marker, f"{r.key}: source {run.key}")
        for v in r.values:
            where = f"{r.key}: {v.shown!r}"
            if v.shown not in r.figure:
                out.append(f"{where} is not in the figure {r.figure!r}")
            if not agrees(v.shown, v.measured):
                out.append(f"{where} does not round or span what was measured: {list(v.measured)}")
            for m in v.measured:
                if not any(m in q for q in v.quotes):
                    out.append(f"{where}: {m!r} is in none of its quotes {list(v.quotes)}")
            s = sources.get(v.source)
            if s is None:
                out.append(f"{where}: no source {v.source!r}")
                continue
            body = text_of(s.page, s.anchor, s.marker, where)
            for q in v.quotes:
                if body is not None and _flat(q) not in body:
                    out.append(f"{where}: {s.page}#{s.anchor} {s.marker} no longer says {q!r}")
            for rep in v.repeated_in:
                again = text_of(rep.page, rep.anchor, "", where)
                if not any(x in rep.quote for x in (v.shown, *v.measured)):
                    out.append(f"{where}: the repeat {rep.quote!r} holds neither it nor {list(v.measured)}")
                if again is not None and _flat(rep.quote) not in again:
                    out.append(f"{where}: {rep.page}#{rep.anchor} no longer says {rep.quote!r}")
    return out


def render(records: Sequence[Record]) -> str:
    """The README's table, between its markers."""
    return "\n".join([BEGIN, HEADER, *(r.row() for r in records), END])


def rendered_readme(readme: str, records: Sequence[Record]) -> str:
    """``readme`` with the text between the markers replaced by :func:`render`."""
    pattern = re.compile(rf"{re.escape(BEGIN)}.*?{re.escape(END)}", re.S)
    if not pattern.search(readme):
        raise ValueError(f"README has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: render(records), readme)


def check(root: Path = ROOT) -> list[str]:
    """What is wrong with ``root``'s README table and ``docs/results.json``; empty when nothing."""
    records = load(root / "docs" / "results.json")
    readme = (root / "README.md").read_text()
    out = problems(records, lambda page: (root / page).read_text())
    if rendered_readme(readme, records) != readme:
        out.insert(0, "README.md's table differs from docs/results.json: run python tools/results.py")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the README or the docs disagree with the JSON")
    a = p.parse_args(argv)
    if a.check:
        found = check()
        print("\n".join(found) or "README.md and docs agree with docs/results.json")
        return 1 if found else 0
    README.write_text(rendered_readme(README.read_text(), load()))
    found = problems(load(), lambda page: (ROOT / page).read_text())
    print("\n".join(found) or f"wrote the table of {README}")
    return 1 if found else 0
