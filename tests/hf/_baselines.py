"""A baseline for the cache tests (the ``BaselineLike`` interface of :mod:`kvarn.hf.spec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HalfGrid:
    """A test baseline: rounds to a 0.5 grid; counts its calls in ``state``."""

    name: str = "half_grid"
    commit_tokens: int = 4
    window: int = 8

    def bits_per_element(self, head_dim: int) -> float:
        return 5.0

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        assert k.dtype == torch.float32 and k.shape[2] % self.commit_tokens == 0
        state["calls"] = state.get("calls", 0) + 1
        return torch.round(k * 2) / 2, torch.round(v * 2) / 2
