"""The native decode kernel's paths against each other: the 8-lane fallback (built without AVX-512)
and the 16-lane AVX-512 float path (built without AMX) against the default build (AMX-INT8 key
scores where the CPU has them): each within the CPU ops' tolerance of the float reference, and
close to the others, for every code width, fp16 and log8 parameters, sinks, rotations, head_dim
64..256 and 1..8 query heads per KV head. Skipped where there is no compiler or the machine lacks
AVX-512 / AMX-INT8 (then the default build is that fallback, which tests/kernels/test_cpu.py covers)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvarn.kernels import PagedContext
from kvarn.kernels.cpu import native
from kvarn.kernels.cpu import ops as cpu

from ._fallback_build import build_without, fallback, needs_avx512, needs_cpu
from ._reference import attention, paged_batch, sqnr_db
from .test_cpu import MIN_SQNR_DB, scheme, staging

pytestmark = needs_avx512


needs_amx = needs_cpu("amx_int8", "AMX-INT8")


def without_amx() -> ModuleType:
    """The extension built without AMX (the AVX-512 float paths)."""
    return build_without("-mno-amx-tile", "-mno-amx-int8")


def _case(
    name: str, sink_tokens: int, d: int, group: int, seed: int = 7
) -> tuple[torch.Tensor, PagedContext, torch.Tensor]:
    """Four sequences (``9T + 5``, 3, ``2T`` and ``18T - 1`` tokens, two KV heads): the query
    ``[4, 2 * group, D]``, its context and the float reference ``[4, 2 * group, D]``."""
    sc = scheme(name, sink_tokens)
    t = sc.group_size
    lens = [9 * t + 5, 3, 2 * t, 17 * t + t - 1]
    pb = paged_batch(sc, lens, 2, d, seed=seed)
    a = staging(sc, pb, True, seed=seed)
    q = torch.randn(len(lens), 2 * group, d, generator=torch.Generator().manual_seed(seed))
    ctx = PagedContext(pb.cache, pb.block_table, pb.num_tiles, a.tail_k, a.tail_v, pb.tail_lens, sc, **a.kwargs)  # type: ignore[arg-type]
    ref = torch.cat([attention(q[b : b + 1], pb.context_k[b], pb.context_v[b]) for b in range(len(lens))])
    return q, ctx, ref


CASES = [  # (scheme, sink_tokens, head_dim, query heads per KV head)
    ("kvarn_k4v2_g128", 0, 64, 3),
    ("kvarn_k4v4_g64", 0, 128, 1),
    ("kvarn_k3v2_g32", 2, 64, 4),
    ("kvarn_k2v3_g32_rot-none_it0", 0, 256, 2),
    ("kvarn_k8v8_g32_rot-rh_s8", 0, 64, 8),
    ("kvarn_k3v3_g64_s8", 1, 128, 5),
    ("kvarn_k4v2_g128_sink", 0, 64, 3),
]


@pytest.mark.parametrize(("name", "sink_tokens", "d", "group"), CASES)
def test_fallback_and_avx512_paths_agree(
    name: str, sink_tokens: int, d: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, ctx, ref = _case(name, sink_tokens, d, group, seed=5)
    wide = cpu.decode_attention(q, ctx, impl="native")
    monkeypatch.setattr(native, "extension", fallback)
    narrow = cpu.decode_attention(q, ctx, impl="native")
    assert sqnr_db(ref, wide) >= MIN_SQNR_DB and sqnr_db(ref, narrow) >= MIN_SQNR_DB
    torch.testing.assert_close(wide, narrow, atol=1e-5, rtol=1e-4)


@needs_amx
@pytest.mark.parametrize(("name", "sink_tokens", "d", "group"), [*CASES, ("kvarn_k4v2_g128", 0, 64, 7)])
def test_amx_and_float_paths_agree(
    name: str, sink_tokens: int, d: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AMX key scores (query rounded to 24 bits, exact integer sums) against the float path; 7
    query heads take two tile products (5 heads each)."""
    q, ctx, ref = _case(name, sink_tokens, d, group)
    amx = cpu.decode_attention(q, ctx, impl="native")
    monkeypatch.setattr(native, "extension", without_amx)
    plain = cpu.decode_attention(q, ctx, impl="native")
    assert sqnr_db(ref, amx) >= MIN_SQNR_DB and sqnr_db(ref, plain) >= MIN_SQNR_DB
    torch.testing.assert_close(amx, plain, atol=1e-5, rtol=1e-4)
    assert not torch.equal(amx, plain)  # the default build did take another path
