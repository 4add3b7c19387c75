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

from ._fallback_build import fallback, needs_avx512
from .test_cpu import assert_dequantized, records_in_pages
from .test_cpu_store_paths import CASES as STORE_PATH_CASES

pytestmark = needs_avx512


# the fallback store's cases (scheme, head_dim, dtype), here for the dtype of the output
CASES = [(name, d, dtype) for name, d, dtype, _strided in STORE_PATH_CASES]


@pytest.mark.parametrize(("name", "d", "dtype"), CASES)
def test_fallback_dequantize_matches_the_reference_and_avx512(
    name: str, d: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn.kernels.cpu.dequant import dequantize_blocks

    sc, pages, blocks, ref = records_in_pages(name, d, [4, 0, 2])
    wide = dequantize_blocks(pages, blocks, sc, d, dtype)
    monkeypatch.setattr(native, "extension", fallback)
    narrow = dequantize_blocks(pages, blocks, sc, d, dtype)
    assert_dequantized(narrow, ref, dtype)
    assert_dequantized(narrow, ref, dtype, expected=wide)
