"""What a tuning run found: ``Candidate`` (one measured scheme), ``TuneResult`` (the run), and the
functions that turn Optuna's finished trials into candidates, the Pareto front and table rows."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from optuna.trial import FrozenTrial

from kvarn.autotune.budget import Budget
from kvarn.autotune.objective import CONSTRAINT, bound_of, interval_of, metric_of
from kvarn.eval.report import pareto


class Outcome(StrEnum):
    """How a run ended. The CLI maps each outcome to its exit code."""

    OK = "ok"  # a winner met the budget on calibration and on held-out text
    UNREACHABLE = "unreachable"  # no trial met the budget on calibration text
    UNCONFIRMED = "unconfirmed"  # calibration winners were tried, none met it on held-out text
    INTERRUPTED = "interrupted"  # Ctrl-C during the study; resumable with the same storage


@dataclass
class Candidate:
    """One scheme with its measurements (``heldout`` None until confirmed).

    ``calib`` / ``heldout`` are measurement dicts (:func:`kvarn.autotune.objective.measurement_dict`);
    ``*_metric`` is the budgeted metric's point value in them, ``*_ci`` its 90% interval, and
    ``calib_bound`` the figure feasibility was decided on (the interval's upper end, or the point).
    """

    scheme: str
    bits: float
    calib: dict[str, Any] | None
    calib_metric: float | None
    heldout: dict[str, Any] | None = None
    heldout_metric: float | None = None
    meets_heldout: bool | None = None
    calib_bound: float | None = None
    calib_ci: tuple[float, float] | None = None
    heldout_ci: tuple[float, float] | None = None
    store_ns: float | None = None  # the store's measured ns per token (``--objective speed``)


@dataclass
class TuneResult:
    """What a run found.

    ``winner``: the first confirmed candidate that met the budget on held-out text (``outcome`` OK),
    else None and ``closest`` is the best trade-off seen. ``trials``: one row per Optuna trial
    (:func:`trial_rows`). ``extra``: seconds per phase (sensitivity, search, confirm, compare).
    """

    config: dict[str, Any]
    study_name: str
    head_dim: int
    num_layers: int
    text_sha256: str
    outcome: Outcome = Outcome.OK
    message: str = ""
    winner: Candidate | None = None
    confirmed: list[Candidate] = field(default_factory=list)
    front: list[Candidate] = field(default_factory=list)
    closest: Candidate | None = None
    trials: list[dict[str, Any]] = field(default_factory=list)
    references: list[dict[str, Any]] = field(default_factory=list)
    sensitivity: list[float] = field(default_factory=list)
    ranking: list[int] = field(default_factory=list)
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def interrupted(self) -> bool:
        return self.outcome is Outcome.INTERRUPTED


def fmt_ci(ci: tuple[float, float] | None) -> str:
    """``[low, high]`` of a 90% interval for messages and tables, or ``''`` if there is none."""
    return "" if ci is None else f"[{ci[0]:.3g}, {ci[1]:.3g}]"


def candidate(t: FrozenTrial, budget: Budget, feasibility: str = "bound") -> Candidate:
    """The candidate of a finished trial (its ``scheme``, ``bits`` and ``calib`` user attributes)."""
    calib = t.user_attrs.get("calib")
    metric = metric_of(budget, calib) if calib else None
    decided = (bound_of(budget, calib) if feasibility == "bound" else metric) if calib else None
    return Candidate(
        scheme=t.user_attrs["scheme"],
        bits=float(t.user_attrs["bits"]),
        store_ns=t.user_attrs.get("store_ns"),
        calib=calib,
        calib_metric=metric,
        calib_bound=decided,
        calib_ci=interval_of(budget, calib),
    )


def pareto_front(cands: list[Candidate], budget: Budget) -> list[Candidate]:
    """Candidates on the front of fewer bits and a better calibration metric
    (:func:`kvarn.eval.report.pareto`), by bits; an unmeasured metric is never on it."""
    sign = 1.0 if budget.lower_is_better else -1.0
    losses = [math.inf if c.calib_metric is None else sign * c.calib_metric for c in cands]
    return [cands[i] for i in pareto([(c.bits, loss) for c, loss in zip(cands, losses, strict=True)])]


def unique(cands: list[Candidate]) -> list[Candidate]:
    """The first candidate of each scheme, in order."""
    seen: dict[str, Candidate] = {}
    for c in cands:
        seen.setdefault(c.scheme, c)
    return list(seen.values())


def feasible_by_bits(cands: list[Candidate], budget: Budget, objective: str = "bits") -> list[Candidate]:
    """Unique candidates whose ``calib_bound`` meets the budget, fewest bits (then least margin)
    first; with ``objective='speed'``, fastest store first (then fewest bits)."""
    ok = unique([c for c in cands if c.calib_bound is not None and budget.met(c.calib_bound)])
    if objective == "speed":
        return sorted(ok, key=lambda c: (c.store_ns or 0.0, c.bits, budget.violation(c.calib_bound or 0.0)))
    return sorted(ok, key=lambda c: (c.bits, budget.violation(c.calib_bound or 0.0)))


def trial_rows(trials: list[FrozenTrial], budget: Budget) -> list[dict[str, Any]]:
    """One plain dict per trial (number, state, scheme, bits, metric, partial, constraint, status,
    evaluated) for the table and JSON."""
    rows = []
    for t in trials:
        calib = t.user_attrs.get("calib")
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "scheme": t.user_attrs.get("scheme"),
                "bits": t.user_attrs.get("bits"),
                "metric": metric_of(budget, calib) if calib else None,
                "partial": t.user_attrs.get("partial"),
                "constraint": t.constraints.get(CONSTRAINT),
                "status": t.user_attrs.get("status", ""),
                "evaluated": bool(t.user_attrs.get("evaluated")),
            }
        )
    return rows


def closest(trials: list[FrozenTrial], budget: Budget) -> Candidate | None:
    """The measured trial nearest to the budget (least constraint, then fewest bits); its metric
    from the partial evaluation when it had no full one. None when nothing was measured."""
    measured = [t for t in trials if CONSTRAINT in t.constraints and "scheme" in t.user_attrs]
    if not measured:
        return None
    t = min(measured, key=lambda t: (t.constraints[CONSTRAINT], t.user_attrs["bits"]))
    c = candidate(t, budget)
    if c.calib_metric is None and "partial" in t.user_attrs:
        c.calib_metric = metric_of(budget, t.user_attrs["partial"])
    return c
