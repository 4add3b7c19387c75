"""vLLM 0.33's TurboQuant presets (``turboquant_k8v4``, ``_4bit_nc``, ``_k3v4_nc``, ``_3bit_nc``).

Follows vLLM's store and decode kernels: keys either cast to fp8 e4m3 without a scale
(``k8v4``) or normalized (fp16 norm), rotated by the orthonormal Sylvester Hadamard and replaced by
the nearest of vLLM's Lloyd-Max centroids for ``N(0, 1/d)`` (solved as vLLM solves them, by
trapezoid integration), re-normalized on read for the ``_nc`` presets; values asymmetric uniform
per token with a float32 scale at quantization and fp16 scale and minimum stored. Page bytes per
token and head are vLLM's ``slot_size_aligned``. As deployed, the first and last two attention
layers stay 16-bit (``boundary_layers=2``); the ``_all_layers`` names quantize every layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline, to_fp16
from kvarn.baselines.vllm_formats import E4M3_MAX, orthonormal_hadamard

TQ_PRESETS: dict[str, tuple[int, int, bool]] = {  # name: key bits (8 = fp8), value bits, norm correction
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
TQ_BOUNDARY = 2  # vLLM's get_boundary_skip_layers(n=2)


@functools.lru_cache(maxsize=16)
def tq_centroids(d: int, bits: int) -> tuple[float, ...]:
    """vLLM's Lloyd-Max centroids for ``N(0, 1/d)``: 200 iterations at most, trapezoid integrals
    (200 intervals) over cells bounded by +-10.5 sigma, from evenly spaced starts on +-3.5 sigma."""
    n, var = 1 << bits, 1.0 / d
    sigma = math.sqrt(var)

    def pdf(x: float) -> float:
        return math.exp(-x * x / (2 * var)) / math.sqrt(2 * math.pi * var)

    def trapz(f: Callable[[float], float], a: float, b: float, steps: int = 200) -> float:
        h = (b - a) / steps
        total = 0.5 * (f(a) + f(b))
        for i in range(1, steps):  # summed in vLLM's order
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(200):
        edges = [lo * 3, *((c[i] + c[i + 1]) / 2 for i in range(n - 1)), hi * 3]
        new = []
        for i in range(n):
            den = trapz(pdf, edges[i], edges[i + 1])
            new.append(trapz(lambda x: x * pdf(x), edges[i], edges[i + 1]) / den if den > 1e-15 else c[i])
        if max(abs(a - b) for a, b in zip(new, c, strict=True)) < 1e-10:
            break
        c = new
    return tuple(float(x) for x in torch.tensor(c, dtype=torch.float32))


def tq_key_roundtrip(k: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    """TurboQuant keys ``[..., d]`` float32: fp8 cast (``bits == 8``) or norm + Hadamard + centroids."""
    if bits == 8:
        return k.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    d = k.shape[-1]
    h = orthonormal_hadamard(d).to(k.device)
    norm = k.norm(dim=-1, keepdim=True)
    y = (k / (norm + 1e-8)) @ h
    c = torch.tensor(tq_centroids(d, bits), dtype=torch.float32, device=k.device)
    q = c[torch.bucketize(y.contiguous(), (c[1:] + c[:-1]) / 2)]
    if norm_correction:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-16)
    return (q * to_fp16(norm)) @ h  # h is symmetric and orthonormal: its own inverse


def tq_value_roundtrip(v: torch.Tensor, bits: int) -> torch.Tensor:
    """TurboQuant values: per row ``scale = max((max - min) / (2^b - 1), 1e-8)`` in float32,
    ``code = floor((v - min) / scale + 0.5)``; read as ``code * fp16(scale) + fp16(min)``."""
    qmax = (1 << bits) - 1
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    q = torch.clamp(torch.trunc((v - lo) / scale + 0.5), 0, qmax)
    return q * to_fp16(scale) + to_fp16(lo)


@dataclass(frozen=True)
class VllmTurboQuantBaseline(Baseline):
    """One of vLLM 0.33's TurboQuant presets (:data:`TQ_PRESETS`); ``preset`` is vLLM's name."""

    preset: str = "turboquant_k8v4"

    def page_bytes(self, head_dim: int) -> int:
        """vLLM's ``slot_size_aligned``: bytes per token and KV head, keys and values together."""
        kb, vb, _ = TQ_PRESETS[self.preset]
        key = head_dim if kb == 8 else math.ceil(head_dim * kb / 8) + 2
        slot = key + math.ceil(head_dim * vb / 8) + 4
        return slot + slot % 2

    def bits_per_element(self, head_dim: int) -> float:
        return 8.0 * self.page_bytes(head_dim) / (2 * head_dim)

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb, nc = TQ_PRESETS[self.preset]
        return tq_key_roundtrip(k, kb, nc), tq_value_roundtrip(v, vb)
