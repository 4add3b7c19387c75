"""The per-layer allocation search: family schemes, bisection, and a whole run on the fake evaluator."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvarn.autotune.allocate import AllocationSpace, Family, allocate, bisect_family, cap
from kvarn.autotune.budget import parse_budget
from kvarn.autotune.report import summary_table
from kvarn.autotune.result import Outcome
from kvarn.autotune.search import make_space
from kvarn.autotune.tuner import TuneConfig, tune
from kvarn.schemes import Scheme

from .conftest import HEAD_DIM, NUM_LAYERS, FakeFactory, sample_text

RANKING = (3, 0, 5, 1, 4, 2)


def _bits(s: Scheme) -> float:
    return s.bits_per_element(HEAD_DIM, len(RANKING), context=4096)


@pytest.mark.parametrize("n", range(len(RANKING) + 1))
def test_family_gives_the_high_pair_to_the_most_sensitive_layers(n: int) -> None:
    s = Family("k4v2", "k4v3", "log8").scheme(RANKING, n)
    assert Scheme.from_name(s.name) == s
    high = {i for i in range(len(RANKING)) if s.for_layer(i).value_bits == 3}  # type: ignore[union-attr]
    assert high == set(RANKING[:n])
    assert all(s.for_layer(i).scale_dtype == "log8" and s.for_layer(i).key_bits == 4 for i in range(6))  # type: ignore[union-attr]


def test_bits_grow_linearly_with_the_high_layers_and_cap_stays_below_the_best() -> None:
    f = Family("k4v2", "k4v3")
    bits = [_bits(f.scheme(RANKING, n)) for n in range(len(RANKING) + 1)]
    steps = {round(b - a, 9) for a, b in zip(bits, bits[1:], strict=False)}
    assert len(steps) == 1 and steps.pop() == pytest.approx(0.5 / len(RANKING))
    assert cap(f, RANKING, _bits, None) == len(RANKING)
    assert cap(f, RANKING, _bits, bits[4]) == 3  # strictly fewer bits than the best so far
    assert cap(f, RANKING, _bits, bits[0]) == -1
    with pytest.raises(ValueError, match="more bits"):
        Family("k4v3", "k4v2")


@pytest.mark.parametrize("answer", [0, 1, 7, 15, 29, 30, None])
def test_bisection_finds_the_fewest_high_layers_in_log_steps(answer: int | None) -> None:
    asked: list[int] = []

    def feasible(family: Family, n: int) -> bool:
        asked.append(n)
        return answer is not None and n >= answer

    got = bisect_family(Family("k4v2", "k4v3"), 30, feasible)
    assert got == answer
    assert asked[0] == 30 and len(asked) <= 1 + math.ceil(math.log2(32))
    assert len(set(asked)) == len(asked)  # no point asked twice


def test_allocation_run_mixes_pairs_by_sensitivity_and_compares_with_builtins(tmp_path: Path) -> None:
    f = FakeFactory(ci_halfwidth=0.1)
    config = TuneConfig(
        budget=parse_budget("1%"), text=sample_text(), tokens=1024, trials=30, cache_dir=tmp_path, progress=False
    )
    res = tune(config, factory=f, dims=(NUM_LAYERS, HEAD_DIM))
    assert res.outcome is Outcome.OK, res.message
    w = res.winner
    assert w is not None and w.calib_bound is not None and w.calib_bound <= 1.0 and w.meets_heldout
    s = Scheme.from_name(w.scheme)
    pairs = {(s.for_layer(i).key_bits, s.for_layer(i).value_bits) for i in range(NUM_LAYERS)}  # type: ignore[union-attr]
    assert len(pairs) == 2  # a real mix, not one pair everywhere
    top = max(pairs, key=sum)
    high = [i for i in range(NUM_LAYERS) if (s.for_layer(i).key_bits, s.for_layer(i).value_bits) == top]  # type: ignore[union-attr]
    assert set(high) == set(res.ranking[: len(high)])  # the most sensitive layers get the upper pair
    assert set(res.ranking[:3]) == {0, 1, 29}
    # after the sensitivity probes, every measurement is a family point, and there are few of them:
    # a bisection per family at most, not a random walk
    calib = f.made[0]
    space = make_space(config, NUM_LAYERS, tuple(res.ranking), config.checked_group_sizes())
    assert isinstance(space, AllocationSpace) and {f.group_size for f in space.families} == {32, 64, 128, 256}
    points = {fam.scheme(space.ranking, n).name for fam in space.families for n in range(NUM_LAYERS + 1)}
    searched = calib.calls[NUM_LAYERS:]
    assert searched and {name for name, _ in searched} <= points
    assert sum(n is None for _, n in searched) <= len(space.families) * (1 + math.ceil(math.log2(NUM_LAYERS + 1)))
    # the report names the nearest built-in presets measured on the same held-out text
    refs = [r for r in res.references if r.get("builtin")]
    assert refs and all(r["heldout"]["tokens"] for r in refs)
    priced = [Scheme.from_name(r["name"]).bits_per_element(HEAD_DIM, NUM_LAYERS, config.bits_context) for r in refs]
    assert [b < w.bits for b in priced] == [True, False]  # the nearest below and above, priced as the winner
    line = next(x for x in summary_table(res).splitlines() if x.startswith("vs built-in presets"))
    assert all(r["name"] in line for r in refs)


def test_the_bisection_spans_only_the_layers_whose_pair_matters() -> None:
    """A model whose sliding layers stay 16-bit: n beyond the quantized layers changes nothing."""
    space = AllocationSpace(NUM_LAYERS, families=(Family("k4v2", "k4v3", "log8"),))
    asked: list[int] = []

    def feasible(f: Family, n: int) -> bool:
        asked.append(n)
        return n >= 2

    allocate(space, feasible, lambda s: s.bits_per_element(HEAD_DIM, NUM_LAYERS), lambda: None, lambda: False, 3)
    assert asked[0] == 3 and max(asked) == 3 and 2 in asked
