"""Store kernel vs the reference codec: records byte for byte (codes, scales, zero points, factors).

Under the interpreter (CPU) the kernel reproduces the reference exactly: same operation order,
divisions kept as divisions, no fused multiply-add, log8 values read from the reference table.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.codec import decode_records, quantize_tiles
from kvarn.kernels import KernelArgumentError
from kvarn.kernels.triton import KernelConfig, quantize_tiles_triton, store_tiles
from kvarn.schemes import BUILTINS, Scheme

from ._reference import DEVICE, assert_store_refusals, kv_tiles


def _assert_records_equal(out: torch.Tensor, ref: torch.Tensor, scheme: Scheme, d: int) -> None:
    a, b = decode_records(out.cpu(), scheme, d), decode_records(ref.cpu(), scheme, d)
    assert torch.equal(a.key_codes, b.key_codes), f"key codes differ at {(a.key_codes != b.key_codes).sum()} places"
    assert torch.equal(a.value_codes, b.value_codes), f"value codes differ at {(a.value_codes != b.value_codes).sum()}"
    for f in ("key_scale", "key_offset", "key_factor", "value_scale", "value_offset", "value_factor"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f"{f} differs"
    assert torch.equal(out.cpu(), ref.cpu())


@pytest.mark.parametrize("name", list(BUILTINS))
def test_store_matches_reference_every_builtin(name: str) -> None:
    scheme = BUILTINS[name]
    k, v = kv_tiles(2, scheme.group_size, 64, seed=len(name))
    out = quantize_tiles_triton(k.to(DEVICE), v.to(DEVICE), scheme)
    _assert_records_equal(out, quantize_tiles(k, v, scheme), scheme, 64)


@pytest.mark.parametrize(
    ("name", "d", "dtype"),
    [
        ("kvarn_k4v2_g32_rot-rh", 128, torch.float32),
        ("kvarn_k8v3_g32_rot-none_it2", 64, torch.float16),
        ("kvarn_k2v4_g32_it0_s8_sink", 64, torch.bfloat16),
        ("kvarn_k3v8_g32_it3_s8", 128, torch.float16),
    ],
)
def test_store_matches_reference_other_options(name: str, d: int, dtype: torch.dtype) -> None:
    scheme = Scheme.from_name(name)
    k, v = kv_tiles(2, scheme.group_size, d, seed=3)
    k, v = k.to(dtype), v.to(dtype)
    out = quantize_tiles_triton(k.to(DEVICE), v.to(DEVICE), scheme)
    _assert_records_equal(out, quantize_tiles(k, v, scheme), scheme, d)


@pytest.mark.parametrize(("name", "d"), [("kvarn_k4v2_g64", 128), ("kvarn_k3v8_g32_it3_s8", 64)])
def test_store_in_chunks_matches_reference(name: str, d: int) -> None:
    """Several row and column chunks per tile (the GPU configs' streaming), still byte for byte."""
    scheme = Scheme.from_name(name)
    k, v = kv_tiles(2, scheme.group_size, d, seed=9)
    cache = torch.zeros(2, 1, scheme.tile_bytes(d), dtype=torch.uint8, device=DEVICE)
    ids = torch.arange(2, dtype=torch.int32, device=DEVICE)
    store_tiles(k[:, None].to(DEVICE), v[:, None].to(DEVICE), cache, ids, scheme, config=KernelConfig(4, 1, 16, 16))
    _assert_records_equal(cache[:, 0], quantize_tiles(k, v, scheme), scheme, d)


def test_store_into_paged_cache_strided_input_touches_only_its_blocks() -> None:
    scheme = Scheme.from_name("kvarn_k4v4_g32")
    n, h, t, d = 3, 2, 32, 64
    k, v = kv_tiles(n * h, t, d, seed=5)
    # vLLM-like staging [N, T, H, D], viewed as [N, H, T, D] without a copy
    k_nthd = k.view(n, h, t, d).permute(0, 2, 1, 3).contiguous()
    v_nthd = v.view(n, h, t, d).permute(0, 2, 1, 3).contiguous()
    cache = torch.randint(0, 256, (7, h, scheme.tile_bytes(d)), dtype=torch.uint8)
    before = cache.clone()
    blocks = torch.tensor([5, 0, 3], dtype=torch.int32)
    cache_dev = cache.to(DEVICE)
    store_tiles(
        k_nthd.to(DEVICE).permute(0, 2, 1, 3),
        v_nthd.to(DEVICE).permute(0, 2, 1, 3),
        cache_dev,
        blocks.to(DEVICE),
        scheme,
    )
    cache = cache_dev.cpu()
    ref = quantize_tiles(k, v, scheme).view(n, h, -1)
    assert torch.equal(cache[blocks.long()], ref)
    untouched = [i for i in range(7) if i not in blocks.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def test_store_rejects_bad_arguments() -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g32")
    k = torch.randn(1, 1, 32, 64, device=DEVICE)
    cache = torch.zeros(2, 1, scheme.tile_bytes(64), dtype=torch.uint8, device=DEVICE)
    ids = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelArgumentError, match="dtype torch.int32 is not supported"):
        store_tiles(k.int(), k.int(), cache, ids, scheme)
    with pytest.raises(KernelArgumentError, match=r"keys must have shape \[1, 1, 32, 64\]"):
        store_tiles(torch.randn(1, 1, 16, 64, device=DEVICE), k, cache, ids, scheme)
    with pytest.raises(KernelArgumentError, match="contiguous last axis"):
        store_tiles(k.transpose(2, 3).contiguous().transpose(2, 3), k, cache, ids, scheme)
    assert_store_refusals(store_tiles, k, cache, ids, scheme)


@pytest.mark.gpu
def test_store_full_size_tiles_on_gpu() -> None:
    """Full 128 x 128 tiles on CUDA: exact, or (GPU exp/log/sum rounding) >= 99.9% codes equal within one."""
    scheme = BUILTINS["kvarn_k4v2_g128"]
    k, v = kv_tiles(64, 128, 128, seed=11)
    out = quantize_tiles_triton(k.cuda(), v.cuda(), scheme).cpu()
    a, b = decode_records(out, scheme, 128), decode_records(quantize_tiles(k, v, scheme), scheme, 128)
    for x, y in ((a.key_codes, b.key_codes), (a.value_codes, b.value_codes)):
        diff = (x.int() - y.int()).abs()
        assert float((diff == 0).float().mean()) >= 0.999
        assert int(diff.max()) <= 1
