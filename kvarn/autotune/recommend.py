"""Which preset to use: the measured accuracy of presets on real models, and the preset of fewest
bits that holds an accuracy budget on a model.

The measurements ship with the package (``kvarn/data/preset_accuracy.json``): one record per model,
scheme and length, from ``kvarn eval --json`` runs in decode mode against the 16-bit cache on the
same tokens, gathered by ``tools/preset_accuracy.py`` (which also writes the table of
docs/guide/presets.md). A preset *holds* a budget on a model when the conservative end of its
metric (:meth:`kvarn.autotune.budget.Budget.bound`: the upper end of the 90% interval, a one-sided
95% bound, for ``kl`` and ``1%``) is within the budget at every length measured on that model; of those, the fewest
bits per element (at the longest length) wins.

Example:
    >>> from kvarn.autotune.budget import parse_budget
    >>> pick = recommend("smollm2-135m", parse_budget("kl=0.01"))
    >>> pick.scheme, pick.holds
    ('kvarn_k4v3_g128_s8', True)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from kvarn.autotune.budget import Budget, parse_budget

DATA = "preset_accuracy.json"
BUDGETS = ("kl=0.005", "kl=0.01", "kl=0.02", "kl=0.05")  # the guide's table recommends for each


@dataclass(frozen=True)
class Record:
    """One measurement: ``scheme`` on ``model`` over ``tokens`` tokens of the harness's text.

    ``bits_per_element`` is the scheme's on that model (its head_dim, layers and length);
    ``kl_ci`` and ``delta_ppl_pct_ci`` are ``[low, high]`` 90% bootstrap intervals (None where the
    run recorded none); ``source`` names the run (command, commit or date)."""

    model: str
    scheme: str
    tokens: int
    bits_per_element: float
    kl: float
    kl_ci: tuple[float, float] | None
    delta_ppl_pct: float
    delta_ppl_pct_ci: tuple[float, float] | None
    source: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        ci = {k: None if d.get(k) is None else (float(d[k][0]), float(d[k][1])) for k in ("kl_ci", "delta_ppl_pct_ci")}
        return cls(
            model=str(d["model"]), scheme=str(d["scheme"]), tokens=int(d["tokens"]),
            bits_per_element=float(d["bits_per_element"]), kl=float(d["kl"]), kl_ci=ci["kl_ci"],
            delta_ppl_pct=float(d["delta_ppl_pct"]), delta_ppl_pct_ci=ci["delta_ppl_pct_ci"],
            source=str(d.get("source", "")),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def kl_text(self) -> str:
        """``0.0154 [0.0127, 0.0180]``: the mean KL and its interval."""
        lo, hi = self.kl_ci or (self.kl, self.kl)
        return f"{self.kl:.4f} [{lo:.4f}, {hi:.4f}]"


@dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend` chose: ``scheme`` (None when no measured preset holds the budget),
    whether it ``holds``, its records (one per measured length), and ``closest``: the preset of
    lowest error at the longest length when none holds."""

    model: str
    budget: Budget
    scheme: str | None
    holds: bool
    records: tuple[Record, ...]
    closest: str | None = None

    @property
    def bits_per_element(self) -> float | None:
        return max(self.records, key=lambda r: r.tokens).bits_per_element if self.records else None

    def sentence(self) -> str:
        """The recommendation in words, with the command to tune when no measured preset holds."""
        if self.scheme is not None:
            worst = ", ".join(f"{self.budget.fmt(self.budget.bound(r))} at {r.tokens}" for r in self.records)
            return (
                f"{self.model}, budget {self.budget.text}: {self.scheme} ({self.bits_per_element:.3f} bits/element; "
                f"one-sided 95% bound {worst} tokens)"
            )
        return (
            f"{self.model}, budget {self.budget.text}: no measured preset holds it (closest: {self.closest}); "
            f"search one: kvarn-tune --model {self.model} --budget {self.budget.text}"
        )


def load(path: Path | None = None) -> list[Record]:
    """The shipped measurements, or those of ``path`` (a JSON list of records)."""
    if path is not None:
        return [Record.from_dict(d) for d in json.loads(path.read_text(encoding="utf-8"))]
    return list(_shipped())


@cache
def _shipped() -> tuple[Record, ...]:
    text = resources.files("kvarn").joinpath("data", DATA).read_text(encoding="utf-8")
    return tuple(Record.from_dict(d) for d in json.loads(text))


def models(records: Iterable[Record] | None = None) -> list[str]:
    """The models with measurements, in the order they first appear."""
    return list(dict.fromkeys(r.model for r in (load() if records is None else records)))


def by_scheme(model: str, records: Iterable[Record] | None = None) -> dict[str, tuple[Record, ...]]:
    """``model``'s records grouped by scheme (shortest length first), schemes by bits per element.

    Raises:
        ValueError: ``model`` has no measurements; the message lists those that have.
    """
    records = list(load() if records is None else records)
    mine = sorted((r for r in records if r.model == model), key=lambda r: r.tokens)
    if not mine:
        raise ValueError(
            f"no preset measurements for model {model!r}; measured: {', '.join(models(records))}. "
            f"Measure with `kvarn eval --model {model}`, or search a preset with `kvarn-tune --model {model}`"
        )
    groups: dict[str, list[Record]] = {}
    for r in mine:
        groups.setdefault(r.scheme, []).append(r)
    return {s: tuple(g) for s, g in sorted(groups.items(), key=lambda kv: (kv[1][-1].bits_per_element, kv[0]))}


def recommend(model: str, budget: Budget, records: Iterable[Record] | None = None) -> Recommendation:
    """The preset of fewest bits per element that holds ``budget`` on ``model`` at every length
    measured on that model (module docstring). Only ``kl`` and perplexity (``1%``) budgets apply.

    Raises:
        ValueError: ``model`` has no measurements, or ``budget`` is a greedy budget (not measured).
    """
    if budget.metric == "greedy":
        raise ValueError(f"budget {budget.text!r}: presets are measured by KL and perplexity; use 'kl=...' or '1%'")
    groups = by_scheme(model, records)
    lengths = {r.tokens for g in groups.values() for r in g}
    full = {s: g for s, g in groups.items() if {r.tokens for r in g} == lengths}
    for scheme, g in full.items():  # fewest bits first
        if all(budget.met(budget.bound(r)) for r in g):
            return Recommendation(model, budget, scheme, True, g)
    closest = min(full, key=lambda s: budget.bound(full[s][-1])) if full else None
    return Recommendation(model, budget, None, False, full.get(closest or "", ()), closest)


def gather(paths: list[Path]) -> list[Record]:
    """The kvarn rows with a KL interval of ``paths``, a later file's row replacing an earlier one."""
    rows: dict[tuple[str, str, int], Record] = {}
    for path in paths:
        for d in json.loads(path.read_text(encoding="utf-8")):
            if not str(d.get("scheme", "")).startswith("kvarn_") or d.get("kl_ci") is None:
                continue
            d = {"delta_ppl_pct_ci": None, "source": f"{path.name}"} | d
            r = Record.from_dict(d)
            rows[(r.model, r.scheme, r.tokens)] = r
    return list(rows.values())


def save(records: list[Record], path: Path) -> None:
    """Write ``records`` as the measurements file :func:`load` reads (models in order, then scheme, length)."""
    order = models(records)
    rows = [r.to_dict() for r in sorted(records, key=lambda r: (order.index(r.model), r.scheme, r.tokens))]
    path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def table(records: list[Record]) -> str:
    """Markdown: per model a table of its presets (bits, KL at each length with its interval) and
    the recommendation for each of :data:`BUDGETS`."""
    parts = []
    for model in models(records):
        groups = by_scheme(model, records)
        lengths = sorted({r.tokens for g in groups.values() for r in g})
        head = "| preset | bits/element | vs 16-bit | " + " | ".join(f"KL {n} tokens [90%]" for n in lengths) + " |"
        lines = [f"**{model}**", "", head, "|---|---:|---:|" + "---:|" * len(lengths)]
        for scheme, g in groups.items():
            at = {r.tokens: r for r in g}
            bits = g[-1].bits_per_element
            cells = " | ".join(at[n].kl_text if n in at else "-" for n in lengths)
            lines.append(f"| `{scheme}` | {bits:.3f} | {16 / bits:.2f}x | {cells} |")
        lines.append("")
        for text in BUDGETS:
            pick = recommend(model, parse_budget(text), records)
            lines.append(f"- `kl` budget {text.split('=')[1]}: " + (f"`{pick.scheme}`" if pick.scheme else
                         f"none holds it (closest `{pick.closest}`): `kvarn-tune`"))  # fmt: skip
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
