"""Research codecs below 3 bits (issue 36), as baselines the harness measures beside the presets.

Each is fake-quantized one 128-token tile at a time, as a kvarn tile is stored, and keeps the
sequence's first token exact as every built-in preset does (``exact_tokens``; its 16-bit copy costs
``16 x exact_tokens / context`` bits per element, which :meth:`Baseline.bits_per_element` leaves
out exactly as :meth:`kvarn.schemes.Scheme.bits_per_element` does without ``context``).

* :class:`SplitBaseline`: keys and values each by their own side codec (:class:`KvarnSide`, the
  reference codec's one side; :class:`ExactSide`; :class:`kvarn.research.vq.VQSide`;
  :class:`kvarn.research.lowrank.LowRankKeys`). Also how the error of a preset splits between keys and
  values (one side exact).
* :class:`DenseSparseBaseline`: the reference codec at low bits over tiles whose largest
  outliers were taken out, the outliers kept as float16 with their positions.

Figures and commands: docs/accuracy.md, "Below 3 bits".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvarn.baselines.base import Baseline, to_fp16
from kvarn.codec import dequantize_tiles, quantize_tiles
from kvarn.codec.rotation import rotate, unrotate
from kvarn.research.metric import LayerMetric, apply
from kvarn.research.vq import VQSide
from kvarn.schemes import Scheme

TILE = 128


class SideCodec(Protocol):
    """Keys or values of one tile: ``roundtrip`` of ``[B, H, T, D]`` float32 and its stored bits."""

    def bits_per_element(self, head_dim: int, tokens: int) -> float: ...

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor: ...


def _codec(scheme: Scheme, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference codec's round trip of ``[B, H, T, D]`` keys and values (one tile per head)."""
    b, h, t, d = k.shape
    kt, vt = k.reshape(-1, t, d), v.reshape(-1, t, d)
    rec = quantize_tiles(kt, vt, scheme)
    kq, vq = dequantize_tiles(rec, scheme, d)
    return kq.reshape(b, h, t, d), vq.reshape(b, h, t, d)


@dataclass(frozen=True)
class KvarnSide:
    """One side of the reference codec (keys when ``per_channel``) at ``bits``, log8 params by default."""

    bits: int = 2
    per_channel: bool = False
    scale_dtype: str = "log8"
    group: int = TILE

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.bits, self.bits, self.group, scale_dtype=self.scale_dtype, sink_tokens=0)  # type: ignore[arg-type]

    def bits_per_element(self, head_dim: int, tokens: int) -> float:
        s = self.scheme
        params = s.key_param_bytes(head_dim) if self.per_channel else s.value_param_bytes(head_dim)
        return self.bits + 8.0 * params / (tokens * head_dim)

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        kq, vq = _codec(self.scheme, x, x)
        return kq if self.per_channel else vq


@dataclass(frozen=True)
class ExactSide:
    """Not quantized (16 bits): for splitting a preset's error between keys and values."""

    def bits_per_element(self, head_dim: int, tokens: int) -> float:
        return 16.0

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class RotatedSparseSide:
    """``inner`` after ``outliers`` entries of each tile, farthest from their slice's mean in the
    Hadamard-rotated domain (where the reference codec rounds), were taken out and kept as float16
    with their positions (``16 + log2(T x D)`` bits each)."""

    inner: KvarnSide | VQSide = KvarnSide(2)
    outliers: int = 0

    def bits_per_element(self, head_dim: int, tokens: int) -> float:
        per_outlier = 16 + math.ceil(math.log2(tokens * head_dim))
        return self.inner.bits_per_element(head_dim, tokens) + self.outliers * per_outlier / (tokens * head_dim)

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        b, h, t, d = x.shape
        y = rotate(x, "hadamard").reshape(-1, t, d)
        mask = _outlier_mask(y, self.outliers, self.inner.per_channel)
        axis = 1 if self.inner.per_channel else 2
        filled = torch.where(mask, y.mean(dim=axis, keepdim=True).expand_as(y), y)
        dec = rotate(self.inner.roundtrip(unrotate(filled, "hadamard").reshape(x.shape), layer), "hadamard")
        out = torch.where(mask, to_fp16(y), dec.reshape(y.shape))
        return unrotate(out, "hadamard").reshape(x.shape)


@dataclass(frozen=True)
class MetricSide:
    """``inner`` applied to ``x A`` of the layer's :class:`kvarn.research.metric.LayerMetric`, mapped back
    with ``A^-1``: the same bytes as ``inner``, the squared error weighted by the metric."""

    inner: SideCodec = ExactSide()
    metrics: tuple[LayerMetric, ...] = field(default=(), repr=False)

    def bits_per_element(self, head_dim: int, tokens: int) -> float:
        return self.inner.bits_per_element(head_dim, tokens)

    def roundtrip(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        if layer is None or not 0 <= layer < len(self.metrics):
            raise ValueError(f"a metric side needs the attention layer index (0..{len(self.metrics) - 1}), got {layer}")
        m = self.metrics[layer]
        return apply(self.inner.roundtrip(apply(x, m.transform), layer), m.inverse)


def _keep_exact(
    kq: torch.Tensor, vq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any], n: int
) -> None:
    """Put the sequence's first ``n`` tokens back exactly, on the layer's first commit only."""
    if n and not state.get("exact_done"):
        kq[:, :, :n], vq[:, :, :n] = k[:, :, :n], v[:, :, :n]
    state["exact_done"] = True


@dataclass(frozen=True)
class SplitBaseline(Baseline):
    """Keys by ``keys``, values by ``values``, one tile at a time; the first ``exact_tokens`` exact.

    ``state["layer"]`` (the attention layer's index) is passed to the side codecs that need it.
    """

    keys: SideCodec = ExactSide()
    values: SideCodec = ExactSide()
    exact_tokens: int = 1

    def bits_per_element(self, head_dim: int) -> float:
        t = self.commit_tokens
        return 0.5 * (self.keys.bits_per_element(head_dim, t) + self.values.bits_per_element(head_dim, t))

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        layer, t = state.get("layer"), self.commit_tokens
        kq = torch.cat([self.keys.roundtrip(k[:, :, i : i + t], layer) for i in range(0, k.shape[2], t)], dim=2)
        vq = torch.cat([self.values.roundtrip(v[:, :, i : i + t], layer) for i in range(0, v.shape[2], t)], dim=2)
        _keep_exact(kq, vq, k, v, state, self.exact_tokens)
        return kq, vq


def _outlier_mask(x: torch.Tensor, count: int, per_channel: bool) -> torch.Tensor:
    """The ``count`` entries of each tile ``[N, T, D]`` farthest from their slice's mean, in slice stds."""
    axis = 1 if per_channel else 2
    z = (x - x.mean(dim=axis, keepdim=True)).abs() / x.std(dim=axis, keepdim=True).clamp_min(1e-12)
    flat = z.flatten(1)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    if count:
        mask.scatter_(1, flat.topk(count, dim=1).indices, True)
    return mask.view_as(x)


@dataclass(frozen=True)
class DenseSparseBaseline(Baseline):
    """Dense-and-sparse: ``key_outliers`` / ``value_outliers`` entries per tile kept as float16.

    Outliers are the entries farthest from their quantization slice's mean (a key channel, a value
    token) in units of its standard deviation, before any rotation. The rest of the tile (outliers
    replaced by that mean, so they no longer stretch a range) goes through the reference codec with
    ``scheme``. Each outlier costs 16 bits plus its position (``ceil(log2(T x D))`` bits).
    """

    scheme: Scheme = Scheme(2, 2, TILE, rotation="none", scale_dtype="log8", sink_tokens=0)
    key_outliers: int = 0
    value_outliers: int = 0
    exact_tokens: int = 1

    def bits_per_element(self, head_dim: int) -> float:
        t = self.scheme.group_size
        per_outlier = 16 + math.ceil(math.log2(t * head_dim))
        sparse = (self.key_outliers + self.value_outliers) * per_outlier / (2.0 * t * head_dim)
        return self.scheme.bits_per_element(head_dim) + sparse

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, s, d = k.shape
        t = self.scheme.group_size
        kt, vt = k.reshape(-1, t, d), v.reshape(-1, t, d)
        km, vm = _outlier_mask(kt, self.key_outliers, True), _outlier_mask(vt, self.value_outliers, False)
        kf = torch.where(km, kt.mean(dim=1, keepdim=True).expand_as(kt), kt)
        vf = torch.where(vm, vt.mean(dim=2, keepdim=True).expand_as(vt), vt)
        rec = quantize_tiles(kf, vf, self.scheme)
        kd, vd = dequantize_tiles(rec, self.scheme, d)
        kq = torch.where(km, to_fp16(kt), kd).reshape(b, h, s, d)
        vq = torch.where(vm, to_fp16(vt), vd).reshape(b, h, s, d)
        _keep_exact(kq, vq, k, v, state, self.exact_tokens)
        return kq, vq


@dataclass(frozen=True)
class OutlierTokensBaseline(Baseline):
    """Dense-and-sparse over tokens: the ``tokens`` tokens of each tile that ``scheme`` reconstructs
    worst (key and value squared error, each relative to the tile's mean) kept as float16.

    Each costs its keys and values at 16 bits plus its position in the tile (``log2(T)`` bits); its
    packed codes stay in place (the tile layout does not change).
    """

    scheme: Scheme = Scheme(2, 2, TILE, scale_dtype="log8", sink_tokens=0)
    tokens: int = 4
    exact_tokens: int = 1

    def bits_per_element(self, head_dim: int) -> float:
        t = self.scheme.group_size
        per_token = 2 * head_dim * 16 + math.ceil(math.log2(t))
        return self.scheme.bits_per_element(head_dim) + self.tokens * per_token / (2.0 * t * head_dim)

    def _roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, s, d = k.shape
        t = self.scheme.group_size
        kt, vt = k.reshape(-1, t, d), v.reshape(-1, t, d)
        kd, vd = dequantize_tiles(quantize_tiles(kt, vt, self.scheme), self.scheme, d)
        ke, ve = (kd - kt).square().sum(dim=2), (vd - vt).square().sum(dim=2)  # [N, T]
        score = ke / ke.mean(dim=1, keepdim=True).clamp_min(1e-30) + ve / ve.mean(dim=1, keepdim=True).clamp_min(1e-30)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(self.tokens, dim=1).indices, True)
        kq = torch.where(keep[:, :, None], to_fp16(kt), kd).reshape(b, h, s, d)
        vq = torch.where(keep[:, :, None], to_fp16(vt), vd).reshape(b, h, s, d)
        _keep_exact(kq, vq, k, v, state, self.exact_tokens)
        return kq, vq


def _split(name: str, keys: SideCodec, values: SideCodec) -> SplitBaseline:
    return SplitBaseline(name, commit_tokens=TILE, window=0, keys=keys, values=values)


# where kvarn_k3v2_g128_s8's error sits: the same codec with one side kept exact (not registered:
# one side is not quantized at all)
ERROR_SPLITS: dict[str, SplitBaseline] = {
    b.name: b
    for b in (
        _split("k3v2s8_keys_exact", ExactSide(), KvarnSide(2)),
        _split("k3v2s8_values_exact", KvarnSide(3, per_channel=True), ExactSide()),
        _split("vq_v2_keys_exact", ExactSide(), VQSide(2, dim=4)),
        _split("vq_v2u_keys_exact", ExactSide(), VQSide(2, dim=4, unbiased=True)),
        _split("rs_v2_o32_keys_exact", ExactSide(), RotatedSparseSide(KvarnSide(2), 32)),
        _split("rs_v2_o128_keys_exact", ExactSide(), RotatedSparseSide(KvarnSide(2), 128)),
        _split("rsvq_v2_o128_keys_exact", ExactSide(), RotatedSparseSide(VQSide(2, dim=4), 128)),
        _split("rsvqu_v2_o128_keys_exact", ExactSide(), RotatedSparseSide(VQSide(2, dim=4, unbiased=True), 128)),
        _split("rs_k3_o32_values_exact", RotatedSparseSide(KvarnSide(3, per_channel=True), 32), ExactSide()),
        _split("rs_k3_o128_values_exact", RotatedSparseSide(KvarnSide(3, per_channel=True), 128), ExactSide()),
    )
}

# Not in the baseline registry: ``kvarn eval --schemes all`` (and ``make run``) stays as it was;
# tools/subbit_eval.py resolves these names.
RESEARCH: dict[str, Baseline] = {
    b.name: b
    for b in (
        # vector quantization at kvarn_k3v2_g128_s8's bytes: 2-dim keys at 3 bits, 4-dim values at 2
        _split("vq_k3v2", VQSide(3, per_channel=True, dim=2), VQSide(2, dim=4)),
        # the same, reconstructions scaled to be unbiased (the centroids shrink towards 0)
        _split("vq_k3v2_u", VQSide(3, per_channel=True, dim=2, unbiased=True), VQSide(2, dim=4, unbiased=True)),
        # mixed: the reference codec's 3-bit keys (log8) with vq_k3v2's values, the same bits again
        _split("k3s8_vqv2", KvarnSide(3, per_channel=True), VQSide(2, dim=4)),
        _split("k3s8_vqv2_u", KvarnSide(3, per_channel=True), VQSide(2, dim=4, unbiased=True)),
        # the same bits spent the other way: 4-bit keys, values at 1 bit per number (8-dim, 256 centroids)
        _split("k4s8_vqv1", KvarnSide(4, per_channel=True), VQSide(1, dim=8)),
        _split("k4s8_vqv1_u", KvarnSide(4, per_channel=True), VQSide(1, dim=8, unbiased=True)),
        # dense-and-sparse at kvarn_k3v2_g128_s8's bits: 2-bit tiles, 282 float16 outliers per tile
        DenseSparseBaseline("ds_k2v2_o192v90", commit_tokens=TILE, window=0, key_outliers=192, value_outliers=90),
        # dense-and-sparse over tokens at the same bits: kvarn k2v2 (log8) + the 4 worst tokens of each tile
        OutlierTokensBaseline("ds_k2v2_t4", commit_tokens=TILE, window=0, tokens=4),
        # dense-and-sparse in the rotated domain, within 2.8 bits: 256-token tiles (fewer parameter
        # bytes) pay for 32 key and 31 value float16 outliers per tile
        SplitBaseline(
            "rs_k3v2_g256_o32v31",
            commit_tokens=2 * TILE,
            window=0,
            keys=RotatedSparseSide(KvarnSide(3, per_channel=True, group=2 * TILE), 32),
            values=RotatedSparseSide(KvarnSide(2, group=2 * TILE), 31),
        ),
    )
}
