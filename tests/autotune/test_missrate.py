"""The miss-rate replay: the tuner's own search on stored per-document measurements (no model)."""

from __future__ import annotations

import torch

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.corpus import documents
from kvarn.autotune.ladder import rungs
from kvarn.autotune.missrate import Table, draw_splits, run_split, summary
from kvarn.autotune.pooled import Measured
from kvarn.eval.metrics import MetricSums

NAMES = ("gpl-3", "apache-2.0", "kvarn-code:codec", "kvarn-code:eval", "python-docs:1/2", "python-docs:2/2")
HARD = "kvarn-code:eval"  # every scheme measures twice the KL there


def _measured(kl: float, positions: int = 511) -> Measured:
    """A measurement whose every position has this KL and no perplexity change."""
    sums = MetricSums(nll=0.0, kl=kl * positions, top1=positions, count=positions)
    sums.per_position = [torch.tensor([[0.0, kl]] * positions, dtype=torch.float64)]
    return Measured(sums, ref_nll=0.0, bits=4.0, tokens=positions + 1, seconds=0.0)


def _table() -> Table:
    ladder = rungs(lambda s: s.bits_per_element(64, 30, 512))
    return {
        (d, s.name): _measured(0.04 / 2**i * (2.0 if d == HARD else 1.0)) for d in NAMES for i, s in enumerate(ladder)
    }


def test_splits_hold_out_each_kind_in_turn_and_never_calibrate_on_it() -> None:
    docs = documents(NAMES)
    kind = {d.name: d.kind for d in docs}
    drawn = draw_splits(docs, 6, seed=1)
    assert [kind[h[0]] for _, h in drawn] == ["code", "docs", "legal"] * 2
    for calib, held in drawn:
        assert len({kind[c] for c in calib}) == 2 and not {kind[c] for c in calib} & {kind[h] for h in held}


def test_replayed_winner_is_the_cheapest_rung_within_budget_and_misses_are_counted() -> None:
    docs = documents(NAMES)
    ladder = [s.name for s in rungs(lambda s: s.bits_per_element(64, 30, 512))]
    budget = parse_budget("kl=0.006")
    easy = run_split(_table(), docs, ["gpl-3", "kvarn-code:codec"], ["python-docs:1/2", "python-docs:2/2"], budget, 512)
    assert easy.winner == ladder[3]  # 0.04 / 8 = 0.005 is the first rung within 0.006
    assert easy.unseen_metric[HARD] == 0.01 and easy.misses(budget) == 1  # twice as hard: 0.010
    hard = run_split(_table(), docs, ["gpl-3", HARD], ["python-docs:1/2", "python-docs:2/2"], budget, 512)
    assert hard.winner == ladder[4]  # pooled (0.0025 + 0.005) / 2 is within; rung 3's 0.0075 is not
    assert hard.misses(budget) == 0
    got = summary([easy, hard], budget, "bound")
    assert (got["with_winner"], got["winner_misses_somewhere"], got["unseen_pairs_missed"]) == (2, 1, 1)
