"""The held-out phase of ``tune()``: calibration winners re-measured on text the search never saw.

Candidates are tried fewest bits first; the first whose held-out metric meets the budget wins.
With ``--pareto`` every front point is measured too, and ``--compare`` names (presets, baselines)
are measured on the same text as references for the table and the plot, as are the built-in
presets nearest the winner's bits (:func:`nearest_builtins`), so the report can say what tuning
bought over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvarn.autotune.budget import Budget
from kvarn.autotune.objective import EvaluatorLike, interval_of, measurement_dict, metric_of
from kvarn.autotune.result import Candidate
from kvarn.schemes import Scheme


@dataclass
class HeldOut:
    """What the held-out check measured: ``confirmed`` in the order tried, and the ``winner`` among
    them (or None)."""

    confirmed: list[Candidate] = field(default_factory=list)
    winner: Candidate | None = None


def confirm(held_ev: EvaluatorLike, c: Candidate, budget: Budget, progress: bool = True) -> Candidate:
    """Measure ``c`` on held-out text; fills its ``heldout*`` fields and ``meets_heldout``; returns it."""
    r = held_ev.evaluate(Scheme.from_name(c.scheme), greedy=budget.needs_greedy, progress=progress)
    c.heldout = measurement_dict(r)
    c.heldout_metric = metric_of(budget, c.heldout)
    c.heldout_ci = interval_of(budget, c.heldout)
    c.meets_heldout = budget.met(c.heldout_metric)
    return c


def confirm_winner(
    held_ev: EvaluatorLike, feasible: list[Candidate], budget: Budget, tries: int, progress: bool = True
) -> HeldOut:
    """Try the first ``max(1, tries)`` of ``feasible`` (fewest bits first) until one meets the budget."""
    out = HeldOut()
    for c in feasible[: max(1, tries)]:
        out.confirmed.append(confirm(held_ev, c, budget, progress))
        if c.meets_heldout:
            out.winner = c
            break
    return out


def reference(held_ev: EvaluatorLike, name: str, budget: Budget, progress: bool = True) -> dict[str, Any]:
    """One ``--compare`` entry measured on held-out text: name, bits, heldout, metric, interval."""
    r = held_ev.evaluate(name, greedy=budget.needs_greedy, progress=progress)
    m = measurement_dict(r)
    return {
        "name": name,
        "bits": float(r.bits_per_element),
        "heldout": m,
        "metric": metric_of(budget, m),
        "interval": interval_of(budget, m),
    }


def nearest_builtins(bits: float, bits_of: Callable[[Scheme], float]) -> list[str]:
    """The built-in presets nearest ``bits`` per element from below and from above (priced by
    ``bits_of``), cheaper first; one of them when ``bits`` is outside their range."""
    from kvarn.schemes import BUILTINS

    priced = sorted((bits_of(s), name) for name, s in BUILTINS.items())
    below = [name for b, name in priced if b < bits][-1:]
    above = [name for b, name in priced if b >= bits][:1]
    return below + above
