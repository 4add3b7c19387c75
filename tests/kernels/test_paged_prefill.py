"""Prefill through vLLM's CPU attention kernel (kvarn.kernels.cpu.paged_prefill) against the float
reference, against the flash path, and bit for bit against itself however a prompt is chunked and
batched (the properties ``tests/vllm/test_tile_causal.py`` and ``test_cpu.py`` pin for the path that
runs without vLLM)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from kvarn.kernels import KernelArgumentError
from kvarn.kernels.cpu import ops as cpu
from kvarn.kernels.cpu import paged_prefill

from . import test_cpu

pytestmark = pytest.mark.vllm

CASES = [
    ("kvarn_k4v2_g128", 0),
    ("kvarn_k4v2_g128", 1),  # sink tokens: tile 0 read with its exact first row
    ("kvarn_k4v4_g64", 4),
    ("kvarn_k3v2_g32_rot-rh_s8", 4),
    ("kvarn_k8v8_g32_rot-rh_s8", 2),
    ("kvarn_k4v2_g32_sink", 0),  # a sink tile: a block of its own, or the first exact rows while partial
]


@pytest.fixture(scope="module", autouse=True)
def vllm_ops() -> None:
    # vLLM loads the build of its CPU ops for this CPU (vllm._C needs AVX-512 BF16: importing it
    # elsewhere kills the process) and registers torch.ops._C.cpu_attention_with_kv_cache
    pytest.importorskip("vllm._custom_ops")
    if paged_prefill.engine(torch.float32, 32, 64) is None:
        pytest.skip("vLLM's CPU attention ops are not registered on this machine")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ISA of every call of the vLLM path (so that a test knows it ran)."""
    seen: list[str] = []
    real = paged_prefill.prefill

    def counted(*args: object) -> torch.Tensor:
        seen.append(str(args[6]))  # the ISA
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_prefill, "prefill", counted)
    yield seen


def _sqnr(impl: str, name: str, sink_tokens: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> float:
    with monkeypatch.context() as m:
        m.setattr(cpu, "prefill_attention", functools.partial(cpu.prefill_attention, impl=impl))
        return test_cpu._prefill_sqnr(name, sink_tokens, True, dtype)


@pytest.mark.parametrize(("name", "sink_tokens"), CASES)
def test_vllm_path_matches_the_reference_as_the_flash_path_does(
    name: str, sink_tokens: int, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for dtype, floor in ((torch.float32, test_cpu.MIN_SQNR_DB), (torch.bfloat16, 40.0)):
        vllm = _sqnr("vllm", name, sink_tokens, dtype, monkeypatch)
        flash = _sqnr("flash", name, sink_tokens, dtype, monkeypatch)
        assert vllm >= floor, dtype
        assert vllm >= flash - 1.0, (dtype, vllm, flash)  # within a dB of the other path
    assert calls, "the vLLM path never ran"


def test_auto_takes_the_vllm_path_where_it_is_loaded(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert _sqnr("auto", "kvarn_k4v2_g32", 0, torch.bfloat16, monkeypatch) >= 40.0
    assert calls and set(calls) <= {"amx", "vec", "vec16"}


def test_segments_of_several_requests_equal_each_segment_alone(calls: list[str]) -> None:
    test_cpu.test_prefill_segments_of_several_requests_equal_each_segment_alone()
    assert calls


def test_outputs_do_not_depend_on_chunking_or_the_step_composition(calls: list[str]) -> None:
    """The tile-causal tests of the backend's step planner, through the vLLM path: bfloat16 outputs
    bit-identical however a prompt is chunked and whatever shares its steps."""
    tile_causal = pytest.importorskip("tests.vllm.test_tile_causal")
    tile_causal.test_outputs_do_not_depend_on_chunking()
    for scheme in (
        tile_causal.Scheme(4, 2, tile_causal.T, sink_tokens=1),
        tile_causal.Scheme(4, 2, tile_causal.T, sink_tile=True),
    ):
        tile_causal.test_prefill_chunks_decode_and_mixed_steps_are_tile_causal(scheme)
        for steps in tile_causal.COMPOSITIONS.values():
            tile_causal.test_bfloat16_outputs_do_not_depend_on_the_step_composition(scheme, steps)
    assert "amx" in calls or not torch.cpu._is_amx_tile_supported()


def test_unknown_impl_is_refused_with_the_allowed_ones() -> None:
    q = torch.zeros(1, 1, 64)
    with pytest.raises(KernelArgumentError, match="impl='fast' is not one of: auto, flash, vllm"):
        cpu.prefill_attention(q, q, q, torch.tensor([0, 1], dtype=torch.int32), None, impl="fast")  # type: ignore[arg-type]
