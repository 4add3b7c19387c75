# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton numerics of the store kernel: fp16 and log8 storage of positive parameters and ``exp``/``log``
through float64."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# module constants read inside @triton.jit must be tl.constexpr: the compiler refuses plain globals
FP16_MAX = tl.constexpr(65504.0)
LOG8_STEPS = tl.constexpr(8.0)
LOG8_BIAS = tl.constexpr(160.0)
LOG8_MIN = tl.constexpr(2.0**-19.875)  # 2 ** ((1 - LOG8_BIAS) / LOG8_STEPS)
MIN_MAGNITUDE = tl.constexpr(2.0**-14)
STD_FLOOR = tl.constexpr(1e-3)
TINY = tl.constexpr(1e-30)


@triton.jit
def _fp16_store(x, ROUND_UP: tl.constexpr):
    """float32 >= 0 -> (raw fp16 bits as int32, the float32 value they decode to)."""
    h = tl.minimum(tl.maximum(x, 0.0), FP16_MAX).to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    if ROUND_UP:  # never store a scale smaller than asked: step one fp16 ulp up
        bump = (h.to(tl.float32) < x) & (h.to(tl.float32) < FP16_MAX)
        bits = tl.where(bump, bits + 1, bits)
        h = (bits.to(tl.int16)).to(tl.float16, bitcast=True)
    return bits & 0xFFFF, h.to(tl.float32)


@triton.jit
def _log8_store(x, lut_ptr, ROUND_UP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """float32 >= 0 -> (log8 byte as int32, its float32 value read from the reference table)."""
    e = _log2(tl.maximum(x, LOG8_MIN), LIBDEVICE) * LOG8_STEPS
    if ROUND_UP:  # noqa: SIM108  (constexpr branches)
        e = tl.ceil(e - 1e-4)
    else:
        e = tl.floor(e + 0.5)
    c = tl.minimum(tl.maximum(e + LOG8_BIAS, 1.0), 255.0)
    c = tl.where(x > 0, c, 0.0).to(tl.int32)
    return c, tl.load(lut_ptr + c)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """float32 exp through float64: correctly rounded, like the reference on CPU far more often than fp32 exp.

    On CUDA the float64 functions come from libdevice; the interpreter has no extern calls.
    """
    if LIBDEVICE:
        return libdevice.exp(x.to(tl.float64)).to(tl.float32)
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """float32 log through float64 (correctly rounded)."""
    if LIBDEVICE:
        return libdevice.log(x.to(tl.float64)).to(tl.float32)
    return tl.log(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _log2(x, LIBDEVICE: tl.constexpr):
    """float32 log2 through float64 (correctly rounded)."""
    if LIBDEVICE:
        return libdevice.log2(x.to(tl.float64)).to(tl.float32)
    return tl.log2(x.to(tl.float64)).to(tl.float32)
