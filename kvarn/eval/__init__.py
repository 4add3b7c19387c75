"""Decode-mode accuracy harness on a real model: metrics vs fp16, table, JSON, Pareto plot."""

from kvarn.eval.harness import EvalResult, Evaluator, default_text
from kvarn.eval.metrics import MetricSums, kl_per_position, leading_matches
from kvarn.eval.report import format_table, pareto_front, plot_pareto, read_json, write_json

__all__ = [
    "EvalResult",
    "Evaluator",
    "MetricSums",
    "default_text",
    "format_table",
    "kl_per_position",
    "leading_matches",
    "pareto_front",
    "plot_pareto",
    "read_json",
    "write_json",
]
