"""``tune()``: calibration/held-out split, search, held-out check, result.

Data flow::

    documents of two kinds (calibration) | a document of a third kind (held-out)   (corpus.py)
      or: one --text --split--> calibration | held-out paragraphs                  (texts.py)
    calibration --> per-layer sensitivity (cached on disk) --> SearchSpace.ranking     (search.py)
    calibration --> study.optimize(Objective)   (minimize bits s.t. the budget constraint)
    feasible trials, fewest bits first --> re-measured on held-out --> first that meets the budget wins
                                                                                     (heldout.py)

A trial is feasible when the upper end of its metric's 90% chunk-bootstrap interval on the
calibration text is within the budget (``feasibility='bound'``), not merely its point estimate: on
another text of the same kind the point estimate moves by about the interval's half-width.

The library never prints, reads ``sys.argv`` or picks exit codes; :mod:`kvarn.autotune.cli` does
(from :class:`~kvarn.autotune.result.Outcome`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from optuna.trial import TrialState

from kvarn.autotune.budget import Budget, BudgetError
from kvarn.autotune.config import TuneConfig, derived_name
from kvarn.autotune.corpus import Document, documents
from kvarn.autotune.heldout import confirm, confirm_winner, nearest_builtins, reference
from kvarn.autotune.objective import EvaluatorLike, best_feasible
from kvarn.autotune.result import (
    Candidate,
    Outcome,
    TuneResult,
    candidate,
    closest,
    feasible_by_bits,
    fmt_ci,
    pareto_front,
    trial_rows,
    unique,
)
from kvarn.autotune.search import OnTrial, SearchRun, layer_mix_bits, resume_hint, search
from kvarn.autotune.texts import split_text, text_hash
from kvarn.eval.metrics import CONFIDENCE

__all__ = ["EvaluatorFactory", "TuneConfig", "derived_name", "harness_factory", "model_dims", "split_text", "tune"]

EvaluatorFactory = Callable[[Sequence[str]], EvaluatorLike]  # the texts of one part -> its evaluator


def model_dims(model: str) -> tuple[int, int]:
    """``(num_layers, head_dim)`` from the model's config.json (no weights loaded).

    Raises:
        kvarn.models.ModelNotFoundError: unknown alias or folder.
    """
    from kvarn.models import resolve_model

    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]), int(head_dim)


def harness_factory(config: TuneConfig) -> EvaluatorFactory:
    """Evaluators of the decode-mode harness on ``config.model``, one per part: the split parts of
    ``--text`` (one text each), or documents pooled (:class:`~kvarn.autotune.pooled.PooledEvaluator`,
    :attr:`TuneConfig.sequence_tokens` tokens of each)."""

    def make(texts: Sequence[str]) -> EvaluatorLike:
        from kvarn.autotune.pooled import PooledEvaluator
        from kvarn.eval.harness import Evaluator

        if config.text is not None:
            (text,) = texts
            one: EvaluatorLike = Evaluator(
                config.model, text=text, tokens=config.tokens, chunk=config.chunk, device=config.device,
                dtype=config.dtype,
            )  # fmt: skip
            return one
        return PooledEvaluator(config.model, texts, config.sequence_tokens, config.chunk, config.device, config.dtype)

    return make


def parts(config: TuneConfig) -> tuple[list[str], list[str], str]:
    """The calibration texts, the held-out texts and the SHA-256 that names them together.

    Raises:
        ValueError: an unknown document, or a greedy budget without ``--text`` (see
            :class:`~kvarn.autotune.pooled.PooledEvaluator`).
    """
    if config.text is not None:
        calib, held = split_text(config.text, config.holdout, config.split)
        return [calib], [held], text_hash(config.text)
    if config.budget.needs_greedy:
        raise BudgetError("a greedy budget is measured on one text: pass --text FILE with it")
    calib_docs, held_docs = documents(config.calibration_docs), documents(config.heldout_docs)
    return [d.text for d in calib_docs], [d.text for d in held_docs], corpus_hash(calib_docs + held_docs)


def corpus_hash(docs: list[Document]) -> str:
    """SHA-256 of the documents' names and texts, in order."""
    return text_hash("\0".join(f"{d.name}\0{d.text}" for d in docs))


def tune(
    config: TuneConfig,
    factory: EvaluatorFactory | None = None,
    dims: tuple[int, int] | None = None,
    on_trial: OnTrial | None = None,
) -> TuneResult:
    """Search the smallest scheme within ``config.budget``; see the module docstring.

    Args:
        config: the run's settings.
        factory: text -> evaluator (default: the decode-mode harness on ``config.model``).
        dims: ``(num_layers, head_dim)``; default read from the model's config.
        on_trial: called after every trial with (evaluated trials, the measurements the search
            expects to make in all (:func:`~kvarn.autotune.search.planned_trials`, raised as it
            goes), best feasible bits so far or None): the CLI's progress bar and its ETA.

    ``config.trials`` counts trials that ran an evaluation; trials pruned unmeasured (they could not
    beat the best feasible bits) are free and do not count, up to
    :data:`~kvarn.autotune.search.MAX_FREE_PER_TRIAL` per trial.

    Raises:
        ValueError: the token counts cannot hold the searched group sizes (see
            :meth:`TuneConfig.checked_group_sizes`), or a bad split.
    """
    t0 = time.perf_counter()
    num_layers, head_dim = dims or model_dims(config.model)
    factory = factory or harness_factory(config)
    calib_texts, held_texts, sha = parts(config)
    groups = config.checked_group_sizes()
    calib_sha = text_hash("\0".join(calib_texts))
    run = search(config, factory(calib_texts), (num_layers, head_dim), groups, sha, calib_sha, on_trial)
    res = TuneResult(
        config=_config_record(config, run),
        study_name=run.study_name,
        head_dim=head_dim,
        num_layers=num_layers,
        text_sha256=sha,
        trials=trial_rows(run.trials, config.budget),
        sensitivity=run.sensitivity,
        ranking=list(run.space.ranking),
    )
    res.extra["sensitivity_seconds"] = round(run.sensitivity_end - t0, 1)
    _finish(res, config, run, factory, held_texts)
    res.extra.setdefault("search_seconds", round(time.perf_counter() - run.sensitivity_end, 1))
    res.seconds = time.perf_counter() - t0
    return res


def _config_record(config: TuneConfig, run: SearchRun) -> dict[str, Any]:
    """The settings a result (and a preset's provenance) records."""
    return {
        "model": config.model,
        "budget": config.budget.to_dict(),
        "tokens": config.tokens,
        "holdout": config.holdout,
        "split": config.split if config.text is not None else "documents",
        "calibration_docs": None if config.text is not None else list(config.calibration_docs),
        "heldout_docs": None if config.text is not None else list(config.heldout_docs),
        "sequence_tokens": config.sequence_tokens,
        "strategy": config.strategy,
        "trials": config.trials,
        "seed": config.seed,
        "pareto": config.pareto,
        "group_sizes": list(run.space.group_sizes),
        "sinks": list(run.space.sinks),
        "allow_fp16_layers": run.space.allow_fp16_layers,
        "bits_context": config.bits_context,
        "prune_tokens": run.prune_tokens,
        "feasibility": config.feasibility,
        "objective": config.objective,
        "confidence": CONFIDENCE,
        "device": config.device,
        "dtype": config.dtype,
    }


def _finish(
    res: TuneResult, config: TuneConfig, run: SearchRun, factory: EvaluatorFactory, held_texts: list[str]
) -> None:
    """Fill ``res`` from the search: front, outcome and message; the held-out check when a
    calibration winner exists."""
    budget = config.budget
    trials = run.trials
    measured = [
        candidate(t, budget, config.feasibility)
        for t in trials
        if t.state == TrialState.COMPLETE and "calib" in t.user_attrs
    ]
    res.front = pareto_front(unique(measured), budget)
    best = best_feasible(trials)
    feasible = feasible_by_bits(measured, budget, config.objective)
    n_done = sum(bool(t.user_attrs.get("evaluated")) for t in trials)
    if run.interrupted:
        res.closest = candidate(best, budget) if best else closest(trials, budget)
        res.outcome = Outcome.INTERRUPTED
        res.message = f"interrupted after {n_done} finished trials; {resume_hint(config.storage)}"
        return
    if best is None or not feasible:
        res.closest = closest(trials, budget)
        res.outcome = Outcome.UNREACHABLE
        res.message = _unreachable_message(budget, config.feasibility, n_done, res.closest)
        return
    search_end = time.perf_counter()
    res.extra["search_seconds"] = round(search_end - run.sensitivity_end, 1)
    held_ev = factory(held_texts)
    checked = confirm_winner(held_ev, feasible, budget, config.confirm, config.progress)
    res.confirmed, res.winner = checked.confirmed, checked.winner
    if config.pareto:
        for c in res.front:
            if c.heldout is None:
                confirm(held_ev, c, budget, config.progress)
    confirm_end = time.perf_counter()
    res.extra["confirm_seconds"] = round(confirm_end - search_end, 1)
    res.references = [reference(held_ev, name, budget, config.progress) for name in config.compare]
    if config.compare_builtin and res.winner is not None:
        priced = layer_mix_bits(held_ev, config.bits_context) or (
            lambda s: s.bits_per_element(res.head_dim, res.num_layers, config.bits_context)
        )
        for name in nearest_builtins(res.winner.bits, priced):
            if name not in config.compare:
                res.references.append({**reference(held_ev, name, budget, config.progress), "builtin": True})
    res.extra["compare_seconds"] = round(time.perf_counter() - confirm_end, 1)
    if res.winner is None:
        c = min(res.confirmed, key=lambda c: budget.violation(c.heldout_metric or 0.0))
        res.closest = c
        res.outcome = Outcome.UNCONFIRMED
        res.message = (
            f"{len(res.confirmed)} candidate(s) met budget {budget.text} on calibration text but none on held-out "
            f"text; closest: {c.scheme} at {c.bits:.4f} bits/element with {budget.fmt(c.heldout_metric or 0.0)} on held-out text"
        )
    else:
        res.outcome = Outcome.OK
        res.message = _winner_message(res.winner, budget)


def _unreachable_message(budget: Budget, feasibility: str, n_done: int, near: Candidate | None) -> str:
    tail = (
        f"; closest trade-off: {near.scheme} at {near.bits:.4f} bits/element with {budget.metric}={near.calib_metric:.4g}"
        if near is not None and near.calib_metric is not None
        else ""
    )
    how = " (upper confidence bound)" if feasibility == "bound" else ""
    return f"budget {budget.text} unreachable: none of {n_done} trials met it{how} on calibration text{tail}"


def _winner_message(w: Candidate, budget: Budget) -> str:
    return (
        f"{w.scheme}: {w.bits:.4f} bits/element ({16 / w.bits:.2f}x), {budget.fmt(w.calib_metric or 0.0)} "
        f"{fmt_ci(w.calib_ci)} on calibration and {budget.fmt(w.heldout_metric or 0.0)} {fmt_ci(w.heldout_ci)} "
        f"on held-out text (budget {budget.text})"
    )
