"""``kivi2``, ``kivi4``: KIVI (Liu et al., 2024), keys per channel and values per token.

As in KIVI's reference implementation: keys are quantized per channel over groups of 32 tokens
(one fp16 scale and one fp16 minimum per channel and group); values per token over groups of 32
channels; asymmetric min/max round-to-nearest; the 128 most recent tokens stay in fp16. The
reference quantizes a key group when its residual fills and a value token as it leaves the window;
here both are committed a group of 32 at a time once more than 128 tokens wait, so exactly the
128 newest tokens are unquantized at every step (the cache's ``window`` / ``commit_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline, minmax_roundtrip

KIVI_GROUP = 32
KIVI_WINDOW = 128


@dataclass(frozen=True)
class KIVIBaseline(Baseline):
    """KIVI at ``bits`` for keys and values, group 32, window 128."""

    bits: int = 2
    group: int = KIVI_GROUP

    def bits_per_element(self, head_dim: int) -> float:
        # keys: fp16 scale + fp16 min per channel per 32 tokens; values: the same per token per
        # 32 channels -> 32 bits of parameters per 32 numbers on both sides
        return self.bits + 32.0 / self.group

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = k.shape
        if d % self.group:
            raise ValueError(f"{self.name}: head_dim={d} must be a multiple of the group size {self.group}")
        kq = minmax_roundtrip(k.reshape(b, h, t // self.group, self.group, d), self.bits, dim=3)
        vq = minmax_roundtrip(v.reshape(b, h, t, d // self.group, self.group), self.bits, dim=4)
        return kq.reshape(b, h, t, d), vq.reshape(b, h, t, d)
