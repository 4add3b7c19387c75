"""``rtn_kXvY``: plain round-to-nearest in kvarn's own tile layout, no rotation, no normalization.

Runs the kvarn reference codec with ``Scheme(kb, vb, 128, rotation="none", norm_iters=0)``: keys
per channel and values per token over 128-token tiles, fp16 scales and zero points. This isolates
what rotation and normalization add on top of the same bytes' tile format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline
from kvarn.codec import dequantize_tiles, quantize_tiles
from kvarn.schemes import Scheme

RTN_TILE = 128


@dataclass(frozen=True)
class RTNBaseline(Baseline):
    """RTN at ``key_bits``/``value_bits`` through the reference codec, one 128-token tile per commit."""

    key_bits: int = 4
    value_bits: int = 2

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.key_bits, self.value_bits, RTN_TILE, rotation="none", norm_iters=0)

    def bits_per_element(self, head_dim: int) -> float:
        return self.scheme.bits_per_element(head_dim)

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = k.shape
        tiles = (b * h * t // RTN_TILE, RTN_TILE, d)
        scheme = self.scheme
        records = quantize_tiles(k.reshape(tiles), v.reshape(tiles), scheme)
        kq, vq = dequantize_tiles(records, scheme, d)
        return kq.reshape(b, h, t, d), vq.reshape(b, h, t, d)
