"""The native dequantize (kvarn.kernels.cpu.dequant) built without AVX-512 (8-lane vectors, the
integer bf16 rounding) against the reference codec and against the default AVX-512 build (16 lanes,
the BF16 conversion instruction): the same numbers up to float32 rounding of the un-rotation, for
every code width, fp16 and log8 parameters, rotations, head_dim 64..256, tiles 32..256, every output
dtype and a strided output. Skipped where there is no compiler or the machine lacks AVX-512 (then the
default build is already the fallback, which tests/kernels/test_cpu.py covers)."""

from __future__ import annotations

import pytest
import torch

from kvarn.kernels.cpu import native
from kvarn.schemes.scheme import Scheme

from ._fallback_build import fallback, needs_avx512
from .test_cpu import store_inputs

pytestmark = needs_avx512


CASES = [  # (scheme, head_dim, dtype)
    ("kvarn_k4v2_g128", 64, torch.bfloat16),
    ("kvarn_k3v2_g128_s8", 64, torch.float32),
    ("kvarn_k4v4_g64", 128, torch.float16),
    ("kvarn_k2v3_g32_rot-rh", 256, torch.bfloat16),
    ("kvarn_k8v8_g256_rot-rh_s8", 64, torch.float32),
    ("kvarn_k8v3_g32_rot-none_it2_s8", 128, torch.float16),
    ("kvarn_k3v3_g256_it0", 256, torch.float32),
    ("kvarn_k2v2_g64_rot-none", 64, torch.bfloat16),
]


@pytest.mark.parametrize(("name", "d", "dtype"), CASES)
def test_fallback_dequantize_matches_the_reference_and_avx512(
    name: str, d: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn.codec import dequantize_tiles, quantize_tiles
    from kvarn.kernels._checks import log8_table
    from kvarn.kernels.cpu._checks import CPU
    from kvarn.kernels.cpu.dequant import dequantize_blocks

    sc = Scheme.from_name(name)
    u, h, t = 3, 2, sc.group_size
    k, v = store_inputs(sc, u, h, d, torch.float32, seed=d + len(name))
    nb = sc.tile_bytes(d)
    rec = quantize_tiles(k.reshape(u * h, t, d), v.reshape(u * h, t, d), sc).view(u, h, nb)
    pages = torch.zeros(u + 2, h, nb + 16, dtype=torch.uint8)
    blocks = torch.tensor([4, 0, 2])
    pages[blocks, :, :nb] = rec
    ref = [x.view(u, h, t, d).transpose(0, 1) for x in dequantize_tiles(rec.view(u * h, nb), sc, d)]
    wide = dequantize_blocks(pages[:, :, :nb], blocks, sc, d, dtype)
    monkeypatch.setattr(native, "extension", fallback)
    narrow = dequantize_blocks(pages[:, :, :nb], blocks, sc, d, dtype)
    for mine, other, theirs in zip(narrow, wide, ref, strict=True):
        assert mine.shape == (h, u, t, d) and mine.dtype == dtype
        scale = theirs.abs().amax((2, 3), keepdim=True).clamp_min(1e-30)
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(mine.float() / scale, theirs.to(dtype).float() / scale, rtol=0, atol=tol)
        torch.testing.assert_close(mine.float() / scale, other.float() / scale, rtol=0, atol=tol)
    # rows wider than D (the kernel's token stride): the padding is left alone
    out_k = torch.full((h, u, t, d + 8), 3.0, dtype=dtype)
    out_v = torch.full((h, u, t, d + 8), 3.0, dtype=dtype)
    fallback().dequant(
        pages[:, :, :nb],
        blocks,
        log8_table(CPU),
        native.store_record(sc, d),
        *native.rotation_args(sc, d),
        out_k[..., :d],
        out_v[..., :d],
        2,
    )
    for full, mine in zip((out_k, out_v), narrow, strict=True):
        assert torch.equal(full[..., :d], mine) and bool((full[..., d:] == 3.0).all())
