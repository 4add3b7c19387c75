"""Accuracy metrics of a quantized cache against the fp16 reference, over next-token distributions.

All inputs are log-probabilities ``[positions, vocab]`` float32 (``log_softmax`` of the logits);
position ``t`` predicts token ``t + 1``. Sums are accumulated chunk by chunk so no scheme's
log-probabilities for the whole text are ever held at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class MetricSums:
    """Running sums over positions; :meth:`add` one chunk at a time."""

    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    count: int = 0

    def add(self, ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        """Add a chunk: ``ref``, ``logp`` ``[L, V]`` float32 log-probs; ``targets`` ``[L]`` int64."""
        self.nll += float(nll(logp, targets).double().sum())
        self.kl += float(kl_per_position(ref, logp).double().sum())
        self.top1 += int((ref.argmax(-1) == logp.argmax(-1)).sum())
        self.count += int(targets.numel())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.count

    @property
    def top1_agreement(self) -> float:
        return self.top1 / self.count
