"""How often a tuned preset breaks its budget on text the tuner never saw, over many splits.

Every document is measured once per scheme of the ladder (:mod:`kvarn.autotune.ladder`), in
decode mode, with its per-position differences kept (:func:`kvarn.autotune.pooled.measure`).
Then, for each split, the real :func:`~kvarn.autotune.tuner.tune` runs on those measurements
(an evaluator that pools them as :class:`~kvarn.autotune.pooled.PooledEvaluator` would, so the
search, the feasibility bound and the held-out check are the tuner's own code):

* calibration: one document of each of two kinds, drawn at random;
* held-out: two documents of the third kind;
* unseen: every other document; the winner *misses* on one when its point estimate there is
  outside the budget.

A split whose run ends without a winner counts apart (no preset written). Usage::

    python -m kvarn.autotune.missrate --budgets kl=0.01,1% --splits 30 --json missrate.json \\
        --docs gpl-3,apache-2.0,legal=/usr/share/common-licenses/GPL-2,kvarn-code:vllm,python-docs:1/6
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvarn.autotune.budget import Budget, parse_budget
from kvarn.autotune.config import TuneConfig
from kvarn.autotune.corpus import Document, documents, parse_names
from kvarn.autotune.ladder import rungs
from kvarn.autotune.objective import metric_of
from kvarn.autotune.pooled import Measured, measure, pool
from kvarn.eval.harness import EvalResult
from kvarn.schemes import Scheme

Table = dict[tuple[str, str], Measured]  # (document name, scheme name) -> measurement


def measure_table(
    model: str, docs: Sequence[Document], schemes: Sequence[Scheme], tokens: int, progress: bool = True
) -> Table:
    """Every scheme on the first ``tokens`` tokens of every document (one evaluator at a time, so
    one fp16 reference is held in memory)."""
    from kvarn.eval.harness import Evaluator

    out: Table = {}
    for i, d in enumerate(docs):
        t0 = time.perf_counter()
        ev = Evaluator(model, text=d.text, tokens=tokens, greedy_tokens=0)
        for s in schemes:
            out[(d.name, s.name)] = measure(ev, s)[0]
        if progress:
            print(
                f"[{i + 1}/{len(docs)}] {d.name} ({d.kind}): {len(schemes)} schemes, {time.perf_counter() - t0:.0f} s"
            )
    return out


class Replay:
    """An ``EvaluatorLike`` over measured documents: a scheme's documents pooled, as the tuner's
    :class:`~kvarn.autotune.pooled.PooledEvaluator` pools them."""

    def __init__(self, names: Sequence[str], table: Table, chunk: int = 128) -> None:
        self.names, self.table, self.chunk = list(names), table, chunk

    def evaluate(
        self, scheme: str | Scheme, *, greedy: bool = True, max_tokens: int | None = None, progress: bool = True
    ) -> EvalResult:
        name = scheme if isinstance(scheme, str) else scheme.name
        return pool(name, [self.table[(d, name)] for d in self.names], self.chunk)


@dataclass
class Split:
    """One split's documents and what the tuner did with them."""

    calibration: list[str]
    heldout: list[str]
    unseen: list[str]
    winner: str | None = None
    bits: float | None = None
    unseen_metric: dict[str, float] = field(default_factory=dict)  # document -> winner's point estimate

    def misses(self, budget: Budget) -> int:
        return sum(not budget.met(v) for v in self.unseen_metric.values())


def draw_splits(docs: Sequence[Document], n: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    """``n`` (calibration, held-out) document lists: held-out kinds in turn, the documents at random."""
    kinds = sorted({d.kind for d in docs})
    if len(kinds) < 3:
        raise ValueError(f"documents of three kinds are needed, got {kinds}")
    by_kind = {k: [d.name for d in docs if d.kind == k] for k in kinds}
    rng = random.Random(seed)
    out = []
    for i in range(n):
        held_kind = kinds[i % len(kinds)]
        calib = [rng.choice(by_kind[k]) for k in kinds if k != held_kind]
        held = rng.sample(by_kind[held_kind], min(2, len(by_kind[held_kind])))
        out.append((calib, held))
    return out


def run_split(
    table: Table,
    docs: Sequence[Document],
    calib: list[str],
    held: list[str],
    budget: Budget,
    tokens: int,
    feasibility: str = "bound",
) -> Split:
    """The tuner (ladder search, ``feasibility`` rule, held-out check) on one split's measurements."""
    from kvarn.autotune.tuner import tune

    config = TuneConfig(
        budget=budget, calibration_docs=tuple(calib), heldout_docs=tuple(held), tokens=tokens * len(calib),
        strategy="ladder", search_tiles=False, confirm=2, compare_builtin=False, progress=False, sensitivity_tokens=0,
        feasibility=feasibility,
    )  # fmt: skip
    parts = [calib, held]  # the tuner asks for the calibration evaluator first, then the held-out one
    res = tune(config, factory=lambda texts: Replay(parts.pop(0), table), dims=(30, 64))
    used = set(calib) | set(held)
    split = Split(calib, held, [d.name for d in docs if d.name not in used])
    if res.winner is not None:
        split.winner, split.bits = res.winner.scheme, res.winner.bits
        for d in split.unseen:
            m = pool(d, [table[(d, res.winner.scheme)]], 128)
            split.unseen_metric[d] = metric_of(budget, m.to_dict())
    return split


def summary(splits: Sequence[Split], budget: Budget, feasibility: str) -> dict[str, Any]:
    """Splits with a winner, splits whose winner misses on at least one unseen document, and the
    share of (split, unseen document) pairs that miss."""
    won = [s for s in splits if s.winner is not None]
    pairs = sum(len(s.unseen_metric) for s in won)
    return {
        "budget": budget.text,
        "feasibility": feasibility,
        "splits": len(splits),
        "with_winner": len(won),
        "winner_misses_somewhere": sum(s.misses(budget) > 0 for s in won),
        "unseen_pairs": pairs,
        "unseen_pairs_missed": sum(s.misses(budget) for s in won),
        "winners": sorted({s.winner for s in won if s.winner}),
        "mean_bits": sum(s.bits or 0.0 for s in won) / len(won) if won else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvarn.autotune.missrate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", required=True, help="comma list of documents (kvarn.autotune.corpus names), 3 kinds")
    p.add_argument("--budgets", default="kl=0.01,1%", help="comma list of budgets to replay")
    p.add_argument("--feasibility", default="bound,point", help="comma list of feasibility rules to replay")
    p.add_argument("--tokens", type=int, default=768, help="tokens of each document")
    p.add_argument("--splits", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every split and the summary here")
    p.add_argument("--table", type=Path, help="measurements: read from this file if it exists, else written to it")
    args = p.parse_args(argv)
    docs = documents(parse_names(args.docs))
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    t0, c0 = time.perf_counter(), time.process_time()
    if args.table is not None and args.table.is_file():
        table = torch.load(args.table, weights_only=False)
    else:
        ladder = rungs(lambda s: s.bits_per_element(64, 30, args.tokens))
        table = measure_table(args.model, docs, ladder, args.tokens)
        if args.table is not None:
            torch.save(table, args.table)
    measured = {"wall_s": round(time.perf_counter() - t0), "cpu_s": round(time.process_time() - c0)}
    out: dict[str, Any] = {"docs": {d.name: d.kind for d in docs}, "tokens": args.tokens, "measure": measured}
    drawn = draw_splits(docs, args.splits, args.seed)
    for b in args.budgets.split(","):
        budget = parse_budget(b)
        for rule in args.feasibility.split(","):
            splits = [run_split(table, docs, c, h, budget, args.tokens, rule) for c, h in drawn]
            key = f"{budget.text} {rule}"
            out[key] = {"summary": summary(splits, budget, rule), "splits": [s.__dict__ for s in splits]}
            print(json.dumps(out[key]["summary"]))
    per_doc = {
        f"{d}|{s}": {"kl": m.sums.mean_kl, "delta_ppl_pct": pool(s, [m], 128).delta_ppl_pct}
        for (d, s), m in table.items()
    }
    out["per_document"] = per_doc
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
