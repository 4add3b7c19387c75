"""One precision for every layer, searched by bisection: ``kvarn-tune --strategy ladder``.

The ladder is a list of uniform schemes (one codec layout: tile, Hadamard rotation, 8
normalization iterations, one exact first token; bit pairs and scale formats varied, and with
``--search-tiles`` the tile size too), ordered by bits per element. Damage falls as bits rise along it (assumed, as in
:mod:`kvarn.autotune.allocate`), so the cheapest rung within the budget is found by bisection:
the top rung first, then about log2(rungs) measurements; the search then also measures the rungs
just above the winner, which the held-out check falls back to when it rejects the winner. No sensitivity pass is needed, which makes
it the fastest search: ``make run``'s tune step uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna

from kvarn.autotune.allocate import RecordsLayouts
from kvarn.autotune.space import parse_pair
from kvarn.schemes import Scheme
from kvarn.schemes.scheme import ScaleDtype

# (bit pair, scale format) rungs: every pair from k3v2 to k4v4 with log8 and fp16 scales, then the
# near-lossless k8v8 on top (so the ladder ends within any sensible budget)
RUNGS: tuple[tuple[str, ScaleDtype], ...] = (
    *((pair, scale) for pair in ("k3v2", "k4v2", "k4v3", "k4v4") for scale in ("log8", "fp16")),
    ("k8v8", "log8"),
)  # fmt: skip


def rungs(
    bits: Callable[[Scheme], float], group_size: int | Sequence[int] = 128, sink_tokens: int = 1
) -> tuple[Scheme, ...]:
    """The ladder's schemes at one tile size, or at each of several (``--search-tiles``), fewest
    ``bits`` first (ties: more key bits first, then the larger tile).

    Example:
        >>> [s.name for s in rungs(lambda s: s.bits_per_element(64, 30, 2048), (128, 256))][:3]
        ['kvarn_k3v2_g256_s8', 'kvarn_k3v2_g128_s8', 'kvarn_k3v2_g256']
    """
    sizes = (group_size,) if isinstance(group_size, int) else tuple(group_size)
    out = []
    for g in sizes:
        for pair, scale in RUNGS:
            k, v = parse_pair(pair)
            out.append(Scheme(k, v, g, scale_dtype=scale, sink_tokens=sink_tokens))
    return tuple(sorted(out, key=lambda s: (bits(s), -s.key_bits, -s.group_size)))


@dataclass(frozen=True)
class LadderSpace(RecordsLayouts):
    """Uniform schemes ordered by bits; a trial's one parameter is its rung (a scheme name)."""

    rungs: tuple[Scheme, ...]

    def __post_init__(self) -> None:
        if not self.rungs:
            raise ValueError("the ladder has no rung")

    @property
    def layouts(self) -> tuple[Scheme, ...]:
        return self.rungs

    ranking: tuple[int, ...] = ()  # no layer is ranked: every layer gets the same precision

    def point(self, i: int) -> dict[str, object]:
        """The fixed trial parameters of rung ``i`` (for ``study.enqueue_trial``)."""
        return {"rung": self.rungs[i].name}

    def sample(self, trial: optuna.Trial) -> Scheme:
        """The scheme of a trial whose parameters were enqueued with :meth:`point`."""
        return Scheme.from_name(str(trial.suggest_categorical("rung", [s.name for s in self.rungs])))
