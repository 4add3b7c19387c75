"""Accuracy metrics of a quantized cache against the fp16 reference, over next-token distributions.

All inputs are log-probabilities ``[positions, vocab]`` float32 (``log_softmax`` of the logits);
position ``t`` predicts token ``t + 1``. Sums are accumulated chunk by chunk so no scheme's
log-probabilities for the whole text are ever held at once; only two floats per position are kept
(the loss difference and the KL) for the confidence intervals.

Intervals come from a block bootstrap: the positions are cut into consecutive blocks (the evaluation
chunks), blocks are drawn with replacement (``BOOTSTRAP_RESAMPLES`` times, fixed seed, so the same
measurement always gives the same interval), and the statistic is recomputed on each draw. Blocks
rather than single positions, because neighbouring tokens' errors are correlated (they read the same
quantized tiles).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per position ``[L]`` of ``targets`` ``[L]`` int64 under ``logp`` ``[L, V]``."""
    return -logp.gather(1, targets[:, None])[:, 0]


def kl_per_position(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``KL(ref || logp)`` per position ``[L]``; both ``[L, V]`` log-probabilities."""
    return F.kl_div(logp, ref, log_target=True, reduction="none").sum(dim=-1)


def leading_matches(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


CONFIDENCE = 0.90  # two-sided; the upper end is a one-sided 95% upper bound
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def block_bootstrap_means(
    values: torch.Tensor, block: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> torch.Tensor:
    """Means of ``values`` ``[n, m]`` over block-bootstrap draws: ``[resamples, m]`` float64.

    The ``n`` positions are cut into ``ceil(n / block)`` consecutive blocks; each draw takes that many
    blocks with replacement and averages every position they hold (a short last block weighs less).

    Raises:
        ValueError: no positions, or ``block`` < 1.
    """
    n = values.shape[0]
    if n < 1 or block < 1:
        raise ValueError(f"block bootstrap needs positions and block >= 1, got n={n}, block={block}")
    nb = -(-n // block)
    v = values.double().reshape(n, -1)
    pad = torch.zeros(nb * block - n, v.shape[1], dtype=v.dtype)
    sums = torch.cat([v, pad]).reshape(nb, block, -1).sum(1)  # [nb, m]
    counts = torch.full((nb,), float(block), dtype=torch.float64)
    counts[-1] = n - (nb - 1) * block
    idx = torch.randint(nb, (resamples, nb), generator=torch.Generator().manual_seed(seed))
    return sums[idx].sum(1) / counts[idx].sum(1)[:, None]


def interval(draws: torch.Tensor, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The central ``confidence`` percentile interval of bootstrap draws ``[resamples]``."""
    q = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(draws.double(), q).tolist()
    return float(lo), float(hi)


@dataclass
class MetricSums:
    """Running sums over positions; :meth:`add` one chunk at a time."""

    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    count: int = 0
    per_position: list[torch.Tensor] = field(default_factory=list)  # [L, 2] float64: nll - ref nll, KL

    def add(self, ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        """Add a chunk: ``ref``, ``logp`` ``[L, V]`` float32 log-probs; ``targets`` ``[L]`` int64."""
        own = nll(logp, targets).double()
        kl = kl_per_position(ref, logp).double()
        self.nll += float(own.sum())
        self.kl += float(kl.sum())
        self.top1 += int((ref.argmax(-1) == logp.argmax(-1)).sum())
        self.count += int(targets.numel())
        self.per_position.append(torch.stack([own - nll(ref, targets).double(), kl], dim=1))

    def intervals(self, block: int, confidence: float = CONFIDENCE) -> tuple[tuple[float, float], tuple[float, float]]:
        """Block-bootstrap intervals ``(delta_ppl_pct, kl)`` over blocks of ``block`` positions.

        The perplexity increase of a draw is ``100 * (exp(mean(nll - ref nll)) - 1)``, which is the
        point estimate's formula on the same positions.
        """
        draws = block_bootstrap_means(torch.cat(self.per_position), block)  # [resamples, 2]
        d_lo, d_hi = interval(draws[:, 0], confidence)
        return (100.0 * math.expm1(d_lo), 100.0 * math.expm1(d_hi)), interval(draws[:, 1], confidence)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.count

    @property
    def top1_agreement(self) -> float:
        return self.top1 / self.count
