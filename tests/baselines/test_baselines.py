"""Baselines: shapes, error bounds and ordering, fp8 state, Lloyd-Max codebooks, bits, registry."""

from __future__ import annotations

import pytest
import torch

from kvarn.baselines import (
    BASELINES,
    Baseline,
    UnknownBaselineError,
    get_baseline,
    lloyd_max_centroids,
    lloyd_max_mse,
)
from kvarn.baselines.fp8 import E4M3_MAX
from kvarn.baselines.turboquant import turboquant_key_roundtrip

HEAD_DIM = 64


def _kv(tokens: int = 128, seed: int = 0, outliers: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian keys with a few large channels (as real keys have) and Gaussian values."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, tokens, HEAD_DIM, generator=g)
    v = torch.randn(2, 3, tokens, HEAD_DIM, generator=g)
    if outliers:
        k[..., [3, 17, 40]] *= 12.0
        k[..., [5]] += 6.0
    return k, v


def _rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).square().mean() / x.square().mean())


def _errors(name: str, tokens: int = 128) -> tuple[float, float]:
    k, v = _kv(tokens)
    kq, vq = get_baseline(name).roundtrip(k, v, {})
    return _rel_mse(k, kq), _rel_mse(v, vq)


@pytest.mark.parametrize("name", list(BASELINES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shape_dtype_preserved(name: str, dtype: torch.dtype) -> None:
    b = get_baseline(name)
    tokens = max(b.commit_tokens, 128)
    k, v = (x.to(dtype) for x in _kv(tokens))
    kq, vq = b.roundtrip(k, v, {})
    assert kq.shape == k.shape and vq.shape == v.shape
    assert kq.dtype == dtype and vq.dtype == dtype
    assert bool(torch.isfinite(kq).all() and torch.isfinite(vq).all())
    assert not torch.equal(kq, k)  # something was quantized


@pytest.mark.parametrize("name", list(BASELINES))
def test_commit_granularity(name: str) -> None:
    """A commit of ``commit_tokens`` works; a non-multiple is refused with the number in the message."""
    b = get_baseline(name)
    k, v = _kv(b.commit_tokens)
    kq, _ = b.roundtrip(k, v, {})
    assert kq.shape == k.shape
    if b.commit_tokens > 1:
        k, v = _kv(b.commit_tokens + 1)
        with pytest.raises(ValueError, match=f"commit_tokens={b.commit_tokens}"):
            b.roundtrip(k, v, {})
    with pytest.raises(ValueError, match="same|tokens, head_dim"):
        b.roundtrip(k[0], v[0], {})


# relative MSE bounds (keys, values) on _kv(128); measured 2026-11-30 (e.g. int8 1.9e-4/3.5e-5, kivi2
# 0.151/0.155, turboquant3 0.029/0.037), bounds ~1.5x those
BOUNDS = {
    "int8": (3e-4, 6e-5),
    "fp8": (1e-3, 1e-3),
    "kivi4": (9e-3, 9e-3),
    "kivi2": (0.23, 0.23),
    "turboquant4": (0.012, 0.012),
    "turboquant3": (0.045, 0.055),
    "rtn_k4v4": (0.015, 0.012),
    "rtn_k4v2": (0.015, 0.3),
}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_error_within_bound(name: str) -> None:
    ek, ev = _errors(name)
    bk, bv = BOUNDS[name]
    assert 0 < ek < bk, f"{name} key rel MSE {ek}"
    assert 0 < ev < bv, f"{name} value rel MSE {ev}"


def test_error_ordering() -> None:
    total = {n: sum(_errors(n)) for n in ("int8", "fp8", "kivi4", "kivi2", "turboquant4", "turboquant3")}
    assert total["int8"] < total["fp8"] < total["kivi4"] < total["kivi2"]
    assert total["turboquant4"] < total["turboquant3"]
    ek4, ev4 = _errors("rtn_k4v4")
    ek2, ev2 = _errors("rtn_k4v2")
    assert ek4 == pytest.approx(ek2) and ev4 < ev2  # same keys, fewer value bits


def test_fp8_scale_fixed_after_first_commit() -> None:
    b = get_baseline("fp8")
    state: dict[str, float] = {}
    k, v = _kv(1)
    b.roundtrip(k, v, state)
    assert state["k_scale"] == pytest.approx(float(k.abs().max()) / E4M3_MAX)
    assert state["v_scale"] == pytest.approx(float(v.abs().max()) / E4M3_MAX)
    first = dict(state)
    k2, v2 = (x * 100 for x in _kv(1, seed=1))
    kq, _ = b.roundtrip(k2, v2, state)
    assert state == first  # not recomputed from later tokens
    assert float(kq.abs().max()) == pytest.approx(E4M3_MAX * first["k_scale"])  # saturates


def test_fp8_is_e4m3() -> None:
    """With scale 1, exactly representable e4m3 numbers pass unchanged and others round."""
    b = get_baseline("fp8")
    state = {"k_scale": 1.0, "v_scale": 1.0}
    x = torch.tensor([0.0, 1.0, -1.5, 448.0, 1.0 + 1 / 16]).view(1, 1, 5, 1).expand(1, 1, 5, 64).contiguous()
    kq, _ = b.roundtrip(x, x, state)
    assert kq[0, 0, :, 0].tolist() == [0.0, 1.0, -1.5, 448.0, 1.0]


def test_kivi_groups_are_independent() -> None:
    """Keys: a spike in one 32-token group leaves the other group's error unchanged (per-group scales)."""
    b = get_baseline("kivi2")
    k, v = _kv(64)
    kq, _ = b.roundtrip(k, v, {})
    k2 = k.clone()
    k2[:, :, 40] *= 50
    kq2, _ = b.roundtrip(k2, v, {})
    assert torch.equal(kq[:, :, :32], kq2[:, :, :32])
    assert not torch.equal(kq[:, :, 32:], kq2[:, :, 32:])


def test_lloyd_max_centroids_and_mse() -> None:
    for bits, known in ((3, 0.03454), (4, 0.009497)):
        c = lloyd_max_centroids(bits)
        assert c.shape == (1 << bits,)
        assert bool((c[1:] > c[:-1]).all())
        assert torch.allclose(c, -c.flip(0), atol=1e-6)  # symmetric
        # Max (1960) tabulated 0.03454 and 0.009497; the exact optimum is 0.034548 / 0.009501
        assert lloyd_max_mse(bits) == pytest.approx(known, rel=1e-3)
    assert lloyd_max_centroids(3)[-1] == pytest.approx(2.152, abs=1e-3)
    # the MSE measured by sampling N(0, 1) matches the analytic value
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(0))
    c = lloyd_max_centroids(4)
    q = c[torch.bucketize(x, (c[1:] + c[:-1]) / 2)]
    assert float((x - q).square().mean()) == pytest.approx(lloyd_max_mse(4), rel=0.03)


def test_turboquant_key_error_matches_lloyd_max() -> None:
    """On Gaussian keys the rotated unit vector's coordinates are ~N(0, 1/d): error ~ the codebook's."""
    k = torch.randn(4096, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    for bits in (3, 4):
        err = _rel_mse(k, turboquant_key_roundtrip(k, bits, norm_correction=False))
        assert err == pytest.approx(lloyd_max_mse(bits), rel=0.1)


@pytest.mark.parametrize(
    ("name", "bits64", "bits128"),
    [
        ("fp8", 8.0, 8.0),
        ("int8", 8 + 16 / 64, 8 + 16 / 128),  # 16-bit scale per token and head
        ("kivi2", 3.0, 3.0),  # 2 + (16 + 16) / 32
        ("kivi4", 5.0, 5.0),
        ("turboquant3", 8 * (24 + 2 + 24 + 4) / 128, 8 * (48 + 2 + 48 + 4) / 256),  # 3.375, 3.1875
        ("turboquant4", 8 * (32 + 2 + 32 + 4) / 128, 8 * (64 + 2 + 64 + 4) / 256),  # 4.375, 4.1875
        # per 128x64 tile: codes 128*64*(4+2)/8 = 6144 B, params 2*(2*64+128) + 2*(2*128+64) = 1152 B
        ("rtn_k4v2", 8 * (6144 + 1152) / (2 * 128 * 64), 3.375),
        ("rtn_k4v4", 8 * (8192 + 1152) / (2 * 128 * 64), 4.375),
        ("rtn_k2v2", 8 * (4096 + 1152) / (2 * 128 * 64), 2.375),
    ],
)
def test_bits_per_element(name: str, bits64: float, bits128: float) -> None:
    b = get_baseline(name)
    assert b.bits_per_element(64) == pytest.approx(bits64)
    assert b.bits_per_element(128) == pytest.approx(bits128)


def test_registry_contract() -> None:
    assert set(BASELINES) >= {"fp8", "int8", "kivi2", "kivi4", "turboquant3", "turboquant4", "rtn_k4v2"}
    for name, b in BASELINES.items():
        assert isinstance(b, Baseline) and b.name == name
        assert b.commit_tokens >= 1 and b.window >= 0
    assert (get_baseline("kivi2").commit_tokens, get_baseline("kivi2").window) == (32, 128)
    assert (get_baseline("rtn_k4v2").commit_tokens, get_baseline("rtn_k4v2").window) == (128, 0)
    assert all(get_baseline(n).commit_tokens == 1 for n in ("fp8", "int8", "turboquant3", "turboquant4"))


def test_unknown_name() -> None:
    with pytest.raises(UnknownBaselineError) as info:
        get_baseline("kivi3")
    assert isinstance(info.value, KeyError)
    msg = str(info.value)
    assert "'kivi3'" in msg and "did you mean 'kivi4'" in msg
    assert all(n in msg for n in BASELINES)
