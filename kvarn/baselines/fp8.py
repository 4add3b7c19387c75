"""``fp8``: float8 e4m3 with one scale per tensor, as vLLM's default fp8 KV cache.

vLLM (``--kv-cache-dtype fp8``) stores ``x / scale`` as e4m3 with a float32 scale per layer for
keys and one for values. Without a calibrated checkpoint the scale is 1.0; with
``calculate_kv_scales`` it is set once from the first batch as ``amax / 448`` and then kept. We
implement the second (the better of the two on models whose activations are far from 448): the
scale of each layer is fixed on the first commit, stored in ``state``, and reused for every later
token; values beyond the range saturate to +-448 (vLLM's saturating cast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline

E4M3_MAX = 448.0


def fp8_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` float32 -> e4m3 of ``x / scale`` (saturating) -> float32 times ``scale``."""
    y = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return y.float() * scale


@dataclass(frozen=True)
class FP8Baseline(Baseline):
    """Per-tensor-scaled e4m3; state keys ``"k_scale"`` and ``"v_scale"`` (floats)."""

    def bits_per_element(self, head_dim: int) -> float:
        # two float32 scales per layer, amortized over the whole cache: 0 bits per element
        return 8.0

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        for key, x in (("k_scale", k), ("v_scale", v)):
            if key not in state:
                amax = float(x.abs().amax())
                state[key] = amax / E4M3_MAX if amax > 0 else 1.0
        return fp8_roundtrip(k, state["k_scale"]), fp8_roundtrip(v, state["v_scale"])
