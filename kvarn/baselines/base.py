"""The :class:`Baseline` interface and the uniform min/max quantizer several baselines share.

A baseline is a published KV-cache quantization method re-implemented as *fake quantization*:
``roundtrip`` returns what a server would read back after storing the tokens, in float. The cache
(:mod:`kvarn.hf`) calls it on the oldest ``commit_tokens`` tokens of its unquantized tail whenever
the tail holds at least ``window + commit_tokens`` tokens, so a method is measured the way it is
deployed: tokens are quantized when they are written, never all at once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP16_MAX = 65504.0


@dataclass(frozen=True)
class Baseline:
    """A baseline KV-cache quantization method (fake-quantized; see the module docstring).

    Attributes:
        name: registry name, e.g. ``"fp8"``, ``"kivi2"``, ``"rtn_k4v2"``.
        commit_tokens: tokens quantized together once written (1 = every token as it is written;
            KIVI: 32, one group; ``rtn_kXvY``: 128, one tile). ``roundtrip`` accepts any multiple.
        window: most recent tokens kept unquantized (KIVI: 128, others 0). Not counted in
            :meth:`bits_per_element`: a fixed ``window * 2 * head_dim * 16`` bits per layer and head.
        boundary_layers: the first and last this many attention layers stay 16-bit, as vLLM
            deploys TurboQuant (0: every layer quantized); see :meth:`quantizes_layer`.
    """

    name: str
    commit_tokens: int
    window: int
    boundary_layers: int = 0

    def quantizes_layer(self, layer: int, num_layers: int, hybrid: bool = False) -> bool:
        """Whether attention layer ``layer`` of ``num_layers`` is quantized (vLLM's boundary rule:
        ``n = min(boundary_layers, num_layers // 2)`` layers at each end; none on hybrid models)."""
        n = 0 if hybrid else min(self.boundary_layers, num_layers // 2)
        return n <= layer < num_layers - n

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per cached number (keys and values), scales and zero points included."""
        raise NotImplementedError

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize then dequantize committed tokens.

        Args:
            k: keys ``[batch, kv_heads, tokens, head_dim]`` (float32; fp16/bf16 accepted), where
                ``tokens`` is a multiple of :attr:`commit_tokens`.
            v: values, same shape as ``k``.
            state: per-layer dict the cache keeps between calls (e.g. the fp8 per-tensor scale).

        Returns:
            ``(k, v)`` after the round trip, same shape and dtype as the input.
        """
        self.check(k, v)
        kq, vq = self._roundtrip(k.float(), v.float(), state)
        return kq.to(k.dtype), vq.to(v.dtype)

    def _roundtrip(
        self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the problem if ``k``/``v`` cannot be committed."""
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"{self.name}: keys and values must both be [batch, kv_heads, tokens, head_dim]; "
                f"got {list(k.shape)} and {list(v.shape)}"
            )
        if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
            raise ValueError(f"{self.name}: keys/values must be floating point, got {k.dtype} and {v.dtype}")
        tokens = k.shape[2]
        if tokens == 0 or tokens % self.commit_tokens:
            raise ValueError(
                f"{self.name}: {tokens} tokens committed at once; must be a positive multiple of "
                f"commit_tokens={self.commit_tokens}"
            )


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to the float16 value it would be stored as (saturating), back in float32."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()


def minmax_roundtrip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric uniform quantization with an fp16 scale and fp16 minimum per slice along ``dim``.

    ``scale = (max - min) / (2**bits - 1)``, ``code = round((x - min) / scale)`` clamped to the code
    range; decodes as ``code * scale + min``. This is KIVI's quantizer and TurboQuant's value
    quantizer (both store scale and minimum in fp16).

    Args:
        x: float32 tensor of any shape.
        bits: code width.
        dim: the axis each (scale, minimum) pair covers.

    Returns:
        Dequantized float32 tensor, same shape as ``x``.
    """
    qmax = (1 << bits) - 1
    lo = to_fp16(x.amin(dim=dim, keepdim=True))
    scale = to_fp16((x.amax(dim=dim, keepdim=True) - lo) / qmax)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - lo) / safe).clamp(0, qmax)
    return torch.where(scale > 0, codes * scale + lo, lo)
