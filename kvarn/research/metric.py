"""Metric-weighted coding: quantize ``x A`` instead of ``x``, so squared error counts where it matters.

A research codec (issue 36; figures in docs/accuracy.md, "Below 3 bits"). The error a key makes in
an attention logit is ``q . e``; its expected square is ``e^T E[q q^T] e``. The error a value makes
in the layer's output is ``W_o,h e`` for each query head ``h`` reading it; its square is
``e^T (sum_h W_o,h^T W_o,h) e``. With ``A = G^(1/2)`` of such a Gram matrix ``G``, plain squared
error on ``x A`` is that weighted error on ``x``, which the unchanged codec then minimizes. ``A``
is one ``D x D`` matrix per layer and KV head: a per-model constant like the weights (the value
metric is computed from the weights alone; the key metric from queries on a calibration text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EIG_FLOOR = 1e-2  # eigenvalues of G below this fraction of their mean are raised to it


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (it holds tensors)
class LayerMetric:
    """``transform`` ``A`` and ``inverse`` ``A^-1``, both ``[H, D, D]`` float32 (rows of x: ``x @ A``)."""

    transform: torch.Tensor
    inverse: torch.Tensor


def sqrt_metric(gram: torch.Tensor, floor: float = EIG_FLOOR) -> LayerMetric:
    """``A = G^(1/2)`` of symmetric PSD ``gram`` ``[H, D, D]``, scaled to determinant 1 per head.

    Eigenvalues below ``floor`` times their mean are raised to it, so ``A`` stays well conditioned.
    """
    g = 0.5 * (gram + gram.transpose(-1, -2)).double()
    lam, vec = torch.linalg.eigh(g)
    lam = torch.maximum(lam, floor * lam.mean(dim=-1, keepdim=True))
    root = lam.sqrt()
    root = root / torch.exp(torch.log(root).mean(dim=-1, keepdim=True))  # det A = 1: no overall scale
    a = vec @ torch.diag_embed(root) @ vec.transpose(-1, -2)
    inv = vec @ torch.diag_embed(1.0 / root) @ vec.transpose(-1, -2)
    return LayerMetric(a.float().contiguous(), inv.float().contiguous())


def apply(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x @ m[h]`` for ``x`` ``[B, H, T, D]`` and per-head ``m`` ``[H, D, D]``."""
    return torch.einsum("bhtd,hde->bhte", x.float(), m.to(x.device))
