"""Lloyd-Max scalar quantizers for the standard Gaussian, computed once, deterministically.

After a rotation, each coordinate of a unit vector in ``d`` dimensions is close to ``N(0, 1/d)``;
TurboQuant quantizes it with the MSE-optimal (Lloyd-Max) codebook of that distribution. We solve
the Lloyd-Max conditions for ``N(0, 1)`` with exact Gaussian integrals in float64 (centroid = mean of
its cell, boundary = midpoint of neighbouring centroids) and scale by ``1/sqrt(d)`` where used.
Known optimum MSEs (Max, 1960): 0.3634 (1 bit), 0.1175 (2), 0.03454 (3), 0.009497 (4).
"""

from __future__ import annotations

import functools
import math

import torch

_MAX_ITERS = 20000
_TOL = 1e-13


def _phi(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cdf(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = 0.5 * (1.0 + torch.special.erf(x / math.sqrt(2.0)))
    return out


def _cells(centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mids = (centroids[1:] + centroids[:-1]) / 2
    inf = torch.tensor([math.inf], dtype=torch.float64)
    return torch.cat([-inf, mids]), torch.cat([mids, inf])


@functools.lru_cache(maxsize=16)
def _solve(bits: int) -> tuple[tuple[float, ...], float]:
    n = 1 << bits
    c = torch.linspace(-2.0, 2.0, n, dtype=torch.float64)  # any sorted start converges (log-concave pdf)
    for _ in range(_MAX_ITERS):
        a, b = _cells(c)
        mass = _cdf(b) - _cdf(a)
        new = (_phi(a) - _phi(b)) / mass  # E[x | a < x < b] for N(0, 1)
        new = (new - new.flip(0)) / 2  # the optimum is symmetric; keep rounding from breaking that
        done = float((new - c).abs().max()) < _TOL
        c = new
        if done:
            break
    a, b = _cells(c)
    mass = _cdf(b) - _cdf(a)
    mse = 1.0 - float((mass * c * c).sum())  # E[x^2] - E[c(x)^2] when centroids are cell means
    return tuple(float(x) for x in c), mse


def lloyd_max_centroids(bits: int) -> torch.Tensor:
    """The ``2**bits`` sorted Lloyd-Max centroids of ``N(0, 1)``, float32 ``[2**bits]``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits} is not supported; allowed: 1..8")
    return torch.tensor(_solve(bits)[0], dtype=torch.float32)


def lloyd_max_mse(bits: int) -> float:
    """The mean squared error of the ``bits``-bit Lloyd-Max quantizer on ``N(0, 1)``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits} is not supported; allowed: 1..8")
    return _solve(bits)[1]


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index ``[...]`` int64 of the nearest of sorted ``centroids`` for every element of ``x``."""
    mids = ((centroids[1:] + centroids[:-1]) / 2).to(x.device)
    return torch.bucketize(x.contiguous(), mids)
