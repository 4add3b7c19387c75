"""``turboquant3``, ``turboquant4``: TurboQuant-style quantization as vLLM deploys it.

Follows vLLM's TurboQuant KV-cache backend (presets ``turboquant_3bit_nc`` / ``turboquant_4bit_nc``):

* keys: the per-token norm is stored in fp16; the unit vector is rotated by the orthonormal
  Hadamard matrix and every coordinate is replaced by the nearest centroid of the Lloyd-Max
  codebook of ``N(0, 1/d)`` (``bits`` per coordinate); on read the centroid vector is re-normalized
  to unit length ("norm correction"), un-rotated and multiplied by the norm;
* values: not rotated; asymmetric uniform min/max per token with an fp16 scale and fp16 minimum;
* every token is quantized as it is written (no unquantized tail).

vLLM additionally leaves the first and last two layers unquantized ("boundary protection"); a
baseline is given no layer index, so here every layer is quantized (no unquantized boundary
layers).

Bytes per token and KV head: keys ``ceil(d*b/8) + 2`` (norm), values ``ceil(d*b/8) + 4`` (scale,
minimum): at ``head_dim`` 64, 3.375 (3-bit) and 4.375 (4-bit) bits per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline, minmax_roundtrip, to_fp16
from kvarn.baselines.lloydmax import lloyd_max_centroids, nearest_centroid
from kvarn.codec import rotate, unrotate

ROTATION = "hadamard"  # vLLM: plain Sylvester Hadamard, shared by all layers, no random signs


def turboquant_key_roundtrip(k: torch.Tensor, bits: int, norm_correction: bool = True) -> torch.Tensor:
    """Norm (fp16) + Hadamard + Lloyd-Max per coordinate; ``k`` ``[..., d]`` float32 -> float32."""
    d = k.shape[-1]
    norm = k.norm(dim=-1, keepdim=True)
    unit = rotate(k / (norm + 1e-8), ROTATION)
    centroids = lloyd_max_centroids(bits).to(k.device) / math.sqrt(d)
    y = centroids[nearest_centroid(unit, centroids)]
    if norm_correction:
        y = y / torch.sqrt((y * y).sum(dim=-1, keepdim=True) + 1e-16)
    return unrotate(y, ROTATION) * to_fp16(norm)


@dataclass(frozen=True)
class TurboQuantBaseline(Baseline):
    """TurboQuant at ``bits`` for keys (Lloyd-Max) and values (uniform)."""

    bits: int = 4
    norm_correction: bool = True

    def bits_per_element(self, head_dim: int) -> float:
        codes = math.ceil(head_dim * self.bits / 8)
        per_token_bytes = (codes + 2) + (codes + 4)  # keys + norm, values + scale + minimum
        return 8.0 * per_token_bytes / (2 * head_dim)

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return turboquant_key_roundtrip(k, self.bits, self.norm_correction), minmax_roundtrip(v, self.bits, dim=-1)
