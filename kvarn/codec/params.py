"""How scales, zero points and normalization factors are stored: fp16, or 8-bit log-domain.

``fp16``: scale, minimum (``lo``) and factor are float16 values; a number decodes as
``code * scale + lo``.

``log8`` (one byte each): a positive scale or factor is ``2 ** ((c - LOG8_BIAS) / LOG8_STEPS)`` for
a byte ``c`` in 1..255 (``c = 0`` means 0); the zero point is a signed byte ``z`` and a number decodes
as ``(code + z) * scale``. Scales round *up* in the log domain (the range stays covered, at most
``2**(1/8) - 1 = 9%`` coarser); factors round to nearest (they are applied exactly as stored).
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0
LOG8_STEPS = 8  # codes per octave
LOG8_BIAS = 160  # byte 160 is 1.0; bytes 1..255 span 2**-19.9 .. 2**11.9
_LOG8_MIN_EXP = (1 - LOG8_BIAS) / LOG8_STEPS


def _log8_code(x: torch.Tensor, round_up: bool) -> torch.Tensor:
    e = torch.log2(x.clamp_min(2.0**_LOG8_MIN_EXP)) * LOG8_STEPS
    e = torch.ceil(e - 1e-4) if round_up else torch.floor(e + 0.5)
    c = (e + LOG8_BIAS).clamp(1, 255)
    return torch.where(x > 0, c, torch.zeros_like(c)).to(torch.uint8)


def _log8_value(c: torch.Tensor) -> torch.Tensor:
    v = torch.exp2((c.float() - LOG8_BIAS) / LOG8_STEPS)
    return torch.where(c > 0, v, torch.zeros_like(v))


def store_positive(x: torch.Tensor, scale_dtype: str, round_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Round a non-negative float32 tensor (scales, factors) to its storage.

    Returns ``(stored_bytes_source, value)``: the tensor to serialize (float16 or uint8 codes) and
    the float32 value it decodes to, which is what encoding must use.
    """
    if scale_dtype == "fp16":
        h = x.clamp(0.0, FP16_MAX).to(torch.float16)
        if round_up:  # keep the range covered: never store a scale smaller than asked
            bumped = torch.nextafter(h, torch.full_like(h, float("inf")))
            h = torch.where((h.float() < x) & (h < FP16_MAX), bumped, h)
        return h, h.float()
    c = _log8_code(x, round_up)
    return c, _log8_value(c)


def load_positive(raw: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Decode stored scales or factors (float16 or uint8 log codes) to float32."""
    return raw.float() if scale_dtype == "fp16" else _log8_value(raw)


def quantize_affine(
    y: torch.Tensor, bits: int, dim: int, scale_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of float32 ``y`` with one (scale, offset) per slice along ``dim``.

    Returns ``(codes uint8, scale_raw, offset_raw, scale, offset)`` where ``*_raw`` are the stored
    forms and ``scale``/``offset`` (float32, ``dim`` kept as size 1) give ``y ~ codes * scale + offset``.
    Rounding is ``floor(x + 0.5)`` so kernels can reproduce it exactly.
    """
    qmax = (1 << bits) - 1
    lo = y.amin(dim=dim, keepdim=True)
    hi = y.amax(dim=dim, keepdim=True)
    if scale_dtype == "fp16":
        lo_raw = lo.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        offset = lo_raw.float()
        # a rounded-up lo would push the minimum below code 0; step it down instead
        step_down = torch.nextafter(lo_raw, torch.full_like(lo_raw, float("-inf")))
        lo_raw = torch.where(offset > lo, step_down, lo_raw)
        offset = lo_raw.float()
        scale_raw, scale = store_positive((hi - offset) / qmax, "fp16", round_up=True)
        codes = torch.where(scale > 0, torch.floor((y - offset) / scale + 0.5), torch.zeros_like(y))
        codes = codes.clamp(0, qmax).to(torch.uint8)
        return codes, scale_raw, lo_raw, scale, offset
    # log8: integer zero point z in [-128, 127]; y ~ (code + z) * scale
    # scale >= range/qmax keeps every code in [0, qmax] with z = round(lo/scale); scale >= |lo|/127
    # keeps z in a signed byte (a channel far from zero trades resolution, it never clips)
    need = torch.maximum((hi - lo) / qmax, lo.abs() / 127.0)
    scale_raw, scale = store_positive(need, "log8", round_up=True)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = torch.floor(lo / safe + 0.5).clamp(-128, 127)
    z = torch.where(scale > 0, z, torch.zeros_like(z))
    codes = torch.where(scale > 0, torch.floor(y / safe + 0.5) - z, torch.zeros_like(y))
    codes = codes.clamp(0, qmax).to(torch.uint8)
    return codes, scale_raw, z.to(torch.int8), scale, z * scale


def load_offset(raw: torch.Tensor, scale: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Decode stored zero points: fp16 minimum, or int8 zero point times the decoded scale."""
    return raw.float() if scale_dtype == "fp16" else raw.float() * scale


def stored_dtypes(scale_dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """How params are serialized: ``(scales and factors, offsets)`` as float16, or log8 bytes and int8 zero points."""
    return (torch.float16, torch.float16) if scale_dtype == "fp16" else (torch.uint8, torch.int8)


def read_params(records: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` params per record stored as ``dtype`` from byte ``start`` of ``[N, bytes]`` uint8 records."""
    return records[:, start : start + count * dtype.itemsize].contiguous().view(dtype)
