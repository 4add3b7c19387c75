"""Successive halving on a fake evaluator that resumes (as the documents' pooled evaluator does): a
candidate over the budget on a prefix is dropped there, the rest are measured on every token, and
the search takes the path (and finds the winner) it takes without the prefix. Also the pieces that
make a default run fast: the sensitivity cache's key, the progress bar's plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.objective import halving_rejects
from kvarn.autotune.result import Outcome
from kvarn.autotune.search import make_space, planned_trials, prefix_sha
from kvarn.autotune.tuner import TuneConfig, tune

from .conftest import HEAD_DIM, NUM_LAYERS, FakeEvaluator, FakeFactory, sample_text

DIMS = (NUM_LAYERS, HEAD_DIM)


class ResumingFactory(FakeFactory):
    """Fake evaluators that say they continue a prefix's measurement (``resumes``)."""

    def __call__(self, texts: Sequence[str]) -> FakeEvaluator:
        ev = super().__call__(texts)
        ev.resumes = True  # type: ignore[attr-defined]
        return ev


def _config(tmp_path: Path, **kw: object) -> TuneConfig:
    base: dict[str, object] = dict(
        budget=parse_budget("1%"), text=sample_text(), tokens=1024, cache_dir=tmp_path, progress=False,
        compare_builtin=False,
    )  # fmt: skip
    base.update(kw)
    return TuneConfig(**base)  # type: ignore[arg-type]


def test_the_rule_drops_only_what_its_whole_prefix_interval_puts_over() -> None:
    kl = parse_budget("kl=0.01")
    assert halving_rejects(kl, {"kl": 0.013, "kl_ci": [0.0101, 0.016]})
    assert not halving_rejects(kl, {"kl": 0.013, "kl_ci": [0.0099, 0.016]})  # might still be within
    assert not halving_rejects(kl, {"kl": 0.05})  # no interval: the prefix never decides
    assert halving_rejects(parse_budget("1%"), {"delta_ppl_pct": 2.0, "delta_ppl_pct_ci": [1.2, 2.8]})


def test_prefix_drops_candidates_and_keeps_the_path_and_winner(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    halved_ev = ResumingFactory(ci_halfwidth=0.1)
    halved = tune(cfg, factory=halved_ev, dims=DIMS)
    plain_ev = ResumingFactory(ci_halfwidth=0.1)
    plain = tune(replace(cfg, prune_tokens=0, cache_dir=tmp_path / "plain"), factory=plain_ev, dims=DIMS)
    assert halved.outcome is plain.outcome is Outcome.OK
    assert halved.winner is not None and plain.winner is not None
    assert halved.winner.scheme == plain.winner.scheme
    assert halved.config["prune_tokens"] == 512 and plain.config["prune_tokens"] is None

    calls = halved_ev.made[0].calls[NUM_LAYERS:]  # after the sensitivity probes
    full = [name for name, n in calls if n is None]
    prefix = [name for name, n in calls if n == 512]
    assert set(full) <= set(prefix)  # every full measurement continues a prefix one
    dropped = [name for name in prefix if name not in full]
    assert dropped  # on this metric some points are over by their whole prefix interval
    assert full == [name for name, n in plain_ev.made[0].calls[NUM_LAYERS:] if name not in dropped]
    statuses = {t["scheme"]: t.get("status", "") for t in halved.trials}
    assert all("on the prefix" in statuses[name] for name in dropped)


def test_without_a_resuming_evaluator_the_bisections_measure_no_prefix(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    f = FakeFactory(ci_halfwidth=0.1)
    res = tune(cfg, factory=f, dims=DIMS)
    assert res.config["prune_tokens"] is None
    assert all(n is None for _, n in f.made[0].calls[NUM_LAYERS:])


class _Ids:
    def __init__(self, ids: list[int]) -> None:
        self.ids = torch.tensor([ids])


class _Parts:
    def __init__(self, *parts: list[int]) -> None:
        self.parts = [_Ids(p) for p in parts]


def test_sensitivity_key_reads_only_the_tokens_the_pass_reads() -> None:
    base = prefix_sha(_Parts([1, 2, 3, 4], [5, 6, 7]), 2, "fallback")
    assert prefix_sha(_Parts([1, 2, 9, 9, 9], [5, 6]), 2, "fallback") == base  # edits past the prefix
    assert prefix_sha(_Parts([1, 3, 3, 4], [5, 6, 7]), 2, "fallback") != base
    assert prefix_sha(_Parts([5, 6, 7], [1, 2, 3, 4]), 2, "fallback") != base  # the order of the documents
    assert prefix_sha(object(), 2, "fallback") == "fallback"  # no token ids: the texts' hash


def test_the_plan_counts_a_bisection_and_a_few_capped_points(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    space = make_space(cfg, NUM_LAYERS, (), cfg.checked_group_sizes())
    assert planned_trials(cfg, space) == 5 + 1 + 3  # log2(31) rounded up, the top, three capped points
    ladder = replace(cfg, strategy="ladder", search_tiles=False, confirm=3)
    assert planned_trials(ladder, make_space(ladder, NUM_LAYERS, (), ladder.checked_group_sizes())) == 4 + 1 + 2
    assert planned_trials(replace(cfg, strategy="tpe", trials=7), space) == 7


def test_progress_starts_after_the_sensitivity_pass_and_counts_to_the_plan(tmp_path: Path) -> None:
    seen: list[tuple[int, int, float | None]] = []
    res = tune(
        _config(tmp_path), factory=ResumingFactory(ci_halfwidth=0.1), dims=DIMS, on_trial=lambda *a: seen.append(a)
    )
    assert seen[0] == (0, 9, None)  # before the first trial: the plan, for the bar's ETA
    evaluated = [e for e, _, _ in seen]
    assert evaluated == sorted(evaluated) and all(total >= e for e, total, _ in seen)
    assert res.winner is not None and seen[-1][2] == res.winner.bits  # the best feasible bits, last
