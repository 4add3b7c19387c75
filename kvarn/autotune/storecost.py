"""The store's measured cost per token: what ``kvarn-tune --objective speed`` minimizes.

Normalization iterations cost no bits but cost store time (every Sinkhorn iterate is computed and
the best one kept), and tile size and bit widths change it too, so a user who asks for speed gets
the scheme whose store is fastest among those within the budget (ties: fewer bits). The cost of a
scheme is measured, not modelled: the CPU store (:func:`kvarn.kernels.cpu.store.quantize_tiles_cpu`,
the native kernel where it builds) quantizes fixed random tiles of each distinct layer layout, the
fastest of a few repeats is kept, and a model's cost per token is the sum over its layers
(unquantized layers cost nothing to store). Measurements are cached per layout for the run.

Example:
    >>> cost = StoreCost(head_dim=64, num_layers=2, timer=lambda s: float(s.norm_iters + 1))
    >>> cost(Scheme.from_name("kvarn_k4v2_g128_it2_L1fp16"))
    3.0
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvarn.schemes import Scheme

OBJECTIVES: tuple[str, ...] = ("bits", "speed")  # see kvarn.autotune.objective.Objective
TOKENS = 4096  # tokens (of one KV head) stored per timing
REPEATS = 3


def time_store(scheme: Scheme, head_dim: int, tokens: int = TOKENS, repeats: int = REPEATS) -> float:
    """Nanoseconds per token to store keys and values of one KV head of one layer with ``scheme``
    (overrides ignored): the fastest of ``repeats`` stores of ``tokens`` standard-normal tokens
    (seeded), after one untimed store that builds or loads the kernel."""
    import torch

    from kvarn.kernels.cpu.store import quantize_tiles_cpu

    g = torch.Generator().manual_seed(0)
    n = max(1, tokens // scheme.group_size)
    keys = torch.randn(n, scheme.group_size, head_dim, generator=g)
    values = torch.randn(n, scheme.group_size, head_dim, generator=g)
    quantize_tiles_cpu(keys, values, scheme)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        quantize_tiles_cpu(keys, values, scheme)
        best = min(best, time.perf_counter() - t0)
    return best * 1e9 / (n * scheme.group_size)


@dataclass
class StoreCost:
    """A scheme -> its store's nanoseconds per token, summed over the model's layers (per KV head).

    Args:
        head_dim, num_layers: of the model.
        timer: one layout (a scheme without overrides) -> ns per token of one layer and KV head;
            default :func:`time_store` at ``head_dim``.
    """

    head_dim: int
    num_layers: int
    timer: Callable[[Scheme], float] | None = None
    measured: dict[str, float] = field(default_factory=dict)  # layout name -> ns per token

    def layout(self, scheme: Scheme) -> float:
        """ns per token of one layer with ``scheme`` (no overrides), measured once per layout."""
        if scheme.name not in self.measured:
            timer = self.timer or (lambda s: time_store(s, self.head_dim))
            self.measured[scheme.name] = float(timer(scheme))
        return self.measured[scheme.name]

    def __call__(self, scheme: Scheme) -> float:
        total = 0.0
        for layer in range(self.num_layers):
            s = scheme.for_layer(layer)
            if s is not None:
                total += self.layout(s)
        return total
