"""The reference codec: packing, rotation, normalization, RTN error bounds, degenerate input."""

from __future__ import annotations

import pytest
import torch

from kvarn.codec import (
    decode_records,
    dequantize_tiles,
    encode_tiles,
    layout,
    pack_codes,
    quantize_tiles,
    rotate,
    rotation_matrix,
    std_spread,
    unpack_codes,
    unrotate,
)
from kvarn.codec.normalize import sinkhorn_iterates
from kvarn.schemes import BUILTINS, Scheme

HEAD_DIMS = (64, 128, 256)


def _tiles(n: int, t: int, d: int, seed: int = 0, outlier: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, d, generator=g)
    if outlier:  # keys have a few huge channels; some tokens are sinks
        x[:, :, 3] = x[:, :, 3] * 10 + 5
        x[:, 0, :] *= 8
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_bit_exact(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 32, 64), generator=g).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 32 * 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits, 32, 64), codes)


def test_pack_layout_is_little_endian_along_channels() -> None:
    codes = torch.tensor([1, 2, 3, 0] * 16, dtype=torch.uint8).reshape(1, 1, 64)
    packed = pack_codes(codes.expand(1, 32, 64).contiguous(), 2)
    assert packed[0, 0].item() == 1 | (2 << 2) | (3 << 4)
    # 3 bits: a 2-bit plane of low bits, then a 1-bit plane of high bits
    c3 = torch.full((1, 32, 64), 6, dtype=torch.uint8)
    p3 = pack_codes(c3, 3)
    assert p3[0, 0].item() == 0b10101010 and p3[0, 32 * 64 // 4].item() == 0xFF


@pytest.mark.parametrize("kind", ["hadamard", "rhadamard", "none"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rotation_is_orthonormal(kind: str, d: int) -> None:
    r = rotation_matrix(kind, d).double()
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    x = torch.randn(3, d)
    torch.testing.assert_close(unrotate(rotate(x, kind), kind), x, atol=1e-5, rtol=0)
    if kind != "none":  # it spreads a single-channel outlier over every channel
        spike = torch.zeros(1, d)
        spike[0, 7] = 100.0
        assert rotate(spike, kind).abs().max().item() == pytest.approx(100 / d**0.5, rel=1e-5)


@pytest.mark.parametrize("name", list(BUILTINS))
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_record_size_matches_formula(name: str, d: int) -> None:
    s = BUILTINS[name]
    x = _tiles(2, s.group_size, d)
    rec = quantize_tiles(x, x * 0.5, s)
    assert rec.shape == (2, s.tile_bytes(d)) and rec.dtype == torch.uint8
    assert layout(s, d).total == s.tile_bytes(d)


@pytest.mark.parametrize("scale_dtype", ["fp16", "log8"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_reconstruction_within_rtn_bound(bits: int, d: int, scale_dtype: str) -> None:
    """|x - x_hat| <= scale/2 * factor per element (+ float slack), in the rotated domain."""
    s = Scheme(bits, bits, 64, scale_dtype=scale_dtype)  # type: ignore[arg-type]
    x = _tiles(3, 64, d, seed=bits + d)
    dec = decode_records(quantize_tiles(x, x, s), s, d)
    xr = rotate(x, s.rotation)
    k_bound = 0.5 * dec.key_scale[:, None, :] * dec.key_factor[:, :, None]
    v_bound = 0.5 * dec.value_scale[:, :, None] * dec.value_factor[:, None, :]
    slack = 1e-4 * xr.abs().amax()
    assert bool(((dec.keys() - xr).abs() <= k_bound + slack).all())
    assert bool(((dec.values() - xr).abs() <= v_bound + slack).all())
    # and the step is what min-max RTN gives: relative error falls ~2x per extra bit
    kh, _ = dequantize_tiles(quantize_tiles(x, x, s), s, d)
    rel = ((kh - x).norm() / x.norm()).item()
    assert rel < {2: 0.45, 3: 0.2, 4: 0.1, 8: 0.008}[bits]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_input_dtypes(dtype: torch.dtype) -> None:
    s = BUILTINS["kvarn_k4v4_g128"]
    x = _tiles(2, 128, 128).to(dtype)
    k, v = dequantize_tiles(quantize_tiles(x, x, s), s, 128, dtype=dtype)
    assert k.dtype == dtype
    assert ((k.float() - x.float()).norm() / x.float().norm()).item() < 0.1


def test_normalization_reduces_std_spread_on_outlier_tiles() -> None:
    x = rotate(_tiles(8, 128, 128, outlier=True), "none")
    x[:, :, :4] *= 20  # outlier channels
    x[:, 5, :] *= 30  # outlier token
    rows0, cols0 = std_spread(x)
    log_r, log_c = list(sinkhorn_iterates(x, 8))[-1]
    y = x * torch.exp(-log_r - log_c)
    rows, cols = std_spread(y)
    assert bool((rows < 0.2 * rows0).all()) and bool((cols < 0.2 * cols0).all())


def test_more_iterations_never_make_a_tile_worse() -> None:
    x = _tiles(16, 128, 64, seed=3)
    errs = []
    for it in (0, 1, 4, 16):
        s = Scheme(4, 2, 128, norm_iters=it)
        k, v = dequantize_tiles(quantize_tiles(x, x, s), s, 64)
        errs.append(((k - x).square().sum(dim=(1, 2)), (v - x).square().sum(dim=(1, 2))))
    for (k0, v0), (k1, v1) in zip(errs, errs[1:], strict=False):
        assert bool((k1 <= k0 * (1 + 1e-5)).all()) and bool((v1 <= v0 * (1 + 1e-5)).all())


@pytest.mark.parametrize("scale_dtype", ["fp16", "log8"])
def test_degenerate_tiles(scale_dtype: str) -> None:
    s = Scheme(4, 2, 32, scale_dtype=scale_dtype)  # type: ignore[arg-type]
    d = 64
    zeros = torch.zeros(1, 32, d)
    const = torch.full((1, 32, d), 3.25)
    sink = _tiles(1, 32, d, outlier=False)
    sink[0, 0] *= 100.0  # attention-sink token, norm 100x the rest
    near_max = torch.full((1, 32, d), 60000.0)
    near_max[0, ::2] = -65000.0
    x = torch.cat([zeros, const, sink, near_max]).half()
    k, v = dequantize_tiles(quantize_tiles(x, x, s), s, d)
    assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
    assert torch.equal(k[0], zeros[0]) and torch.equal(v[0], zeros[0])
    torch.testing.assert_close(k[1], const[0], rtol=2e-2, atol=0)
    torch.testing.assert_close(v[1], const[0], rtol=2e-2, atol=0)
    # the sink token survives with small relative error; the other tokens stay usable
    assert ((k[2, 0] - x[2, 0].float()).norm() / x[2, 0].float().norm()).item() < 0.1
    assert ((k[3] - x[3].float()).norm() / x[3].float().norm()).item() < 0.1


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf")])
def test_non_finite_input_raises(bad: float) -> None:
    x = torch.randn(1, 128, 64)
    x[0, 5, 5] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_tiles(x, torch.randn(1, 128, 64), Scheme())
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_tiles(torch.randn(1, 128, 64), x, Scheme())


def test_shape_errors_name_the_expected_shape() -> None:
    with pytest.raises(ValueError, match=r"\[tiles, 128, head_dim\]"):
        quantize_tiles(torch.randn(1, 64, 64), torch.randn(1, 64, 64), Scheme())
    with pytest.raises(ValueError, match=r"records must be \[tiles, 7296\] uint8"):
        decode_records(torch.zeros(1, 10, dtype=torch.uint8), Scheme(), 64)


def test_encoding_is_vectorized_and_tile_independent() -> None:
    """Tiles are encoded independently: a batch gives the same bytes as one tile at a time."""
    s = BUILTINS["kvarn_k4v2_g64"]
    x = _tiles(6, 64, 128, seed=9)
    batch = quantize_tiles(x, x.flip(0), s)
    single = torch.cat([quantize_tiles(x[i : i + 1], x.flip(0)[i : i + 1], s) for i in range(6)])
    assert torch.equal(batch, single)
    k, _ = encode_tiles(x, x, s)
    assert k.codes.shape == (6, 64, 128)
