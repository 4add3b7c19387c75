"""Low-rank keys: a per-layer, per-head PCA basis and a bit width per basis direction.

A research codec (issue 36; figures in docs/accuracy.md, "Below 3 bits"). Keys of one KV head are
expressed in the eigenbasis of their within-tile covariance, measured once per model on a
calibration text (:func:`fit_basis`), and each coordinate gets its own bit width: a greedy
reverse water-filling gives the next bit to the coordinate whose expected squared error
(``variance * 4**-bits``) is largest, until ``bits_per_token`` code bits are spent. A coordinate
with 0 bits decodes to the middle of its tile's range; the others are rounded to nearest, asymmetric min/max over
the tile's tokens with a log8 scale and a signed-byte zero point (the reference codec's ``log8``
storage), so the stored bits per key are ``bits_per_token / D + 16 / T``.

The basis (``H x D x D`` numbers per layer) is a per-model constant like the model's weights; it
is not counted per element (docs/accuracy.md gives its size beside the figures).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvarn.codec.params import quantize_affine

MAX_BITS = 8


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (it holds tensors)
class KeyBasis:
    """One layer's basis: ``vectors`` ``[H, D, D]`` (columns, largest variance first), ``variance`` ``[H, D]``."""

    vectors: torch.Tensor
    variance: torch.Tensor


def fit_basis(keys: torch.Tensor, tile: int) -> KeyBasis:
    """PCA of keys ``[H, n, D]`` (one layer) after removing each ``tile``-token tile's mean.

    Raises:
        ValueError: fewer than one tile of keys.
    """
    h, n, d = keys.shape
    n = n // tile * tile
    if n == 0:
        raise ValueError(f"fitting a key basis needs at least one tile ({tile} tokens), got {keys.shape[1]}")
    x = keys[:, :n].double().reshape(h, n // tile, tile, d)
    x = (x - x.mean(dim=2, keepdim=True)).reshape(h, n, d)
    cov = x.transpose(1, 2) @ x / n
    var, vec = torch.linalg.eigh(cov)  # ascending
    return KeyBasis(vec.flip(-1).float().contiguous(), var.flip(-1).clamp_min(0).float().contiguous())


@functools.lru_cache(maxsize=256)
def basis_bits(basis: KeyBasis, bits_per_token: int) -> torch.Tensor:
    """:func:`allocate_bits` of ``basis.variance``, computed once per basis and budget."""
    return allocate_bits(basis.variance, bits_per_token)


def allocate_bits(variance: torch.Tensor, bits_per_token: int, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Integer bits ``[..., D]`` summing to ``bits_per_token`` along the last axis (greedy water-filling)."""
    flat = variance.reshape(-1, variance.shape[-1]).double()
    out = torch.zeros_like(flat, dtype=torch.int64)
    for row, var in zip(out, flat, strict=True):
        err = var.clone()
        for _ in range(min(bits_per_token, max_bits * var.numel())):
            i = int(torch.where(row < max_bits, err, torch.full_like(err, -1.0)).argmax())
            row[i] += 1
            err[i] /= 4.0
    return out.reshape(variance.shape)


@dataclass(frozen=True)
class LowRankKeys:
    """Keys in a per-layer PCA basis with per-coordinate bit widths; see the module docstring.

    Attributes:
        bases: one :class:`KeyBasis` per attention layer (index = the layer's position among them).
        bits_per_token: code bits per key vector (per token and head), spread over the coordinates.
    """

    bases: tuple[KeyBasis, ...] = field(repr=False)
    bits_per_token: int = 192

    def bits_per_element(self, head_dim: int, tokens: int) -> float:
        """Codes plus a log8 scale and a zero-point byte per coordinate and tile."""
        return self.bits_per_token / head_dim + 16.0 / tokens

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Quantize then dequantize keys ``[B, H, T, D]`` float32 of attention layer ``layer``."""
        if layer is None or not 0 <= layer < len(self.bases):
            raise ValueError(f"low-rank keys need the attention layer index (0..{len(self.bases) - 1}), got {layer}")
        basis = self.bases[layer]
        vec = basis.vectors.to(x.device)
        bits = basis_bits(basis, self.bits_per_token)
        y = torch.einsum("bhtd,hde->bhte", x.float(), vec)
        out = torch.zeros_like(y)
        for b in sorted(set(bits.flatten().tolist())):
            mask = (bits == b)[None, :, None, :].expand_as(y)
            sel = torch.where(mask, y, torch.zeros_like(y))
            # each coordinate over the tile's tokens; coordinates of other widths are zeros here.
            # 0 bits: no codes, the coordinate decodes to the middle of its stored range
            codes, _, _, scale, offset = quantize_affine(sel, max(b, 1), dim=2, scale_dtype="log8")
            dec = codes.float() * scale + offset if b else (offset + 0.5 * scale).expand_as(y)
            out = torch.where(mask, dec, out)
        return torch.einsum("bhte,hde->bhtd", out, vec)
