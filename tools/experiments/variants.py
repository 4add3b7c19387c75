"""Codec variants for accuracy experiments: a copy of the reference ``_encode_side`` with knobs.

Nothing here changes ``kvarn.codec``; every variant returns the round trip (dequantized keys and
values) so :mod:`tools.experiments.decode_eval` can measure it in decode mode. With the default
knobs :func:`variant_roundtrip` equals the reference codec exactly (checked in ``__main__``).

Knobs:
    refit: after the codes of an iterate are chosen, re-fit the stored continuous parameters with
        the codes fixed (least squares), then round them to fp16 like the codec stores them:
        ``"none"``, ``"factor"`` (the per-token key factor / per-channel value factor),
        ``"affine"`` (the per-slice scale and zero point), ``"both"`` (affine, then factor).
    select: how the best normalization iterate is chosen: ``"mse"`` (reference), ``"last"``.
    levels: where the codes sit in each quantized slice (same bytes: two fp16 numbers and the codes):
        ``"uniform"`` (reference: min-max affine, ``code * scale + lo``), ``"gauss"`` (Lloyd-Max
        levels of a unit Gaussian around the slice's mean, times its standard deviation: the
        MSE-optimal codebook for rotated, near-Gaussian data, which shrinks values by ~11%),
        ``"gauss_unbiased"`` (the same codes, levels divided by 1 - the Lloyd-Max MSE, so that
        E[x * x_hat] = E[x^2]: no systematic shrinkage, still ~35% less MSE than min-max at 2 bits).
    clip: ratios tried per quantized slice (e.g. ``(1.0, 0.95, 0.9, 0.85, 0.8)``): the slice's min-max
        range shrunk about its centre, the ratio with the least squared error kept (same bytes).
    diffuse: error diffusion along tokens (values only, uniform levels): token ``t`` is rounded as
        ``y[t] + diffuse * e[t-1]`` where ``e[t-1]`` is the previous token's rounding error (same
        bytes, same decoder). With 1.0 the errors of consecutive tokens telescope, so a sum over
        tokens with smooth attention weights nearly cancels them; a weight peaked on one token sees
        up to twice the error variance.
    compand: exponent ``p`` of companded levels (same bytes: min-max fp16 scale and minimum as the
        reference): code ``c`` of a slice sits at ``lo + (hi - lo) * (1 + sign(u) |u|^p) / 2`` with
        ``u = 2c / qmax - 1``, so the extremes stay exact and, for ``p > 1``, the inner levels move
        towards the middle where near-Gaussian data is dense (1.0: uniform, the reference).
    group: values only: quantize each token in groups of ``group`` channels, each with a log8 scale
        (rounded up) and a signed-byte zero point in sixteenths of that scale (16 bits per group:
        two groups of 32 cost what one fp16 scale and minimum per 64-channel token cost now).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvarn.codec.normalize import sinkhorn_iterates
from kvarn.codec.params import quantize_affine, store_positive
from kvarn.codec.rotation import rotate, unrotate
from kvarn.schemes import Scheme, get_scheme

_MIN_MAGNITUDE = 2.0**-14
# Lloyd-Max quantizer of N(0, 1): reconstruction levels and 1 - its MSE (= E[x * x_hat])
_GAUSS_LEVELS = {
    2: (-1.5104, -0.4528, 0.4528, 1.5104),
    3: (-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519),
}
_GAUSS_GAIN = {2: 1 - 0.1175, 3: 1 - 0.03454}


def _gauss_round(y: torch.Tensor, bits: int, dim: int, unbiased: bool) -> torch.Tensor:
    """Round trip of ``y`` with per-slice (mean, std) stored as fp16 and Lloyd-Max codes."""
    if bits not in _GAUSS_LEVELS:
        raise ValueError(f"levels='gauss' needs bits in {sorted(_GAUSS_LEVELS)}, got {bits}")
    mu = _fp16(y.mean(dim, keepdim=True))
    sd = _fp16(y.std(dim, keepdim=True, unbiased=False)).clamp_min(_MIN_MAGNITUDE)
    lv = torch.tensor(_GAUSS_LEVELS[bits])
    codes = ((y - mu) / sd).unsqueeze(-1).sub(lv).abs().argmin(-1)
    rec = lv[codes] / (_GAUSS_GAIN[bits] if unbiased else 1.0)
    return mu + sd * rec


def _diffused_round(y: torch.Tensor, bits: int, scale_dtype: str, diffuse: float) -> torch.Tensor:
    """Per-token affine rounding of ``y`` ``[N, T, D]`` with the previous token's error carried in."""
    out = torch.empty_like(y)
    carry = torch.zeros_like(y[:, :1])
    for t in range(y.shape[1]):
        yt = y[:, t : t + 1] + diffuse * carry
        codes, _, _, s, o = quantize_affine(yt, bits, 2, scale_dtype)
        out[:, t : t + 1] = codes.float() * s + o
        carry = yt - out[:, t : t + 1]
    return out


def _clip_search_round(
    y: torch.Tensor, f: torch.Tensor, bits: int, dim: int, ratios: tuple[float, ...]
) -> torch.Tensor:
    """Affine rounding of ``y`` with the range of each slice along ``dim`` shrunk about its centre by
    the ratio (from ``ratios``) whose round trip has the least squared error in ``x = y * f`` units.
    Scale and minimum stored as fp16 (the minimum stepped down, the scale rounded up, as the codec)."""
    qmax = (1 << bits) - 1
    lo, hi = y.amin(dim, keepdim=True), y.amax(dim, keepdim=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best, best_err = y, torch.full_like(lo, float("inf"))
    for r in ratios:
        lo_r = _fp16(mid - r * half)
        scale = _fp16(((mid + r * half) - lo_r) / qmax).clamp_min(1e-30)
        rec = torch.floor((y - lo_r) / scale + 0.5).clamp(0, qmax) * scale + lo_r
        err = ((rec - y) * f).square().sum(dim, keepdim=True)
        better = err < best_err
        best = torch.where(better, rec, best)
        best_err = torch.where(better, err, best_err)
    return best


def _companded_round(y: torch.Tensor, bits: int, dim: int, p: float) -> torch.Tensor:
    """Round trip of ``y`` with per-slice min-max (fp16, like the codec) and companded levels."""
    qmax = (1 << bits) - 1
    lo, hi = _fp16(y.amin(dim, keepdim=True)), _fp16(y.amax(dim, keepdim=True))
    lo = torch.where(lo > y.amin(dim, keepdim=True), lo - lo.abs() * 2.0**-10, lo)  # cover the minimum
    hi = torch.where(hi < y.amax(dim, keepdim=True), hi + hi.abs() * 2.0**-10, hi)
    u = torch.arange(qmax + 1, dtype=torch.float32) * 2 / qmax - 1
    lv = (1 + torch.sign(u) * u.abs() ** p) / 2  # [qmax + 1] in [0, 1]
    span = (hi - lo).clamp_min(1e-30)
    codes = ((y - lo) / span).unsqueeze(-1).sub(lv).abs().argmin(-1)
    return lo + span * lv[codes]


def _group_log8_round(y: torch.Tensor, bits: int, group: int, sub: int = 16) -> torch.Tensor:
    """Per-token rounding of ``y`` ``[N, T, D]`` in groups of ``group`` channels, log8 scale, zero in 1/sub scales."""
    n, t, d = y.shape
    g = y.reshape(n, t, d // group, group)
    qmax = (1 << bits) - 1
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)

    def log8_up(x: torch.Tensor) -> torch.Tensor:
        return torch.exp2(torch.ceil(torch.log2(x.clamp_min(2.0**-19)) * 8 - 1e-4) / 8)

    s = log8_up((hi - lo) / qmax)
    for _ in range(2):  # the floored zero point may uncover the top: widen the scale once or twice
        o = torch.floor(lo / (s / sub)).clamp(-128, 127) * s / sub
        s = torch.maximum(s, log8_up((hi - o) / qmax))
    o = torch.floor(lo / (s / sub)).clamp(-128, 127) * s / sub
    rec = torch.floor((g - o) / s + 0.5).clamp(0, qmax) * s + o
    return rec.reshape(n, t, d)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504.0, 65504.0).to(torch.float16).float()


def _refit_affine(
    x: torch.Tensor, codes: torch.Tensor, f: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares (scale, offset, ok) per slice along ``dim`` of ``x ~ (codes*s + o) * f``, codes fixed.

    ``ok`` is False where the fit is degenerate (all codes equal) or gives a non-positive scale;
    callers keep the min/max parameters there.
    """
    q = codes.float() * f
    w = f
    # minimize sum (x - s*q - o*w)^2 over s, o per slice
    sqq, sqw, sww = (q * q).sum(dim, keepdim=True), (q * w).sum(dim, keepdim=True), (w * w).sum(dim, keepdim=True)
    sxq, sxw = (x * q).sum(dim, keepdim=True), (x * w).sum(dim, keepdim=True)
    det = sqq * sww - sqw * sqw
    ok = det.abs() > 1e-12 * (sqq * sww).clamp_min(1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    s, o = (sxq * sww - sxw * sqw) / safe, (sxw * sqq - sxq * sqw) / safe
    return s, o, ok & (s > 0)


def _refit_factor(x: torch.Tensor, y: torch.Tensor, fdim: int, bias_weight: float) -> torch.Tensor:
    """Factor per slice (reduced over ``fdim``) minimizing ``|x - f y|^2 + bias_weight * (sum(x - f y))^2``."""
    sxy, syy = (x * y).sum(fdim, keepdim=True), (y * y).sum(fdim, keepdim=True)
    sx, sy = x.sum(fdim, keepdim=True), y.sum(fdim, keepdim=True)
    num, den = sxy + bias_weight * sx * sy, syy + bias_weight * sy * sy
    return torch.where(den > 1e-30, num / den.clamp_min(1e-30), torch.ones_like(den))


def encode_side(
    x: torch.Tensor,
    bits: int,
    per_channel: bool,
    scheme: Scheme,
    refit: str = "none",
    select: str = "mse",
    bias_weight: float = 0.0,
    weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
    levels: str = "uniform",
    diffuse: float = 0.0,
    clip: tuple[float, ...] = (),
    compand: float = 1.0,
    group: int = 0,
) -> torch.Tensor:
    """Round trip of rotated tiles ``x`` ``[N, T, D]`` float32 -> dequantized ``[N, T, D]`` (rotated)."""
    quant_dim = 1 if per_channel else 2
    fdim = 2 if per_channel else 1  # the factor of keys is per token (reduce over channels)
    base = torch.sqrt(x.abs().amax(dim=(1, 2), keepdim=True).clamp_min(_MIN_MAGNITUDE))
    best = torch.zeros_like(x)
    best_err = torch.full((x.shape[0],), float("inf"))
    w = weight(x) if weight is not None else torch.ones_like(x)
    iterates = list(sinkhorn_iterates(x, scheme.norm_iters))
    for it, (log_r, log_c) in enumerate(iterates):
        log_f = log_r if per_channel else log_c
        _, f = store_positive(torch.exp(log_f) * base, scheme.scale_dtype, round_up=False)
        f = f.clamp_min(1e-30)
        if compand != 1.0:
            y = _companded_round(x / f, bits, quant_dim, compand)
        elif group and not per_channel:
            y = _group_log8_round(x / f, bits, group)
        elif levels != "uniform":
            y = _gauss_round(x / f, bits, quant_dim, unbiased=levels == "gauss_unbiased")
        elif diffuse and not per_channel:
            y = _diffused_round(x / f, bits, scheme.scale_dtype, diffuse)
        elif clip:
            y = _clip_search_round(x / f, f.expand_as(x), bits, quant_dim, clip)
        else:
            codes, _, _, s, o = quantize_affine(x / f, bits, quant_dim, scheme.scale_dtype)
            if refit in ("affine", "both"):
                s2, o2, ok = _refit_affine(x, codes, f.expand_as(x), quant_dim)
                s, o = torch.where(ok, _fp16(s2), s), torch.where(ok, _fp16(o2), o)
            y = codes.float() * s + o
        if refit in ("factor", "both"):
            f = _fp16(_refit_factor(x, y, fdim, bias_weight))
        xh = y * f
        err = ((xh - x).square() * w).sum(dim=(1, 2))
        if select == "last":
            err = torch.full_like(err, -float(it))
        better = err < best_err
        best = torch.where(better[:, None, None], xh, best)
        best_err = torch.minimum(err, best_err)
    return best


def variant_roundtrip(
    name: str, **knobs: object
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Keys/values ``[N, T, D]`` -> round trip through the variant of scheme ``name``."""
    scheme = get_scheme(name)
    kk = {k[2:]: v for k, v in knobs.items() if k.startswith("k_")}
    vk = {k[2:]: v for k, v in knobs.items() if k.startswith("v_")}
    both = {k: v for k, v in knobs.items() if not k.startswith(("k_", "v_"))}

    def rt(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kr = encode_side(rotate(k, scheme.rotation), scheme.key_bits, True, scheme, **{**both, **kk})  # type: ignore[arg-type]
        vr = encode_side(rotate(v, scheme.rotation), scheme.value_bits, False, scheme, **{**both, **vk})  # type: ignore[arg-type]
        return unrotate(kr, scheme.rotation), unrotate(vr, scheme.rotation)

    return rt


if __name__ == "__main__":
    from tools.experiments.decode_eval import scheme_roundtrip

    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 128, 64, generator=g) * torch.rand(1, 1, 64, generator=g) * 5
    k[:, 0] *= 20
    v = torch.randn(6, 128, 64, generator=g)
    for name in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g128_it0"):
        a, b = scheme_roundtrip(name)(k, v), variant_roundtrip(name)(k, v)
        assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5), name
        for refit in ("factor", "affine", "both"):
            c = variant_roundtrip(name, refit=refit)(k, v)
            e0 = [float((x - y).square().mean()) for x, y in zip((k, v), b, strict=True)]
            e1 = [float((x - y).square().mean()) for x, y in zip((k, v), c, strict=True)]
            print(name, refit, f"mse keys {e0[0]:.4g} -> {e1[0]:.4g}, values {e0[1]:.4g} -> {e1[1]:.4g}")
        if name == "kvarn_k4v2_g128":
            for lv in ("gauss", "gauss_unbiased"):
                c = variant_roundtrip(name, v_levels=lv)(k, v)
                e0v, e1v = float((v - b[1]).square().mean()), float((v - c[1]).square().mean())
                slope = float((v * c[1]).sum() / (v * v).sum())
                print(name, f"v_levels={lv}: value mse {e0v:.4g} -> {e1v:.4g}, E[v v_hat]/E[v^2] {slope:.3f}")
    print("variants match the reference codec")
