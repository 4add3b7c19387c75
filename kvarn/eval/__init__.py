"""Decode-mode accuracy harness on a real model: metrics vs fp16, needle retrieval, drift; table, JSON, plot."""

from kvarn.eval.drift import DriftResult, DriftTask
from kvarn.eval.harness import EvalResult, Evaluator, default_text
from kvarn.eval.metrics import MetricSums, kl_per_position, leading_matches
from kvarn.eval.needle import NeedleResult, NeedleTask
from kvarn.eval.report import (
    format_drift_table,
    format_needle_table,
    format_table,
    pareto_front,
    plot_pareto,
    read_json,
    write_json,
)

__all__ = [
    "DriftResult",
    "DriftTask",
    "EvalResult",
    "Evaluator",
    "MetricSums",
    "NeedleResult",
    "NeedleTask",
    "default_text",
    "format_drift_table",
    "format_needle_table",
    "format_table",
    "kl_per_position",
    "leading_matches",
    "pareto_front",
    "plot_pareto",
    "read_json",
    "write_json",
]
