"""Accuracy budgets: ``1%`` (perplexity increase), ``kl=0.01``, ``greedy=200``.

A budget turns one measurement into a constraint value for Optuna (``<= 0`` is feasible) and
names the metric the tuner reports.

Example:
    >>> b = parse_budget("1%")
    >>> b.metric, b.limit
    ('ppl', 1.0)
    >>> b.violation(0.5)
    -0.5
    >>> parse_budget("greedy=200").violation(250)
    -50.0
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Metric = Literal["ppl", "kl", "greedy"]
_FORMS = "'1%' (perplexity increase in percent), 'kl=0.01' (mean KL divergence), 'greedy=200' (greedy agreement tokens)"
_PCT_RE = re.compile(r"\s*(?:ppl\s*=\s*)?([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*%\s*")
_KV_RE = re.compile(r"\s*(kl|greedy)\s*=\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*")


class BudgetError(ValueError):
    """A budget that cannot be parsed or is not positive; the message lists the accepted forms."""


class Measurement(Protocol):
    """What the tuner reads from an evaluation (``kvarn.eval.harness.EvalResult`` satisfies it).

    ``delta_ppl_pct_ci`` and ``kl_ci`` (``[low, high]`` bootstrap intervals) are read when present.
    """

    ppl: float
    delta_ppl_pct: float
    kl: float
    top1_agreement: float
    greedy_agreement_tokens: int | None
    tokens: int
    seconds: float


@dataclass(frozen=True)
class Budget:
    """An accuracy budget: ``metric`` must stay within ``limit``.

    ``ppl`` and ``kl`` are upper limits (perplexity increase in percent, mean KL in nats);
    ``greedy`` is a lower limit (tokens of greedy decoding that agree with the fp16 cache).
    """

    metric: Metric
    limit: float
    text: str

    @property
    def lower_is_better(self) -> bool:
        return self.metric != "greedy"

    @property
    def needs_greedy(self) -> bool:
        """Only the greedy budget pays for greedy decoding during the search."""
        return self.metric == "greedy"

    @property
    def slug(self) -> str:
        """A short tag for derived preset names: ``1pct``, ``kl0p01``, ``greedy200``."""
        num = f"{self.limit:g}".replace(".", "p").replace("-", "m").replace("+", "")
        return {"ppl": f"{num}pct", "kl": f"kl{num}", "greedy": f"greedy{num}"}[self.metric]

    @property
    def label(self) -> str:
        """Axis / table label of the metric."""
        return {"ppl": "perplexity increase (%)", "kl": "mean KL (nats)", "greedy": "greedy agreement (tokens)"}[
            self.metric
        ]

    def fmt(self, value: float) -> str:
        """One measured value in words, e.g. ``+2.557% perplexity``, ``KL 0.0123``, ``180 greedy tokens``.

        >>> parse_budget("1%").fmt(2.5571)
        '+2.557% perplexity'
        """
        if self.metric == "ppl":
            return f"{value:+.4g}% perplexity"
        if self.metric == "kl":
            return f"KL {value:.4g}"
        return f"{value:.0f} greedy tokens"

    def value(self, m: Measurement) -> float:
        """The budgeted metric of one measurement."""
        if self.metric == "ppl":
            return float(m.delta_ppl_pct)
        if self.metric == "kl":
            return float(m.kl)
        if m.greedy_agreement_tokens is None:
            raise BudgetError("a greedy budget needs a measurement with greedy agreement (evaluate with greedy=True)")
        return float(m.greedy_agreement_tokens)

    def interval(self, m: Measurement | Any) -> tuple[float, float] | None:
        """The metric's confidence interval in ``m`` (``[low, high]``), or None if it has none
        (greedy agreement; measurements made without intervals)."""
        ci = {"ppl": "delta_ppl_pct_ci", "kl": "kl_ci"}.get(self.metric)
        got = getattr(m, ci, None) if ci else None
        return None if got is None else (float(got[0]), float(got[1]))

    def bound(self, m: Measurement | Any) -> float:
        """The conservative end of the metric: the interval's upper end for ``ppl`` and ``kl``
        (a one-sided 95% upper confidence bound), else the point value."""
        ci = self.interval(m)
        return self.value(m) if ci is None else ci[1]

    def violation(self, value: float) -> float:
        """Optuna constraint value: ``<= 0`` meets the budget, larger is worse."""
        v = value - self.limit if self.lower_is_better else self.limit - value
        return float(v) if math.isfinite(v) else 1e9

    def met(self, value: float) -> bool:
        return self.violation(value) <= 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "metric": self.metric, "limit": self.limit}


def parse_budget(text: str) -> Budget:
    """Parse ``1%``, ``0.5%``, ``ppl=1%``, ``kl=0.01`` or ``greedy=200``.

    Raises:
        BudgetError: unparseable, zero, negative, or not finite; the message gives the accepted forms.
    """
    s = str(text).strip().lower()
    m = _PCT_RE.fullmatch(s)
    if m:
        metric: Metric = "ppl"
        limit = float(m[1])
    else:
        m = _KV_RE.fullmatch(s)
        if m is None:
            raise BudgetError(f"budget {text!r} is not understood; use one of {_FORMS}")
        metric = "kl" if m[1] == "kl" else "greedy"
        limit = float(m[2])
    if not math.isfinite(limit) or limit <= 0:
        raise BudgetError(
            f"budget {text!r} must be positive: a zero budget allows no change at all, which only the fp16 cache meets"
        )
    if metric == "greedy" and limit != int(limit):
        raise BudgetError(f"budget {text!r}: greedy agreement is a whole number of tokens, e.g. 'greedy=200'")
    return Budget(metric, limit, str(text).strip())
