"""The Optuna objective: minimize bits per element subject to the accuracy budget.

One trial: sample a scheme, compute its bits per element (free), then spend evaluation time only
where it can matter:

1. a trial whose bits cannot beat the best feasible trial so far is pruned unmeasured (not in
   ``--pareto`` mode, where every point of the front counts); such trials cost no evaluation and
   do not count towards ``--trials`` (user attribute ``evaluated`` marks the ones that do);
2. a scheme already measured in this study (samplers repeat themselves) reuses that measurement;
3. a partial evaluation on the first ``prune_tokens`` tokens is reported to the study's pruner
   (:class:`optuna.pruners.ThresholdPruner` at ``prune_slack`` x the budget), which stops trials that
   are already far outside the budget;
4. the full evaluation sets the constraint with ``trial.set_constraint`` (Optuna 5): the distance
   of the metric's upper confidence bound (``feasibility='bound'``, default: the upper end of a
   90% chunk-bootstrap interval, see :mod:`kvarn.eval.metrics`) or of its point value
   (``'point'``) to the budget, ``<= 0`` feasible. Constraint-aware samplers (TPE) read it there.
   A point estimate just inside the budget is about as likely as not to exceed it on other text
   of the same kind; the bound leaves room for that sampling error.

The value returned is the scheme's bits per element: per-layer overrides included, and a sink
(tile or exact tokens) spread over ``context`` tokens, a per-sequence cost that a figure of the
tiles alone would hide. With ``cost_of`` (``--objective speed``) it is that cost instead, the
store's measured nanoseconds per token (:mod:`kvarn.autotune.storecost`), and the bits are kept
beside it as a user attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from kvarn.autotune.budget import Budget, Measurement
from kvarn.schemes import Scheme

CONSTRAINT = "budget"
MEASURE_KEYS = ("ppl", "delta_ppl_pct", "kl", "top1_agreement", "greedy_agreement_tokens", "tokens", "seconds")
INTERVAL_KEYS = ("delta_ppl_pct_ci", "kl_ci")  # [low, high] bootstrap intervals, when measured


class SpaceLike(Protocol):
    """What the objective needs of a search space: one trial -> one valid scheme
    (:class:`~kvarn.autotune.space.SearchSpace`, :class:`~kvarn.autotune.allocate.AllocationSpace`)."""

    def sample(self, trial: optuna.Trial) -> Scheme: ...


class EvaluatorLike(Protocol):
    """The part of ``kvarn.eval.harness.Evaluator`` the tuner uses."""

    def evaluate(
        self, scheme: str | Scheme, *, greedy: bool = True, max_tokens: int | None = None, progress: bool = True
    ) -> Any: ...


def measurement_dict(result: Measurement | Any) -> dict[str, Any]:
    """The JSON-able fields of an ``EvalResult`` (or any object with the same attributes)."""
    if is_dataclass(result) and not isinstance(result, type):
        src = asdict(result)
    else:
        src = {k: getattr(result, k) for k in MEASURE_KEYS if hasattr(result, k)}
    out: dict[str, Any] = {}
    for k in MEASURE_KEYS:
        v = src.get(k)
        out[k] = None if v is None else (int(v) if k in ("greedy_agreement_tokens", "tokens") else float(v))
    for k in INTERVAL_KEYS:
        if src.get(k) is not None:
            out[k] = [float(x) for x in src[k]]
    return out


class _Dict:
    """Attribute view of a measurement dict, so :meth:`Budget.value` reads both forms."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


def metric_of(budget: Budget, m: dict[str, Any]) -> float:
    """The point value of the budgeted metric in a measurement dict."""
    return budget.value(_Dict(m))  # type: ignore[arg-type]


def bound_of(budget: Budget, m: dict[str, Any]) -> float:
    """The conservative end of the budgeted metric (see :meth:`Budget.bound`)."""
    return budget.bound(_Dict(m))


def interval_of(budget: Budget, m: dict[str, Any] | None) -> tuple[float, float] | None:
    """The budgeted metric's confidence interval in a measurement dict, if it has one."""
    return None if m is None else budget.interval(_Dict(m))


def halving_rejects(budget: Budget, partial: dict[str, Any]) -> bool:
    """Successive halving's rule: a candidate measured on a prefix of the tokens is dropped when
    even the lower end of its metric's interval there is over the budget (a prefix reads fewer
    quantized tiles per position than the whole, so its damage is, if anything, lower). A
    measurement without an interval never decides.

    Example:
        >>> from kvarn.autotune.budget import parse_budget
        >>> b = parse_budget("kl=0.01")
        >>> halving_rejects(b, {"kl_ci": [0.0105, 0.0155]}), halving_rejects(b, {"kl_ci": [0.009, 0.017]})
        (True, False)
    """
    interval = interval_of(budget, partial)
    return interval is not None and not budget.met(interval[0])


def best_feasible(trials: list[FrozenTrial]) -> FrozenTrial | None:
    """The complete, feasible trial with the fewest bits (ties: lower metric violation, then number)."""
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.constraints.get(CONSTRAINT, 1.0) <= 0.0]
    if not ok:
        return None
    return min(ok, key=lambda t: (float(t.value or 0.0), t.constraints[CONSTRAINT], t.number))


@dataclass
class Objective:
    """Callable objective for ``study.optimize``.

    Args:
        space: the search space.
        budget: the accuracy budget (constraint).
        evaluator: calibration-text evaluator (decode mode; reference logits cached inside it).
        head_dim, num_layers: of the model, for bits per element.
        prune_tokens: tokens of the partial evaluation; ``None`` or 0 disables it (greedy budgets
            always disable it: greedy agreement of a prefix says little about the whole).
        pareto: measure every trial (no skipping by bits), to trace the whole front.
        progress: evaluator progress bars.
        since: trials numbered below this (an interrupted run's, in a resumed study) do not decide
            which points are skipped; their measurements are reused (:meth:`prime`). An enqueued
            search (allocate, ladder) then replays the uninterrupted run's path, trial for trial.
    """

    space: SpaceLike
    budget: Budget
    evaluator: EvaluatorLike
    head_dim: int
    num_layers: int
    prune_tokens: int | None = None
    pareto: bool = False
    progress: bool = False
    on_measured: Callable[[str, dict[str, Any]], None] | None = None
    chunk: int = 128
    tokens: int | None = None  # the evaluator's length; a partial evaluation must stay below it
    context: int | None = None  # sequence length the sink cost is spread over (None: not counted)
    feasibility: str = "bound"  # "bound": upper confidence bound within budget; "point": the estimate
    bits_of: Callable[[Scheme], float] | None = None  # bits of a model with sliding layers (see tuner.layer_mix_bits)
    since: int = 0
    cost_of: Callable[[Scheme], float] | None = None  # the value to minimize instead of bits (store ns/token)

    def __post_init__(self) -> None:
        self.cache: dict[str, dict[str, Any]] = {}
        self.partial_cache: dict[str, dict[str, Any]] = {}

    def prime(self, trials: list[FrozenTrial]) -> None:
        """Reuse the measurements of earlier trials (a resumed study)."""
        for t in trials:
            name = t.user_attrs.get("scheme")
            if name and "calib" in t.user_attrs:
                self.cache[name] = t.user_attrs["calib"]
            elif name and "partial" in t.user_attrs:
                self.partial_cache[name] = t.user_attrs["partial"]

    def _evaluate(self, scheme: Scheme, max_tokens: int | None) -> dict[str, Any]:
        r = self.evaluator.evaluate(
            scheme,
            greedy=self.budget.needs_greedy and max_tokens is None,
            max_tokens=max_tokens,
            progress=self.progress,
        )
        return measurement_dict(r)

    def partial_tokens(self, scheme: Scheme) -> int | None:
        """Prefix length of the partial evaluation for ``scheme``, or None to skip it.

        Decode mode reads a tile quantized only from the chunk after the one that filled it, and a
        sink tile is never quantized, so a prefix must reach past the first quantized tile's chunk
        (a 256-token prefix reads nothing quantized of ``g128_sink``: its first packed tile, tokens
        128-255, is read quantized only by the chunk after it).
        """
        if not self.prune_tokens:
            return None
        first_tile_end = scheme.group_size * (2 if scheme.sink_tile else 1)
        first_read = -(-first_tile_end // self.chunk) * self.chunk
        n = max(self.prune_tokens, first_read + self.chunk)
        return n if self.tokens is None or n < self.tokens else None

    def _prune_partial(self, trial: optuna.Trial, partial: dict[str, Any]) -> None:
        value = metric_of(self.budget, partial)
        trial.set_user_attr("partial", partial)
        trial.report(value, step=int(partial["tokens"] or self.prune_tokens or 0))
        status = None
        if trial.should_prune():
            status = "pruned: partial evaluation far outside the budget"
        elif halving_rejects(self.budget, partial):
            status = "pruned: over the budget on the prefix, by its whole interval"
        if status is not None:
            trial.set_user_attr("status", status)
            trial.set_constraint(CONSTRAINT, self.budget.violation(value))
            raise optuna.TrialPruned(f"{self.budget.metric}={value:.4g} on {partial['tokens']} tokens")

    def bits(self, scheme: Scheme) -> float:
        """The value a trial of ``scheme`` returns: bits per element, overrides and sink included."""
        if self.bits_of is not None:
            return self.bits_of(scheme)
        return scheme.bits_per_element(self.head_dim, self.num_layers, self.context)

    def __call__(self, trial: optuna.Trial) -> float:
        scheme = self.space.sample(trial)
        bits = self.bits(scheme)
        trial.set_user_attr("scheme", scheme.name)
        trial.set_user_attr("bits", bits)
        score, unit = bits, "bits"  # what the trial returns: bits, or the store's cost
        if self.cost_of is not None:
            score, unit = self.cost_of(scheme), "ns/token"
            trial.set_user_attr("store_ns", score)
        if not self.pareto:
            done = trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            best = best_feasible([t for t in done if t.number >= self.since])
            if best is not None and score >= float(best.value or 0.0):
                trial.set_user_attr("status", f"skipped: {score:.4f} {unit} cannot beat {float(best.value or 0):.4f}")
                raise optuna.TrialPruned(f"cannot beat the best feasible {unit}")
        measured = self.cache.get(scheme.name)
        if measured is None:
            n_partial = None if self.budget.needs_greedy else self.partial_tokens(scheme)
            if n_partial is not None:
                partial = self.partial_cache.get(scheme.name)
                if partial is None:
                    trial.set_user_attr("evaluated", True)
                    partial = self._evaluate(scheme, n_partial)
                    self.partial_cache[scheme.name] = partial
                self._prune_partial(trial, partial)
            trial.set_user_attr("evaluated", True)
            measured = self._evaluate(scheme, None)
            self.cache[scheme.name] = measured
            trial.set_user_attr("status", "measured")
            if self.on_measured is not None:
                self.on_measured(scheme.name, measured)
        else:
            trial.set_user_attr("status", "cached: same scheme as an earlier trial")
        value = metric_of(self.budget, measured)
        decided = bound_of(self.budget, measured) if self.feasibility == "bound" else value
        trial.set_user_attr("calib", measured)
        trial.set_user_attr("metric", value)
        trial.set_user_attr("decided_by", decided)
        trial.set_constraint(CONSTRAINT, self.budget.violation(decided))
        return score
