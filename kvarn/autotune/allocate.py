"""Per-layer bit allocation: the default search of ``kvarn-tune`` (``--strategy allocate``).

Layers differ in how much a lower bit width hurts them (KVTuner's per-layer allocation gets its
gains there), so a cache may give the upper of two adjacent bit pairs to the layers that need it
and the lower one to the rest. The search space here is small and ordered:

* a :class:`Family` is one codec layout (group size, rotation, normalization, scales, sink) and two
  bit pairs on the ladder, ``low`` and ``high`` (e.g. k4v2 and k4v3);
* within a family, ``n`` is how many layers get ``high``: the ``n`` most sensitive ones by the
  sensitivity pass (:func:`kvarn.autotune.space.layer_sensitivity`), the rest get ``low``. Bits
  grow linearly with ``n`` and the damage shrinks with it (assumed monotone), so the fewest bits
  that meet the budget are found by bisection on ``n``: about log2(layers) measurements;
* families are tried in order; points that cannot beat the best feasible bits so far are never
  measured, so a family above the best costs nothing.

Every point is one Optuna trial with fixed parameters (``family``, ``n_high``) run through the same
:class:`~kvarn.autotune.objective.Objective` as the TPE search: the same cache of measurements,
partial-evaluation pruning, confidence-bound constraint and resumable storage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import optuna

from kvarn.autotune.space import parse_pair, tier_overrides
from kvarn.schemes import Scheme
from kvarn.schemes.scheme import Rotation, ScaleDtype


@dataclass(frozen=True)
class Family:
    """A codec layout and two bit pairs; :meth:`scheme` mixes them by layer.

    Example:
        >>> Family("k4v2", "k4v3").scheme(ranking=(2, 0, 1, 3), n=1).name
        'kvarn_k4v2_g128_L2k4v3'
    """

    low: str
    high: str
    scale_dtype: ScaleDtype = "fp16"
    group_size: int = 128
    rotation: Rotation = "hadamard"
    norm_iters: int = 8
    sink_tokens: int = 1

    def __post_init__(self) -> None:
        if sum(parse_pair(self.low)) >= sum(parse_pair(self.high)):
            raise ValueError(f"family {self.low}-{self.high}: the high pair must have more bits than the low one")

    @property
    def name(self) -> str:
        """``k4v2-k4v3_g128_fp16``: the family's parameter value in a trial."""
        return f"{self.low}-{self.high}_g{self.group_size}_{self.scale_dtype}"

    def scheme(self, ranking: tuple[int, ...], n: int) -> Scheme:
        """``high`` on the ``n`` first layers of ``ranking`` (most sensitive first), ``low`` on the rest.

        The pair that covers more layers is the scheme's base and the other one its overrides, so
        names stay short.
        """
        layers = len(ranking)
        n = max(0, min(n, layers))
        high, low = list(ranking[:n]), list(ranking[n:])
        base, other, pair = (self.high, low, self.low) if len(high) >= len(low) else (self.low, high, self.high)
        k, v = parse_pair(base)
        return Scheme(
            key_bits=k,
            value_bits=v,
            group_size=self.group_size,
            rotation=self.rotation,
            norm_iters=self.norm_iters,
            scale_dtype=self.scale_dtype,
            overrides=tier_overrides(other, pair) if other else (),
            sink_tokens=self.sink_tokens,
        )


# Cheapest top first: log8 scales with k4v2/k4v3 end at 3.79 bits/element (head_dim 64), the shipped
# fp16 scales at 4.07; the k4v3/k4v4 families only matter when nothing below them meets the budget.
DEFAULT_FAMILIES: tuple[Family, ...] = (
    Family("k4v2", "k4v3", "log8"),
    Family("k4v2", "k4v3", "fp16"),
    Family("k4v3", "k4v4", "log8"),
    Family("k4v3", "k4v4", "fp16"),
)


class Layouts(Protocol):
    """What tile size and exact first tokens a layout has (a :class:`Family`, a ``Scheme``)."""

    @property
    def group_size(self) -> int: ...

    @property
    def sink_tokens(self) -> int: ...


class RecordsLayouts:
    """What a result records about a space of fixed layouts, as
    :class:`~kvarn.autotune.space.SearchSpace` has it: ``group_sizes``, ``sinks``,
    ``allow_fp16_layers``."""

    allow_fp16_layers = False

    @property
    def layouts(self) -> Sequence[Layouts]:
        raise NotImplementedError

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({x.group_size for x in self.layouts}))

    @property
    def sinks(self) -> tuple[str, ...]:
        return tuple(sorted({str(x.sink_tokens) for x in self.layouts}))


@dataclass(frozen=True)
class AllocationSpace(RecordsLayouts):
    """Families of two-pair layer mixes over one sensitivity ``ranking`` (most sensitive first)."""

    num_layers: int
    ranking: tuple[int, ...] = ()
    families: tuple[Family, ...] = DEFAULT_FAMILIES

    def __post_init__(self) -> None:
        ranking = self.ranking or tuple(range(self.num_layers))
        if sorted(ranking) != list(range(self.num_layers)):
            raise ValueError(f"ranking {ranking} must be a permutation of 0..{self.num_layers - 1}")
        if not self.families:
            raise ValueError("no family to search")
        object.__setattr__(self, "ranking", tuple(ranking))

    @property
    def layouts(self) -> tuple[Family, ...]:
        return self.families

    def family(self, name: str) -> Family:
        for f in self.families:
            if f.name == name:
                return f
        raise ValueError(f"unknown family {name!r}; known: {', '.join(f.name for f in self.families)}")

    def point(self, family: Family, n: int) -> dict[str, object]:
        """The fixed trial parameters of one point (for ``study.enqueue_trial``)."""
        return {"family": family.name, "n_high": n}

    def sample(self, trial: optuna.Trial) -> Scheme:
        """The scheme of a trial whose parameters were enqueued with :meth:`point`."""
        name = trial.suggest_categorical("family", [f.name for f in self.families])
        n = trial.suggest_int("n_high", 0, self.num_layers)
        return self.family(str(name)).scheme(self.ranking, int(n))


Verdict = Callable[[Family, int], bool | None]  # feasible, infeasible, or None: stop searching


def cap(family: Family, ranking: tuple[int, ...], bits: Callable[[Scheme], float], best: float | None) -> int:
    """The largest ``n`` whose scheme has fewer bits than ``best`` (all layers when no best yet);
    -1 when even ``n = 0`` does not."""
    n = len(ranking)
    if best is None:
        return n
    while n >= 0 and bits(family.scheme(ranking, n)) >= best:
        n -= 1
    return n


def bisect_smallest(top: int, feasible: Callable[[int], bool | None]) -> int | None:
    """The smallest ``n`` in ``[0, top]`` that ``feasible`` accepts, assuming that a larger ``n``
    never hurts: ``top`` first (if it fails, nothing below can pass), then bisection. None when
    ``top`` fails or the search was stopped (``feasible`` returned None) before ``top`` was decided."""
    if top < 0 or not feasible(top):
        return None
    lo, hi = -1, top  # lo: known (or assumed) infeasible; hi: known feasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        verdict = feasible(mid)
        if verdict is None:
            break
        lo, hi = (lo, mid) if verdict else (mid, hi)
    return hi


def bisect_family(family: Family, top: int, feasible: Verdict) -> int | None:
    """:func:`bisect_smallest` over the number of layers on ``family``'s high pair."""
    return bisect_smallest(top, lambda n: feasible(family, n))


def allocate(
    space: AllocationSpace,
    feasible: Verdict,
    bits: Callable[[Scheme], float],
    best: Callable[[], float | None],
    stopped: Callable[[], bool],
    span: int | None = None,
) -> None:
    """Bisect every family in turn, each below the best feasible bits found so far (``best()``),
    until the families are done or ``stopped()``.

    ``span``: the layers whose precision matters, first in the ranking (a model's sliding-window
    layers stay 16-bit whatever their pair); the bisection stops there rather than at every layer.
    """
    for family in space.families:
        if stopped():
            return
        top = cap(family, space.ranking, bits, best())
        bisect_family(family, top if span is None else min(top, span), feasible)
