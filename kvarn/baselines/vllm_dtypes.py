"""vLLM 0.33's per-token KV dtypes as baselines: ``int8_per_token_head``, ``fp8_per_token_head``,
``int4_per_token_head``, ``nvfp4``, ``ultraquant_4bit`` (TurboQuant: :mod:`kvarn.baselines.turboquant_vllm`).

Every token is quantized as it is written (``commit_tokens=1``). Bits per element are vLLM's page
bytes per token and KV head (the backends' ``customize_spec``) over ``2 * head_dim`` numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.baselines.base import Baseline
from kvarn.baselines.vllm_formats import (
    NVFP4_BLOCK,
    UQ_GROUP,
    int4_per_token_head_roundtrip,
    nvfp4_roundtrip,
    per_token_head_roundtrip,
    ultraquant_roundtrip,
)

FORMATS = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4", "ultraquant_4bit")


@dataclass(frozen=True)
class VllmDtypeBaseline(Baseline):
    """One of vLLM 0.33's KV dtypes (:data:`FORMATS`), named as vLLM names it."""

    dtype: str = "int8_per_token_head"

    def page_bytes(self, head_dim: int) -> int:
        """Bytes per token and KV head in vLLM's page (keys and values, scales included)."""
        if self.dtype in ("int8_per_token_head", "fp8_per_token_head"):
            return 2 * head_dim + 2 * 4  # 1 byte a number, a float32 scale per side
        if self.dtype == "int4_per_token_head":
            return head_dim + 2 * 4  # two nibbles a byte, a float32 scale (zero point inside) per side
        if self.dtype == "nvfp4":
            return 2 * (head_dim // 2 + head_dim // NVFP4_BLOCK)  # nvfp4_kv_cache_full_dim per side
        return 2 * (head_dim // 2 + head_dim // UQ_GROUP)  # ultraquant slot_size

    def bits_per_element(self, head_dim: int) -> float:
        return 8.0 * self.page_bytes(head_dim) / (2 * head_dim)

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dtype == "int4_per_token_head":
            return int4_per_token_head_roundtrip(k), int4_per_token_head_roundtrip(v)
        if self.dtype == "nvfp4":
            return nvfp4_roundtrip(k), nvfp4_roundtrip(v)
        if self.dtype == "ultraquant_4bit":
            return ultraquant_roundtrip(k, rotate=True), ultraquant_roundtrip(v, rotate=False)
        fmt = self.dtype.split("_", 1)[0]
        return per_token_head_roundtrip(k, fmt), per_token_head_roundtrip(v, fmt)
