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

The tile is never held in registers whole (a ``[128, 128]`` float32 tile is 64 KiB). The rotated tile goes once into the program's row of
a float32 workspace; every pass then streams it in row chunks ``[ROWS, D]`` (reductions over
tokens) or column chunks ``[T, COLS]`` (reductions over channels), and per-token or per-channel
vectors that a chunk needs a slice of are kept in small workspace slots. The best iterate's codes
are recomputed from its parameters at the end rather than carried through the loop.

Specialized on ``tl.constexpr``: bits, side, tile size, head_dim, iterations, scale storage,
rotation, chunk sizes. Launchers live in :mod:`kvarn.kernels.triton.ops`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.triton._numerics import (
    FP16_MAX,
    MIN_MAGNITUDE,
    STD_FLOOR,
    TINY,
    _exp,
    _fp16_store,
    _log,
    _log8_store,
)


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
def _codes(y, s, q, QMAX: tl.constexpr, LOG8: tl.constexpr):
    """Codes of ``y = x / factor`` for scales ``s`` and zero points ``q`` (fp16 minimum, or log8 integer z)."""
    safe = tl.where(s > 0, s, 1.0)
    if LOG8:
        codes = tl.where(s > 0, tl.floor(y / safe + 0.5) - q, 0.0)
    else:
        codes = tl.where(s > 0, tl.floor((y - q) / safe + 0.5), 0.0)
    return tl.minimum(tl.maximum(codes, 0.0), QMAX)


@triton.jit
def _chunk(ws, i, BY_ROWS: tl.constexpr, T: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Chunk ``i`` of the rotated tile in the workspace: rows ``[ROWS, D]`` or columns ``[T, COLS]`` float32."""
    if BY_ROWS:
        x = tl.load(ws + (i * ROWS + tl.arange(0, ROWS))[:, None] * D + tl.arange(0, D)[None, :])
    else:
        x = tl.load(ws + tl.arange(0, T)[:, None] * D + (i * COLS + tl.arange(0, COLS))[None, :])
    return x


@triton.jit
def _slice(slot, i, BY_ROWS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The part of a per-token ([ROWS, 1]) or per-channel ([1, COLS]) vector kept at ``slot`` for chunk ``i``."""
    if BY_ROWS:
        v = tl.load(slot + (i * ROWS + tl.arange(0, ROWS))[:, None])
    else:
        v = tl.load(slot + (i * COLS + tl.arange(0, COLS))[None, :])
    return v


@triton.jit
def _rotate_into(
    x, stride_xt, rot_ptr, ws, T: tl.constexpr, D: tl.constexpr, RR: tl.constexpr, RC: tl.constexpr,
    RK: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """Write ``x @ R`` ([T, D] float32) into the workspace; returns max |x @ R|.

    In ``[RR, RC]`` output blocks summed over ``RK`` input channels at a time: an fp32 ``tl.dot``
    (FMA, not tensor cores) holds its whole K extent per thread, so a K of 128 spilled on sm_90.
    """
    amax = tl.zeros((1, 1), tl.float32)
    d = tl.arange(0, D)
    for i in range(T // RR):
        r = i * RR + tl.arange(0, RR)[:, None]
        if ROTATE:
            k = tl.arange(0, RK)
            for j in tl.static_range(D // RC):
                c = j * RC + tl.arange(0, RC)[None, :]
                xa = tl.load(x + r * stride_xt + k[None, :]).to(tl.float32)
                xr = tl.dot(xa, tl.load(rot_ptr + k[:, None] * D + c), input_precision="ieee")
                for kb in tl.static_range(1, D // RK):
                    xa = tl.load(x + r * stride_xt + kb * RK + k[None, :]).to(tl.float32)
                    xr = tl.dot(xa, tl.load(rot_ptr + (kb * RK + k)[:, None] * D + c), xr, input_precision="ieee")
                tl.store(ws + r * D + c, xr)
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(xr), axis=1, keep_dims=True), axis=0, keep_dims=True))
        else:
            xc = tl.load(x + r * stride_xt + d[None, :]).to(tl.float32)
            tl.store(ws + r * D + d[None, :], xc)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(xc), axis=1, keep_dims=True), axis=0, keep_dims=True))
    return tl.sum(tl.sum(amax, axis=1), axis=0)


@triton.jit
def _full(slot, PER_TOKEN: tl.constexpr, T: tl.constexpr, D: tl.constexpr):
    """A whole vector kept at ``slot``, shaped to broadcast over a chunk: ``[T, 1]`` or ``[1, D]``."""
    if PER_TOKEN:  # noqa: SIM108  (constexpr branches)
        v = tl.load(slot + tl.arange(0, T)[:, None])
    else:
        v = tl.load(slot + tl.arange(0, D)[None, :])
    return v


@triton.jit
def _put(slot, v, PER_TOKEN: tl.constexpr, T: tl.constexpr, D: tl.constexpr):
    """Keep a chunk-shaped vector ``v`` (``[T, 1]`` or ``[1, D]``) at ``slot`` for the whole program."""
    tl.debug_barrier()  # nobody still reads the previous contents
    if PER_TOKEN:
        tl.store(slot + tl.arange(0, T)[:, None], v)
    else:
        tl.store(slot + tl.arange(0, D)[None, :], v)
    tl.debug_barrier()  # visible to every thread


@triton.jit
def _put1(slot, v, N: tl.constexpr):
    """Keep a flat ``[N]`` vector at ``slot`` for the whole program."""
    tl.debug_barrier()
    tl.store(slot + tl.arange(0, N), v)
    tl.debug_barrier()


@triton.jit
def _std(
    ws, sliced, whole, out, BY_ROWS: tl.constexpr, T: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    COLS: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    """Std of ``y = x * exp(-log_r - log_c)`` into slot ``out``, streamed in chunks.

    ``BY_ROWS``: per channel over tokens (``[1, D]``; log_r sliced per chunk, log_c whole); else
    per token over channels (``[T, 1]``; log_c sliced, log_r whole). Sums run in float64 and the
    std is rounded once, as torch's CPU ``std`` (a float64 reduction) does; this is what makes the
    iterates match the reference bit for bit.
    """
    AXIS: tl.constexpr = 0 if BY_ROWS else 1
    N: tl.constexpr = T if BY_ROWS else D
    STEPS: tl.constexpr = T // ROWS if BY_ROWS else D // COLS
    other = _full(whole, not BY_ROWS, T, D)
    if BY_ROWS:  # noqa: SIM108  (constexpr branches)
        acc = tl.zeros((1, D), tl.float64)
    else:
        acc = tl.zeros((T, 1), tl.float64)
    for i in range(STEPS):
        y = _chunk(ws, i, BY_ROWS, T, D, ROWS, COLS) * _exp(-_slice(sliced, i, BY_ROWS, ROWS, COLS) - other, LIBDEVICE)
        acc += tl.sum(y.to(tl.float64), axis=AXIS, keep_dims=True)
    mean = acc / N
    acc = acc * 0.0
    for i in range(STEPS):
        y = _chunk(ws, i, BY_ROWS, T, D, ROWS, COLS) * _exp(-_slice(sliced, i, BY_ROWS, ROWS, COLS) - other, LIBDEVICE)
        dev = y.to(tl.float64) - mean
        acc += tl.sum(dev * dev, axis=AXIS, keep_dims=True)
    _put(out, tl.sqrt(acc / N).to(tl.float32), not BY_ROWS, T, D)


@triton.jit
def _log_step(log_slot, std_slot, N: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``log += log(std + floor)`` (floor: 1e-3 x the mean std), then centred: geometric mean 1."""
    std = tl.load(std_slot + tl.arange(0, N))
    mean_std = (tl.sum(std.to(tl.float64), axis=0) / N).to(tl.float32)
    v = tl.load(log_slot + tl.arange(0, N)) + _log(std + (STD_FLOOR * mean_std + TINY), LIBDEVICE)
    _put1(log_slot, v - (tl.sum(v.to(tl.float64), axis=0) / N).to(tl.float32), N)


@triton.jit
def _lo_hi(
    ws, f_slot, lo_slot, hi_slot, PER_CHANNEL: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Min and max of ``x / f`` along the quantization axis (per channel or per token) into two slots."""
    STEPS: tl.constexpr = T // ROWS if PER_CHANNEL else D // COLS
    if PER_CHANNEL:  # noqa: SIM108  (constexpr branches)
        lo = tl.full((1, D), float("inf"), tl.float32)
    else:
        lo = tl.full((T, 1), float("inf"), tl.float32)
    hi = -lo
    for i in range(STEPS):
        y = _chunk(ws, i, PER_CHANNEL, T, D, ROWS, COLS) / _slice(f_slot, i, PER_CHANNEL, ROWS, COLS)
        lo = tl.minimum(lo, tl.min(y, axis=1 - PER_CHANNEL, keep_dims=True))
        hi = tl.maximum(hi, tl.max(y, axis=1 - PER_CHANNEL, keep_dims=True))
    _put(lo_slot, lo, not PER_CHANNEL, T, D)
    _put(hi_slot, hi, not PER_CHANNEL, T, D)


@triton.jit
def _sq_err(
    ws, f_slot, s_slot, q_slot, QMAX: tl.constexpr, PER_CHANNEL: tl.constexpr, LOG8: tl.constexpr,
    T: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Squared error of the tile decoded with the factors, scales and zero points in the slots."""
    STEPS: tl.constexpr = T // ROWS if PER_CHANNEL else D // COLS
    s = _full(s_slot, not PER_CHANNEL, T, D)
    q = _full(q_slot, not PER_CHANNEL, T, D)
    o = q * s if LOG8 else q  # log8 zero points are integers z: offset z * s
    acc = tl.zeros((1, 1), tl.float64)
    for i in range(STEPS):
        x = _chunk(ws, i, PER_CHANNEL, T, D, ROWS, COLS)
        f = _slice(f_slot, i, PER_CHANNEL, ROWS, COLS)
        diff = (_codes(x / f, s, q, QMAX, LOG8) * s + o) * f - x
        acc += tl.sum(tl.sum((diff * diff).to(tl.float64), axis=1, keep_dims=True), axis=0, keep_dims=True)
    return tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32)


@triton.jit
def _params(lo, hi, lut_ptr, QMAX: tl.constexpr, LOG8: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Scales and zero points from the range: (s, q, s_raw, o_raw); q is the fp16 offset or log8's integer z."""
    if LOG8:
        need = tl.maximum((hi - lo) / QMAX, tl.abs(lo) / 127.0)
        s_raw, s = _log8_store(need, lut_ptr, True, LIBDEVICE)
        safe = tl.where(s > 0, s, 1.0)
        q = tl.minimum(tl.maximum(tl.floor(lo / safe + 0.5), -128.0), 127.0)
        q = tl.where(s > 0, q, 0.0)
        o_raw = q.to(tl.int32) & 0xFF
    else:
        lo_h = tl.minimum(tl.maximum(lo, -FP16_MAX), FP16_MAX).to(tl.float16)
        o_bits = lo_h.to(tl.int16, bitcast=True).to(tl.int32)
        # a rounded-up lo would push the minimum below code 0: step one fp16 ulp towards -inf
        down = tl.where(o_bits == 0, -32767, tl.where(o_bits > 0, o_bits - 1, o_bits + 1))
        down = tl.where(o_bits == -32768, -32767, down)  # -0.0 steps to the smallest negative
        o_bits = tl.where(lo_h.to(tl.float32) > lo, down, o_bits)
        q = o_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        o_raw = o_bits & 0xFFFF
        s_raw, s = _fp16_store((hi - q) / QMAX, True)
    return s, q, s_raw, o_raw


@triton.jit(do_not_specialize=["H"])  # one kernel for every head count: H == 1 is not a variant of its own
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
    work_ptr,  # [N * H, T * D + 10 * (T + D)] float32 workspace, one row per program
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
    LIBDEVICE: tl.constexpr,  # float64 exp/log from libdevice (compiled); tl.math under the interpreter
    ROWS: tl.constexpr,  # tokens per row chunk
    COLS: tl.constexpr,  # channels per column chunk
    RR: tl.constexpr,  # tokens per block of the rotation (>= 16 when compiled: a tl.dot operand)
    RC: tl.constexpr,  # output channels per block of the rotation
    RK: tl.constexpr,  # input channels summed per tl.dot of the rotation
):
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    ws = work_ptr + pid.to(tl.int64) * (T * D + 10 * (T + D))  # the rotated tile [T, D], then 10 slots
    L: tl.constexpr = T + D  # slot size
    LOG_R = ws + T * D  # [T] log row factors
    LOG_C = LOG_R + L  # [D] log column factors
    F = LOG_C + L  # factors of the current iterate (per token for keys, per channel for values)
    LO = F + L  # range, then scales and zero points of the current iterate (along the quantization axis)
    HI = LO + L
    S = HI + L
    Q = S + L
    BEST_F = Q + L  # the best iterate's factors, scales and zero points
    BEST_S = BEST_F + L
    BEST_Q = BEST_S + L
    FN: tl.constexpr = T if PER_CHANNEL else D  # factor length
    SN: tl.constexpr = D if PER_CHANNEL else T  # scale and zero point length
    QMAX: tl.constexpr = (1 << BITS) - 1
    PB: tl.constexpr = 1 if LOG8 else 2
    x_in = x_ptr + n.to(tl.int64) * stride_xn + h * stride_xh
    base = tl.sqrt_rn(tl.maximum(_rotate_into(x_in, stride_xt, rot_ptr, ws, T, D, RR, RC, RK, ROTATE), MIN_MAGNITUDE))
    _put1(LOG_R, tl.zeros((T,), tl.float32), T)  # iterate 0: no normalization (its barrier also
    _put1(LOG_C, tl.zeros((D,), tl.float32), D)  # publishes the rotated tile)
    blk = tl.load(block_ptr + n).to(tl.int64)
    rec = cache_ptr + blk * stride_cb + h.to(tl.int64) * stride_ch
    best_err = tl.full((), float("inf"), tl.float32)
    for it in range(ITERS + 1):
        if it > 0:  # one column step and one row step
            _std(ws, LOG_R, LOG_C, LO, True, T, D, ROWS, COLS, LIBDEVICE)
            _log_step(LOG_C, LO, D, LIBDEVICE)
            _std(ws, LOG_C, LOG_R, LO, False, T, D, ROWS, COLS, LIBDEVICE)
            _log_step(LOG_R, LO, T, LIBDEVICE)
        fv = _exp(tl.load((LOG_R if PER_CHANNEL else LOG_C) + tl.arange(0, FN)), LIBDEVICE) * base
        if LOG8:
            f_raw, f = _log8_store(fv, lut_ptr, False, LIBDEVICE)
        else:
            f_raw, f = _fp16_store(fv, False)
        f = tl.maximum(f, 1e-30)
        _put1(F, f, FN)
        _lo_hi(ws, F, LO, HI, PER_CHANNEL, T, D, ROWS, COLS)
        s, q, s_raw, o_raw = _params(
            tl.load(LO + tl.arange(0, SN)), tl.load(HI + tl.arange(0, SN)), lut_ptr, QMAX, LOG8, LIBDEVICE
        )
        _put1(S, s, SN)
        _put1(Q, q, SN)
        err = _sq_err(ws, F, S, Q, QMAX, PER_CHANNEL, LOG8, T, D, ROWS, COLS)
        if (err < best_err) | (it == 0):  # the raw parameters go straight into the record
            best_err = err
            _write_params(rec + SCALE_OFF, s_raw, tl.arange(0, SN), PB)
            _write_params(rec + OFFSET_OFF, o_raw, tl.arange(0, SN), PB)
            _write_params(rec + FACTOR_OFF, f_raw, tl.arange(0, FN), PB)
            _put1(BEST_F, f, FN)
            _put1(BEST_S, s, SN)
            _put1(BEST_Q, q, SN)

    # the codes of the best iterate, recomputed from its parameters (same operations, same codes)
    for i in range(T // ROWS):
        x = _chunk(ws, i, True, T, D, ROWS, COLS)
        if PER_CHANNEL:
            f = _slice(BEST_F, i, True, ROWS, COLS)
            codes = _codes(x / f, _full(BEST_S, False, T, D), _full(BEST_Q, False, T, D), QMAX, LOG8)
        else:
            s_i = _slice(BEST_S, i, True, ROWS, COLS)
            codes = _codes(x / _full(BEST_F, False, T, D), s_i, _slice(BEST_Q, i, True, ROWS, COLS), QMAX, LOG8)
        codes = codes.to(tl.int32)
        if BITS == 3:  # planes [2, 1]: low two bits, then the high bit
            _write_plane(rec + CODE_OFF + i * ROWS * D // 4, codes & 3, 2, ROWS, D)
            _write_plane(rec + CODE_OFF + T * D // 4 + i * ROWS * D // 8, (codes >> 2) & 1, 1, ROWS, D)
        else:
            _write_plane(rec + CODE_OFF + i * ROWS * D * BITS // 8, codes, BITS, ROWS, D)
