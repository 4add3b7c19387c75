"""Vector quantization of rotated, normalized key or value tiles with a fixed Gaussian codebook.

A research codec (issue 36; figures in docs/accuracy.md, "Below 3 bits"). One side (keys or
values) of ``N`` tiles ``[N, T, D]``:

1. rotate along ``D`` (Hadamard, as the reference codec does);
2. normalize two-sidedly, ``y = mu + s * f * z``: keys get a mean ``mu[D]`` and scale ``s[D]`` per
   channel and a factor ``f[T]`` per token; values a mean and scale per token and a factor per
   channel (the reference codec's parameter counts, so the same bytes);
3. replace each run of ``dim`` consecutive channels of ``z`` (one token) by the nearest of the
   ``2**(dim * bits)`` centroids of a codebook that k-means fits to standard normal samples.

The codebook depends on ``(dim, bits)`` only (a fixed seed), so it is part of the format, like
TurboQuant's Lloyd-Max levels, and costs no bytes per element. Stored per tile side: the codes
(``bits`` per number), scales and factors as log8 bytes and the mean as a signed byte in units of
a quarter of the scale (the reference codec's ``log8`` zero point), so the bits per element are
those of the reference codec's ``_s8`` layouts at the same bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvarn.codec.params import store_positive
from kvarn.codec.rotation import rotate, unrotate

CODEBOOK_SEED = 0x5636
_SAMPLES_PER_CENTROID = 32
_KMEANS_ITERS = 30
_NORM_ITERS = 3  # alternating scale / factor refinements
_ZP_UNITS = 4.0  # the mean is stored as a signed byte in units of scale / 4
_TINY = 1e-12


def _nearest(x: torch.Tensor, codebook: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Index ``[M]`` int64 of the nearest row of ``codebook`` ``[K, dim]`` to each row of ``x`` ``[M, dim]``."""
    half_norm = 0.5 * codebook.square().sum(dim=1)
    out = [(x[i : i + chunk] @ codebook.T - half_norm).argmax(dim=1) for i in range(0, x.shape[0], chunk)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


@functools.lru_cache(maxsize=8)
def gaussian_codebook(dim: int, bits: int) -> torch.Tensor:
    """The ``[2**(dim * bits), dim]`` float32 k-means codebook of ``N(0, I_dim)`` (deterministic).

    Raises:
        ValueError: more than 2**16 centroids (too large to search by brute force).
    """
    k = 1 << (dim * bits)
    if k > 1 << 16:
        raise ValueError(f"a {dim}-dim codebook at {bits} bits has {k} centroids; at most 65536 are supported")
    gen = torch.Generator().manual_seed(CODEBOOK_SEED + 97 * dim + bits)
    samples = torch.randn(k * _SAMPLES_PER_CENTROID, dim, generator=gen, dtype=torch.float64).float()
    centroids = samples[:k].clone()
    for _ in range(_KMEANS_ITERS):
        idx = _nearest(samples, centroids)
        sums = torch.zeros_like(centroids).index_add_(0, idx, samples)
        counts = torch.bincount(idx, minlength=k).float()
        centroids = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1.0)[:, None], centroids)
    return centroids


@functools.lru_cache(maxsize=8)
def unbiased_gain(dim: int, bits: int) -> float:
    """``E[x.x] / E[x.Q(x)]`` over the codebook's training distribution: scaling ``Q(x)`` by it
    makes the reconstruction unbiased along ``x`` (``E[g Q(x) . x] = E[x . x]``), undoing the
    centroids' shrinkage towards 0 at the cost of a little more squared error."""
    gen = torch.Generator().manual_seed(CODEBOOK_SEED - 1)
    x = torch.randn(1 << 16, dim, generator=gen)
    return float(x.square().sum() / (x * vq_round(x, dim, bits)).sum())


def vq_round(z: torch.Tensor, dim: int, bits: int, unbiased: bool = False) -> torch.Tensor:
    """Nearest codebook vector to each run of ``dim`` numbers along the last axis of ``z`` (float32);
    times :func:`unbiased_gain` with ``unbiased``."""
    if z.shape[-1] % dim:
        raise ValueError(f"the last axis ({z.shape[-1]}) must be a multiple of the vector length {dim}")
    codebook = gaussian_codebook(dim, bits).to(z.device)
    if unbiased:
        codebook = codebook * unbiased_gain(dim, bits)
    flat = z.reshape(-1, dim)
    return codebook[_nearest(flat, codebook)].reshape(z.shape)


def _log8(x: torch.Tensor) -> torch.Tensor:
    return store_positive(x.clamp_min(_TINY), "log8", round_up=False)[1].clamp_min(_TINY)


def normalize_two_sided(y: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``y`` ``[N, T, D]`` into ``(mean, scale, factor)`` as stored (log8 / zero-point bytes).

    ``per_channel`` (keys): mean and scale ``[N, 1, D]``, factor ``[N, T, 1]``; otherwise (values)
    mean and scale ``[N, T, 1]``, factor ``[N, 1, D]``. ``y ~ mean + scale * factor * z`` with ``z``
    of unit spread along both axes.
    """
    slice_axis, factor_axis = (1, 2) if per_channel else (2, 1)
    mean = y.mean(dim=slice_axis, keepdim=True)
    c = y - mean
    factor = torch.ones_like(c.mean(dim=factor_axis, keepdim=True))
    for _ in range(_NORM_ITERS):
        scale = (c / factor).square().mean(dim=slice_axis, keepdim=True).sqrt()
        factor = (c / scale.clamp_min(_TINY)).square().mean(dim=factor_axis, keepdim=True).sqrt()
        factor = factor / torch.exp(torch.log(factor.clamp_min(_TINY)).mean(dim=slice_axis, keepdim=True))
    scale = (c / factor).square().mean(dim=slice_axis, keepdim=True).sqrt()
    # the zero point is a signed byte in units of scale / 4: widen the scale when the mean needs it
    scale = _log8(torch.maximum(scale, mean.abs() * _ZP_UNITS / 127.0))
    factor = _log8(factor)
    mean = torch.round(mean * _ZP_UNITS / scale).clamp(-127, 127) * scale / _ZP_UNITS
    return mean, scale, factor


@dataclass(frozen=True)
class VQSide:
    """One side of a tile (keys: ``per_channel``) by vector quantization; see the module docstring."""

    bits: int = 2
    per_channel: bool = False
    dim: int = 4
    rotation: str = "hadamard"
    unbiased: bool = False  # decode with :func:`unbiased_gain`

    def bits_per_element(self, head_dim: int, tokens: int) -> float:
        """Codes plus one byte per scale, mean and factor (``2 x slices + factor axis`` bytes)."""
        slices, other = (head_dim, tokens) if self.per_channel else (tokens, head_dim)
        return self.bits + 8.0 * (2 * slices + other) / (tokens * head_dim)

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Quantize then dequantize tiles ``x`` ``[..., T, D]`` float32 (every leading index one tile)."""
        y = rotate(x, self.rotation).reshape(-1, *x.shape[-2:])
        mean, scale, factor = normalize_two_sided(y, self.per_channel)
        z = (y - mean) / (scale * factor)
        out = mean + scale * factor * vq_round(z, self.dim, self.bits, self.unbiased)
        return unrotate(out, self.rotation).reshape(x.shape)
