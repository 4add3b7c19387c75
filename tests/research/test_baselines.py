"""Issue 36's research codecs: round-trip properties and bit accounting."""

from __future__ import annotations

import pytest
import torch

from kvarn.baselines.base import to_fp16
from kvarn.research.baselines import (
    ERROR_SPLITS,
    RESEARCH,
    TILE,
    DenseSparseBaseline,
    ExactSide,
    KvarnSide,
    MetricSide,
    SplitBaseline,
)
from kvarn.research.lowrank import LowRankKeys, allocate_bits, fit_basis
from kvarn.research.metric import sqrt_metric
from kvarn.research.vq import VQSide, gaussian_codebook, vq_round
from kvarn.schemes import Scheme

D = 64


def _kv(tokens: int = TILE, heads: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, tokens, D, generator=g)
    k[..., 5] = k[..., 5] * 10 + 4.0  # a large channel with a mean, as real keys have
    return k, torch.randn(1, heads, tokens, D, generator=g)


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).square().sum() / x.square().sum())


def test_codebook_deterministic_and_better_than_scalar() -> None:
    c = gaussian_codebook(4, 2)
    assert c.shape == (256, 4)
    assert torch.equal(c, gaussian_codebook.__wrapped__(4, 2))
    x = torch.randn(20000, 4, generator=torch.Generator().manual_seed(1))
    mse = float((vq_round(x, 4, 2) - x).square().mean())
    assert mse < 0.1175  # Lloyd-Max's scalar 2-bit MSE of N(0, 1)


def test_vq_side_bits_match_reference_codec_bytes() -> None:
    s = Scheme(3, 2, TILE, scale_dtype="log8")
    vq = RESEARCH["vq_k3v2"]
    assert vq.bits_per_element(D) == pytest.approx(s.bits_per_element(D))
    assert VQSide(2).bits_per_element(D, TILE) == pytest.approx(2 + 8 * (2 * TILE + D) / (TILE * D))


@pytest.mark.parametrize("per_channel", [True, False])
def test_vq_side_roundtrip(per_channel: bool) -> None:
    k, _ = _kv()
    x = k.reshape(-1, TILE, D)
    out = VQSide(3 if per_channel else 2, per_channel=per_channel, dim=2 if per_channel else 4).roundtrip(x)
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    assert _rel(x, out) < (0.05 if per_channel else 0.15)
    assert torch.equal(out, VQSide(3 if per_channel else 2, per_channel, 2 if per_channel else 4).roundtrip(x))


def test_split_keeps_first_token_exact_once() -> None:
    b = SplitBaseline("t", commit_tokens=TILE, window=0, keys=KvarnSide(3, per_channel=True), values=KvarnSide(2))
    k, v = _kv(2 * TILE)
    state: dict[str, object] = {}
    kq, vq = b.roundtrip(k[:, :, :TILE], v[:, :, :TILE], state)
    assert torch.equal(kq[:, :, 0], k[:, :, 0]) and torch.equal(vq[:, :, 0], v[:, :, 0])
    assert not torch.equal(kq[:, :, 1], k[:, :, 1])
    kq2, _ = b.roundtrip(k[:, :, TILE:], v[:, :, TILE:], state)
    assert not torch.equal(kq2[:, :, 0], k[:, :, TILE])  # only the sequence's first token


def test_split_sides_and_bits() -> None:
    kq, vq = ERROR_SPLITS["k3v2s8_keys_exact"].roundtrip(*_kv(), {})
    k, v = _kv()
    assert torch.equal(kq, k) and not torch.equal(vq, v)
    assert ERROR_SPLITS["k3v2s8_keys_exact"].bits_per_element(D) == pytest.approx(
        0.5 * (16 + 2 + 8 * (2 * TILE + D) / (TILE * D))
    )
    assert ExactSide().bits_per_element(D, TILE) == 16.0


def test_dense_sparse_outliers_exact_and_bits() -> None:
    b = DenseSparseBaseline("t", commit_tokens=TILE, window=0, key_outliers=50, value_outliers=20, exact_tokens=0)
    k, v = _kv()
    k[0, 0, 7, 9] = 300.0
    kq, vq = b.roundtrip(k, v, {})
    assert float(kq[0, 0, 7, 9]) == 300.0  # the largest outlier is stored as float16
    base = Scheme(2, 2, TILE, rotation="none", scale_dtype="log8", sink_tokens=0).bits_per_element(D)
    assert b.bits_per_element(D) == pytest.approx(base + 70 * (16 + 13) / (2 * TILE * D))
    dense = DenseSparseBaseline("d", commit_tokens=TILE, window=0, exact_tokens=0)
    assert _rel(k, kq) < _rel(k, dense.roundtrip(k, v, {})[0])


def test_allocate_bits_sums_and_orders() -> None:
    var = torch.tensor([[16.0, 4.0, 1.0, 0.01]])
    bits = allocate_bits(var, 6)
    assert int(bits.sum()) == 6
    assert bits[0].tolist() == sorted(bits[0].tolist(), reverse=True)
    assert int(allocate_bits(var, 100, max_bits=3).sum()) == 12


def test_lowrank_keys_roundtrip() -> None:
    k, _ = _kv(4 * TILE)
    basis = fit_basis(k[0], TILE)
    assert torch.allclose(basis.vectors[0].T @ basis.vectors[0], torch.eye(D), atol=1e-4)
    assert bool((basis.variance[:, :-1] >= basis.variance[:, 1:]).all())
    codec = LowRankKeys((basis,), bits_per_token=200)
    out = codec.roundtrip(k[:, :, :TILE], layer=0)
    assert out.shape == (1, 2, TILE, D)
    assert _rel(k[:, :, :TILE], out) < 0.05
    assert codec.bits_per_element(D, TILE) == pytest.approx(200 / D + 16 / TILE)
    with pytest.raises(ValueError, match="layer index"):
        codec.roundtrip(k[:, :, :TILE], layer=None)


def test_sqrt_metric_inverse_and_weighting() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 200, D, generator=g)
    gram = w.transpose(1, 2) @ w
    m = sqrt_metric(gram)
    eye = torch.eye(D).expand(2, D, D)
    assert torch.allclose(m.transform @ m.inverse, eye, atol=1e-3)
    assert torch.allclose(torch.linalg.det(m.transform.double()), torch.ones(2, dtype=torch.float64), atol=1e-3)
    assert torch.allclose(sqrt_metric(torch.eye(D).expand(2, D, D).clone()).transform, eye, atol=1e-5)
    x, _ = _kv()
    side = MetricSide(ExactSide(), (m,))
    assert torch.allclose(side.roundtrip(x, layer=0), x, atol=1e-3)
    assert MetricSide(KvarnSide(2), (m,)).bits_per_element(D, TILE) == KvarnSide(2).bits_per_element(D, TILE)
    with pytest.raises(ValueError, match="layer index"):
        side.roundtrip(x, layer=None)


def test_outlier_tokens_exact_and_bits() -> None:
    b = RESEARCH["ds_k2v2_t4"]
    k, v = _kv()
    k[0, 1, 40] *= 30.0  # one far-off token: reconstructed worst, so kept
    kq, vq = b.roundtrip(k, v, {"exact_done": True})
    assert torch.equal(kq[0, 1, 40], to_fp16(k[0, 1, 40])) and torch.equal(vq[0, 1, 40], to_fp16(v[0, 1, 40]))
    kept = (kq == to_fp16(k)).all(dim=-1) & (vq == to_fp16(v)).all(dim=-1)
    assert int(kept.sum()) == 4 * k.shape[1]
    base = Scheme(2, 2, TILE, scale_dtype="log8", sink_tokens=0).bits_per_element(D)
    assert b.bits_per_element(D) == pytest.approx(base + 4 * (2 * D * 16 + 7) / (2 * TILE * D))


def test_vq_side_tiles_are_independent() -> None:
    """Every leading index is one tile: a [B, H, T, D] batch equals its tiles one by one."""
    k, _ = _kv(heads=3)
    side = VQSide(2, dim=4)
    whole = side.roundtrip(k)
    for h in range(3):
        assert torch.allclose(whole[0, h], side.roundtrip(k[0, h][None])[0], atol=1e-6)


def test_rotated_sparse_256_token_tiles_within_budget() -> None:
    b = RESEARCH["rs_k3v2_g256_o32v31"]
    assert b.commit_tokens == 2 * TILE
    g256 = Scheme(3, 2, 2 * TILE, scale_dtype="log8").bits_per_element(D)
    assert b.bits_per_element(D) == pytest.approx(g256 + 63 * (16 + 14) / (2 * 2 * TILE * D))
    assert b.bits_per_element(D) + 16 / 2048 <= 2.8
    k, v = _kv(2 * TILE)
    k[0, 0, 9] += 50.0  # a token far off in every rotated channel: its numbers are outliers
    kq, vq = b.roundtrip(k, v, {})
    assert _rel(k, kq) < 0.05 and _rel(v, vq) < 0.25
    assert torch.equal(kq[:, :, 0], k[:, :, 0])
