"""Sinkhorn-like variance normalization of tiles: equalize column and row standard deviations.

A tile ``x`` ``[T, D]`` is written as ``x = diag(r) y diag(c)``; the iteration alternately divides
out column and row standard deviations, accumulating ``log c`` and ``log r``. Keys keep ``r`` (their
per-channel quantization scales absorb ``c``); values keep ``c`` (per-token scales absorb ``r``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# A row or column whose spread is (near) zero would get an unbounded factor: floor every std at
# this fraction of the mean std along the same axis.
_STD_FLOOR = 1e-3
_TINY = 1e-30


def _floored_log_std(y: torch.Tensor, dim: int) -> torch.Tensor:
    std = y.std(dim=dim, unbiased=False, keepdim=True)
    floor = _STD_FLOOR * std.mean(dim=(1, 2), keepdim=True) + _TINY
    return torch.log(std + floor)


def sinkhorn_iterates(x: torch.Tensor, iters: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(log_r [N, T, 1], log_c [N, 1, D])`` for iterates 0..iters of tiles ``x`` ``[N, T, D]``.

    Iterate 0 is no normalization (all zeros); each later iterate applies one column step and one
    row step. Factors are centred (geometric mean 1) so they carry no overall magnitude.
    """
    log_r = torch.zeros_like(x[:, :, :1])
    log_c = torch.zeros_like(x[:, :1, :])
    yield log_r, log_c
    for _ in range(iters):
        y = x * torch.exp(-log_r - log_c)
        log_c = log_c + _floored_log_std(y, dim=1)
        log_c = log_c - log_c.mean(dim=2, keepdim=True)
        y = x * torch.exp(-log_r - log_c)
        log_r = log_r + _floored_log_std(y, dim=2)
        log_r = log_r - log_r.mean(dim=1, keepdim=True)
        yield log_r, log_c


def std_spread(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread (std of log std) of the row and of the column standard deviations, per tile ``[N]``."""
    rows = torch.log(x.std(dim=2, unbiased=False) + _TINY).std(dim=1)
    cols = torch.log(x.std(dim=1, unbiased=False) + _TINY).std(dim=1)
    return rows, cols
