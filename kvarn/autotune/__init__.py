"""kvarn-tune: search schemes against an accuracy budget and write the winner as a preset.

The pieces, upstream first: :mod:`~kvarn.autotune.budget` (``1%``, ``kl=0.01``, ``greedy=200``),
:mod:`~kvarn.autotune.space` (Optuna parameters -> valid schemes; per-layer sensitivity),
:mod:`~kvarn.autotune.objective` (bits per element s.t. the budget constraint, pruning),
:mod:`~kvarn.autotune.tuner` (split, study, held-out confirmation), :mod:`~kvarn.autotune.report`
(preset with provenance, table, JSON, plot) and :mod:`~kvarn.autotune.cli` (``kvarn-tune``).
"""

from kvarn.autotune.budget import Budget, BudgetError, parse_budget
from kvarn.autotune.objective import Objective
from kvarn.autotune.space import SearchSpace, layer_sensitivity, only_layer, ranking
from kvarn.autotune.tuner import Candidate, TuneConfig, TuneResult, derived_name, split_text, tune

__all__ = [
    "Budget",
    "BudgetError",
    "Candidate",
    "Objective",
    "SearchSpace",
    "TuneConfig",
    "TuneResult",
    "derived_name",
    "layer_sensitivity",
    "only_layer",
    "parse_budget",
    "ranking",
    "split_text",
    "tune",
]
