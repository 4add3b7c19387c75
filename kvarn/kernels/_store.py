# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT bodies: their arguments are pointers, tensors and tl.constexpr, typed by Triton itself)
"""Triton body of the store kernel: quantize and pack one side (keys or values) of full tiles.

One program encodes one tile of one KV head, ``x`` ``[T, D]``, exactly as
:func:`kvarn.codec.tiles._encode_side` does: rotation ``x @ R``, every Sinkhorn iterate 0..ITERS,
fp16 or log8 storage of factors, scales and zero points, ``floor(x + 0.5)`` rounding, the iterate
with the least squared error, then bit-plane packing (:mod:`kvarn.codec.pack`). The operations
follow the reference one for one (divisions stay divisions, no reciprocal, no fused multiply-add:
the launcher compiles with ``enable_fp_fusion=False``) so codes match it bit for bit wherever the
float32 reductions and ``exp``/``log`` round the same way.

Specialized on ``tl.constexpr``: bits, side, tile size, head_dim, iterations, scale storage,
rotation. Launchers live in :mod:`kvarn.kernels.ops`.
"""

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


@triton.jit
def _mean(x, AXIS: tl.constexpr, N: tl.constexpr):
    """float32 mean along AXIS, summed in float64 and rounded once."""
    return (tl.sum(x.to(tl.float64), axis=AXIS, keep_dims=True) / N).to(tl.float32)


@triton.jit
def _floored_log_std(y, AXIS: tl.constexpr, N: tl.constexpr, M: tl.constexpr, LIBDEVICE: tl.constexpr):
    """log(std + floor) along AXIS (N elements); floor = 1e-3 * mean std over the M slices.

    The variance is taken in float64 and rounded once, as torch's CPU ``std`` (a float64 Welford
    reduction) does; this is what makes the iterates match the reference bit for bit.
    """
    y64 = y.to(tl.float64)
    mean = tl.sum(y64, axis=AXIS, keep_dims=True) / N
    dev = y64 - mean
    std = tl.sqrt(tl.sum(dev * dev, axis=AXIS, keep_dims=True) / N).to(tl.float32)
    mean_std = (tl.sum(tl.sum(std.to(tl.float64), axis=1), axis=0) / M).to(tl.float32)
    return _log(std + (STD_FLOOR * mean_std + TINY), LIBDEVICE)


@triton.jit
def _write_plane(rec, codes, W: tl.constexpr, T: tl.constexpr, D: tl.constexpr):
    """Pack a W-bit plane of ``codes`` [T, D] int32 along D into T*D*W/8 bytes at ``rec``."""
    PER: tl.constexpr = 8 // W
    t = tl.arange(0, T)[:, None]
    i = tl.arange(0, D // PER)[None, :]
    if PER == 1:
        packed = codes
    else:
        grouped = tl.reshape(codes, (T, D // PER, PER))
        shifts = tl.arange(0, PER) * W
        packed = tl.sum(grouped << shifts[None, None, :], axis=2)
    tl.store(rec + t * (D // PER) + i, packed.to(tl.uint8))


@triton.jit
def _write_params(rec, raw, idx, PB: tl.constexpr):
    """Store params ``raw`` (int32 holding fp16 bits or one byte) at ``rec + PB * idx``."""
    if PB == 2:  # little-endian fp16
        tl.store(rec + 2 * idx, (raw & 0xFF).to(tl.uint8))
        tl.store(rec + 2 * idx + 1, ((raw >> 8) & 0xFF).to(tl.uint8))
    else:
        tl.store(rec + idx, (raw & 0xFF).to(tl.uint8))


@triton.jit
def store_side_kernel(
    x_ptr,  # [N, H, T, D] fp16/bf16/fp32, last axis contiguous
    stride_xn,
    stride_xh,
    stride_xt,
    rot_ptr,  # [D, D] float32 rotation R (rows of x are rotated as x @ R)
    lut_ptr,  # [256] float32 log8 byte -> value (the reference table)
    cache_ptr,  # [num_blocks, H, tile_bytes] uint8
    stride_cb,
    stride_ch,
    block_ptr,  # [N] int32/int64: destination block of tile n
    H,
    CODE_OFF: tl.constexpr,  # byte offsets of this side's sections inside a record
    SCALE_OFF: tl.constexpr,
    OFFSET_OFF: tl.constexpr,
    FACTOR_OFF: tl.constexpr,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,  # keys: scale per channel, factor per token; values: the reverse
    T: tl.constexpr,
    D: tl.constexpr,
    ITERS: tl.constexpr,
    LOG8: tl.constexpr,
    ROTATE: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # float64 exp/log from libdevice (CUDA); tl.math under the interpreter
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    t = tl.arange(0, T)[:, None]
    d = tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + n.to(tl.int64) * stride_xn + h * stride_xh + t * stride_xt + d).to(tl.float32)
    if ROTATE:
        r = tl.load(rot_ptr + tl.arange(0, D)[:, None] * D + d)
        x = tl.dot(x, r, input_precision="ieee")
    QMAX: tl.constexpr = (1 << BITS) - 1
    QAXIS: tl.constexpr = 0 if PER_CHANNEL else 1
    PB: tl.constexpr = 1 if LOG8 else 2
    base = tl.sqrt_rn(tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), MIN_MAGNITUDE))

    log_r = tl.zeros((T, 1), dtype=tl.float32)
    log_c = tl.zeros((1, D), dtype=tl.float32)
    best_codes = tl.zeros((T, D), dtype=tl.int32)
    if PER_CHANNEL:
        best_s = tl.zeros((1, D), dtype=tl.int32)
        best_o = tl.zeros((1, D), dtype=tl.int32)
        best_f = tl.zeros((T, 1), dtype=tl.int32)
    else:
        best_s = tl.zeros((T, 1), dtype=tl.int32)
        best_o = tl.zeros((T, 1), dtype=tl.int32)
        best_f = tl.zeros((1, D), dtype=tl.int32)
    best_err = tl.full((), float("inf"), tl.float32)
    for it in range(ITERS + 1):
        if it > 0:  # one column step and one row step, factors centred (geometric mean 1)
            y = x * _exp(-log_r - log_c, LIBDEVICE)
            log_c = log_c + _floored_log_std(y, 0, T, D, LIBDEVICE)
            log_c = log_c - _mean(log_c, 1, D)
            y = x * _exp(-log_r - log_c, LIBDEVICE)
            log_r = log_r + _floored_log_std(y, 1, D, T, LIBDEVICE)
            log_r = log_r - _mean(log_r, 0, T)
        if PER_CHANNEL:  # noqa: SIM108  (constexpr branches)
            fv = _exp(log_r, LIBDEVICE) * base
        else:
            fv = _exp(log_c, LIBDEVICE) * base
        if LOG8:
            f_raw, f = _log8_store(fv, lut_ptr, False, LIBDEVICE)
        else:
            f_raw, f = _fp16_store(fv, False)
        f = tl.maximum(f, 1e-30)
        y = x / f
        lo = tl.min(y, axis=QAXIS, keep_dims=True)
        hi = tl.max(y, axis=QAXIS, keep_dims=True)
        if LOG8:
            need = tl.maximum((hi - lo) / QMAX, tl.abs(lo) / 127.0)
            s_raw, s = _log8_store(need, lut_ptr, True, LIBDEVICE)
            safe = tl.where(s > 0, s, 1.0)
            z = tl.minimum(tl.maximum(tl.floor(lo / safe + 0.5), -128.0), 127.0)
            z = tl.where(s > 0, z, 0.0)
            codes = tl.where(s > 0, tl.floor(y / safe + 0.5) - z, 0.0)
            o = z * s
            o_raw = z.to(tl.int32) & 0xFF
        else:
            lo_h = tl.minimum(tl.maximum(lo, -FP16_MAX), FP16_MAX).to(tl.float16)
            o_bits = lo_h.to(tl.int16, bitcast=True).to(tl.int32)
            # a rounded-up lo would push the minimum below code 0: step one fp16 ulp towards -inf
            down = tl.where(o_bits == 0, -32767, tl.where(o_bits > 0, o_bits - 1, o_bits + 1))
            down = tl.where(o_bits == -32768, -32767, down)  # -0.0 steps to the smallest negative
            o_bits = tl.where(lo_h.to(tl.float32) > lo, down, o_bits)
            o = o_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            o_raw = o_bits & 0xFFFF
            s_raw, s = _fp16_store((hi - o) / QMAX, True)
            safe = tl.where(s > 0, s, 1.0)
            codes = tl.where(s > 0, tl.floor((y - o) / safe + 0.5), 0.0)
        codes = tl.minimum(tl.maximum(codes, 0.0), QMAX)
        diff = (codes * s + o) * f - x
        err = tl.sum(tl.sum((diff * diff).to(tl.float64), axis=1), axis=0).to(tl.float32)
        better = (err < best_err) | (it == 0)
        best_codes = tl.where(better, codes.to(tl.int32), best_codes)
        best_s = tl.where(better, s_raw, best_s)
        best_o = tl.where(better, o_raw, best_o)
        best_f = tl.where(better, f_raw, best_f)
        best_err = tl.where(better, err, best_err)

    blk = tl.load(block_ptr + n).to(tl.int64)
    rec = cache_ptr + blk * stride_cb + h.to(tl.int64) * stride_ch
    if BITS == 3:  # planes [2, 1]: low two bits, then the high bit
        _write_plane(rec + CODE_OFF, best_codes & 3, 2, T, D)
        _write_plane(rec + CODE_OFF + T * D // 4, (best_codes >> 2) & 1, 1, T, D)
    else:
        _write_plane(rec + CODE_OFF, best_codes, BITS, T, D)
    if PER_CHANNEL:
        _write_params(rec + SCALE_OFF, best_s, d, PB)
        _write_params(rec + OFFSET_OFF, best_o, d, PB)
        _write_params(rec + FACTOR_OFF, best_f, t, PB)
    else:
        _write_params(rec + SCALE_OFF, best_s, t, PB)
        _write_params(rec + OFFSET_OFF, best_o, t, PB)
        _write_params(rec + FACTOR_OFF, best_f, d, PB)
