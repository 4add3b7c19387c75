"""kvarn-tune: search schemes against an accuracy budget and write the winner as a preset.

The pieces, upstream first: :mod:`~kvarn.autotune.budget` (``1%``, ``kl=0.01``, ``greedy=200``),
:mod:`~kvarn.autotune.space` (Optuna parameters -> valid schemes; per-layer sensitivity),
:mod:`~kvarn.autotune.objective` (bits per element s.t. the budget constraint, pruning),
:mod:`~kvarn.autotune.storecost` (the store's measured ns per token, ``--objective speed``),
:mod:`~kvarn.autotune.config` (``TuneConfig``), :mod:`~kvarn.autotune.corpus` (documents of
different kinds to calibrate and confirm on), :mod:`~kvarn.autotune.texts` (one ``--text``'s
calibration / held-out split), :mod:`~kvarn.autotune.pooled` (one measurement over several
documents), :mod:`~kvarn.autotune.allocate` and :mod:`~kvarn.autotune.ladder` (bisected searches),
:mod:`~kvarn.autotune.search` (sensitivity pass and Optuna study),
:mod:`~kvarn.autotune.heldout` (held-out confirmation), :mod:`~kvarn.autotune.result`
(``TuneResult``, ``Outcome``), :mod:`~kvarn.autotune.tuner` (``tune()``: the phases in order),
:mod:`~kvarn.autotune.report` (preset with provenance, table, JSON, plot) and
:mod:`~kvarn.autotune.cli` (``kvarn-tune``, the only place that picks exit codes), and
:mod:`~kvarn.autotune.missrate` (how often a winner breaks its budget on unseen documents);
:mod:`~kvarn.autotune.recommend` (which measured preset holds a budget on a model: ``kvarn presets --model``).
"""

from kvarn.autotune.budget import Budget, BudgetError, parse_budget
from kvarn.autotune.config import TuneConfig, derived_name
from kvarn.autotune.corpus import Document, document, documents
from kvarn.autotune.ladder import LadderSpace
from kvarn.autotune.objective import Objective
from kvarn.autotune.result import Candidate, Outcome, TuneResult
from kvarn.autotune.space import SearchSpace, layer_sensitivity, only_layer, ranking
from kvarn.autotune.texts import split_text
from kvarn.autotune.tuner import tune

__all__ = [
    "Budget",
    "BudgetError",
    "Candidate",
    "Document",
    "LadderSpace",
    "Objective",
    "Outcome",
    "SearchSpace",
    "TuneConfig",
    "TuneResult",
    "derived_name",
    "document",
    "documents",
    "layer_sensitivity",
    "only_layer",
    "parse_budget",
    "ranking",
    "split_text",
    "tune",
]
