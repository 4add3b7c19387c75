"""The native store (kvarn.kernels.cpu.store) built without AVX-512 (8-lane vectors, the AVX 8 x 8
transposes) against the reference codec within the store's tolerance (the sums of squared errors
add their lanes in another order than with 16 lanes, so a side whose iterates tie may pick another
one; everything else is computed lane by lane as in the AVX-512 build), for every code width, fp16 and log8 parameters, rotations, head_dim 64..256, tiles 32..256, every input dtype and
strided inputs. Skipped where there is no compiler or the machine lacks AVX-512 (then the default build
is already the fallback, which tests/kernels/test_cpu.py covers)."""

from __future__ import annotations

import pytest
import torch

from kvarn.kernels.cpu import native
from kvarn.schemes.scheme import Scheme

from ._fallback_build import fallback, needs_avx512
from .test_cpu import assert_store_matches_reference, store_inputs

pytestmark = needs_avx512


CASES = [  # (scheme, head_dim, dtype, strided)
    ("kvarn_k4v2_g128", 64, torch.bfloat16, False),
    ("kvarn_k3v2_g128_s8", 64, torch.float32, True),
    ("kvarn_k4v4_g64", 128, torch.float16, False),
    ("kvarn_k2v3_g32_rot-rh", 256, torch.bfloat16, True),
    ("kvarn_k8v8_g256_rot-rh_s8", 64, torch.float32, False),
    ("kvarn_k8v3_g32_rot-none_it2_s8", 128, torch.float16, True),
    ("kvarn_k3v3_g256_it0", 256, torch.float32, False),
    ("kvarn_k2v2_g64_rot-none", 64, torch.bfloat16, False),
]


@pytest.mark.parametrize(("name", "d", "dtype", "strided"), CASES)
def test_fallback_store_matches_the_reference(
    name: str, d: int, dtype: torch.dtype, strided: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn.codec import quantize_tiles
    from kvarn.kernels.cpu.store import store_tiles

    sc = Scheme.from_name(name)
    n, h, t = 4, 2, sc.group_size
    k, v = store_inputs(sc, n, h, d, dtype, seed=d + len(name))
    if strided:  # token-major heads ([n, t, h, d] storage) and a padded head_dim
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        wide = torch.zeros(n, h, t, d + 8, dtype=dtype)
        wide[..., :d] = v
        v = wide[..., :d]
    nb = sc.tile_bytes(d)
    ids = torch.tensor([3, 0, 5, 1])
    monkeypatch.setattr(native, "extension", fallback)
    narrow = torch.zeros(n + 2, h, nb, dtype=torch.uint8)
    store_tiles(k, v, narrow, ids, sc, impl="native")
    ref = quantize_tiles(k.reshape(n * h, t, d), v.reshape(n * h, t, d), sc)
    assert_store_matches_reference(narrow[ids], ref, sc, d, (k, v))
    assert not narrow[[2, 4]].any()
