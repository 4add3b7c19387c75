"""Number formats of vLLM 0.33's KV-cache dtypes, as pure-torch round trips (the emulation oracle).

Each function follows the store kernel of the vLLM dtype it names (see ``docs/accuracy.md``, section
"vLLM 0.33's KV dtypes", for which kernel and what is not emulated). Inputs are float32 ``[..., D]``
(one token and KV head per row); outputs are what a server reads back, float32, same shape.
"""

from __future__ import annotations

import functools
import math

import torch

E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 E2M1, index = 3 low bits of the code
UQ_GROUP = 32  # ultraquant: one UE8M0 scale per 32 numbers
UQ_C = 0.156  # ultraquant: scale = 2^round(log2(c * absmax))
UE8M0_BIAS = 127
NVFP4_BLOCK = 16  # nvfp4: one e4m3 scale per 16 numbers
RHT_SEED = 0x9E3779B9  # int4_per_token_head's sign vector seed (round 0)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (the kernels' ``x +- 0.5`` then truncating cast)."""
    return torch.where(x >= 0, torch.trunc(x + 0.5), torch.trunc(x - 0.5))


@functools.lru_cache(maxsize=8)
def sylvester(d: int) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard ``[d, d]`` float64 (``H @ H.T = d I``)."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def orthonormal_hadamard(d: int) -> torch.Tensor:
    """``H / sqrt(d)`` float32, rounded once from float64 (ultraquant's and TurboQuant's matrix)."""
    return (sylvester(d) / math.sqrt(d)).float()


# ---- per-token-head: int8, fp8, int4 ------------------------------------------------------------
def per_token_head_roundtrip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``int8_per_token_head`` / ``fp8_per_token_head``: one float32 scale ``max(amax / QMAX, 1e-6)``
    per row; int8 codes round half away from zero and clamp to [-128, 127]; fp8 codes are the e4m3
    cast of ``x * (1 / scale)`` clamped to +-448."""
    qmax = 127.0 if fmt == "int8" else E4M3_MAX
    scale = torch.clamp(x.abs().amax(-1, keepdim=True) / qmax, min=1e-6)
    q = x * (1.0 / scale)
    if fmt == "int8":
        q = torch.trunc(torch.clamp(torch.where(q >= 0, q + 0.5, q - 0.5), -128.0, 127.0))
    else:
        q = torch.clamp(q, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return q * scale


@functools.lru_cache(maxsize=8)
def rht_signs(d: int) -> torch.Tensor:
    """int4_per_token_head's deterministic +-1 signs ``[d]`` float32 (Bernoulli(0.5), fixed seed)."""
    gen = torch.Generator().manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def _rht_block(d: int) -> int:
    return d & -d  # the largest power-of-two divisor: the RHT is block-diagonal beyond it


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's single randomized Hadamard transform ``H D x`` (unnormalized); inverse: ``D H x``."""
    d = x.shape[-1]
    b = _rht_block(d)
    xb = x.reshape(*x.shape[:-1], d // b, b)
    h, s = sylvester(b).to(x.dtype), rht_signs(b).to(x.dtype)
    y = (xb @ h) * s if inverse else (xb * s) @ h  # H is symmetric
    return y.reshape(x.shape)


def int4_per_token_head_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """``int4_per_token_head``: RHT, then asymmetric 4-bit per row with a float32 scale whose low 4
    mantissa bits hold the zero point; read back in the rotated basis and un-rotated."""
    d = x.shape[-1]
    y = rht(x)
    lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    scale = torch.clamp((hi - lo) / 15.0, min=1e-6)
    zp = torch.clamp(round_half_away(-lo / scale), 0.0, 15.0)
    q = torch.clamp(round_half_away(y * (1.0 / scale) + zp), 0.0, 15.0)
    stored = (scale.view(torch.int32) & -16).view(torch.float32)  # the zero point's 4 bits cleared
    return rht((q - zp) * stored, inverse=True) / _rht_block(d)


# ---- FP4 E2M1 formats: nvfp4, ultraquant_4bit ----------------------------------------------------
def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 E2M1 value, ties to the even code, saturating at +-6."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=x.dtype, device=x.device)
    a = x.abs().clamp(max=6.0)
    mids = (mags[1:] + mags[:-1]) / 2
    i = torch.bucketize(a, mids)  # a == mid -> the lower neighbour
    tie_odd = (i < len(mids)) & (a == mids[i.clamp(max=len(mids) - 1)]) & (i % 2 == 1)  # odd code: 0.5, 1.5, 3
    i = torch.where(tie_odd, i + 1, i)
    return torch.copysign(mags[i], x)


def nvfp4_roundtrip(x: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """``nvfp4``: per 16 numbers an e4m3 scale of ``amax / 6 / global_scale``, E2M1 codes of
    ``x / (scale * global_scale)``; ``global_scale`` is the layer's k/v scale (1.0 uncalibrated)."""
    d = x.shape[-1]
    if d % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs head_dim divisible by {NVFP4_BLOCK}, got {d}")
    g = x.reshape(*x.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    s = (g.abs().amax(-1, keepdim=True) / (6.0 * global_scale)).clamp(max=E4M3_MAX)
    s = s.to(torch.float8_e4m3fn).float() * global_scale
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(s > 0, e2m1_round(g / safe) * s, torch.zeros_like(g)).reshape(x.shape)


# sorted FP4 level index (0..14 for -6..6) -> E2M1 bit pattern, and the pattern's value
_SORTED_TO_BITS = (15, 14, 13, 12, 11, 10, 9, 0, 1, 2, 3, 4, 5, 6, 7)
_BITS_TO_VALUE = (*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES))


def ultraquant_encode(x: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``ultraquant_4bit`` store: ``x`` ``[..., D]`` -> (codes ``[..., D/2]`` uint8, two E2M1
    nibbles a byte, low nibble first; scale bytes ``[..., D/32]`` uint8, UE8M0, 0 = zero group).
    Keys are rotated (``x @ H.T``, orthonormal Hadamard), values are not."""
    d = x.shape[-1]
    if d % UQ_GROUP:
        raise ValueError(f"ultraquant_4bit needs head_dim divisible by {UQ_GROUP}, got {d}")
    y = x.float() @ orthonormal_hadamard(d).to(x.device).T if rotate else x.float()
    g = y.reshape(*x.shape[:-1], d // UQ_GROUP, UQ_GROUP)
    s_raw = g.abs().amax(-1) * UQ_C
    zero = (s_raw <= 0) | ~torch.isfinite(s_raw)
    e = torch.floor(torch.log2(torch.where(zero, torch.ones_like(s_raw), s_raw)) + 0.5).to(torch.int32)
    e = e.clamp(-126, 127)
    scale_bytes = torch.where(zero, torch.zeros_like(e), e + UE8M0_BIAS).to(torch.uint8)
    s = torch.where(zero, torch.zeros_like(s_raw), torch.exp2(e.float()))[..., None]
    levels = torch.tensor(sorted(set(_BITS_TO_VALUE)), dtype=torch.float32, device=x.device)
    idx = torch.bucketize(g / torch.where(s == 0, torch.ones_like(s), s), (levels[1:] + levels[:-1]) / 2)
    idx = torch.where((s == 0).expand_as(idx), torch.full_like(idx, 7), idx)
    bits = torch.tensor(_SORTED_TO_BITS, dtype=torch.uint8, device=x.device)[idx].reshape(x.shape)
    codes = (bits[..., 0::2] & 0xF) | ((bits[..., 1::2] & 0xF) << 4)
    return codes.to(torch.uint8), scale_bytes


def ultraquant_decode(codes: torch.Tensor, scale_bytes: torch.Tensor, rotated: bool) -> torch.Tensor:
    """Read back :func:`ultraquant_encode`'s bytes as float32 ``[..., D]`` in the original basis."""
    d = 2 * codes.shape[-1]
    bits = torch.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], d).long()
    vals = torch.tensor(_BITS_TO_VALUE, dtype=torch.float32, device=codes.device)[bits]
    b = scale_bytes.to(torch.int32)
    s = torch.where(b == 0, torch.zeros_like(b, dtype=torch.float32), torch.exp2((b - UE8M0_BIAS).float()))
    y = (vals.reshape(*codes.shape[:-1], d // UQ_GROUP, UQ_GROUP) * s[..., None]).reshape(*codes.shape[:-1], d)
    return y @ orthonormal_hadamard(d).to(codes.device) if rotated else y


def ultraquant_roundtrip(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    return ultraquant_decode(*ultraquant_encode(x, rotate), rotated=rotate)
