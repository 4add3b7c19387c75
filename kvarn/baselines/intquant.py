"""``int8``: symmetric int8 per token (per token and KV head), one fp16 scale each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline, to_fp16


def int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 over the last axis: ``scale = amax / 127`` (fp16), codes in [-127, 127]."""
    scale = to_fp16(x.abs().amax(dim=-1, keepdim=True) / 127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe).clamp(-127, 127) * scale


@dataclass(frozen=True)
class Int8Baseline(Baseline):
    """Every token quantized as written: 8-bit codes plus a 16-bit scale per token and head."""

    def bits_per_element(self, head_dim: int) -> float:
        return 8.0 + 16.0 / head_dim

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return int8_roundtrip(k), int8_roundtrip(v)
