"""tools/profile_engine.py without an engine: which part a function's time goes to, a real profile split,
the table's ratios."""

from __future__ import annotations

import cProfile
import time
from pathlib import Path

import pytest
import torch

from kvarn.bench import profile_engine as prof

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("file", "name", "part"),
    [
        ("~", "<built-in method torch._C._disabled_torch_function_impl>", "linears"),
        ("~", "<built-in method torch._C._nn.linear>", "linears"),
        ("~", "<built-in method torch._ops._C.onednn_mm>", "linears"),
        ("~", "<built-in method torch._ops._C.weight_packed_linear>", "linears"),
        ("~", "<built-in method torch._ops.aten._scaled_dot_product_flash_attention_for_cpu>", "attention"),
        ("~", "<built-in method torch._ops._C.cpu_attention_with_kv_cache>", "attention"),
        ("~", "<built-in method kvarn_cpu_0123abcd.decode>", "attention"),
        ("~", "<built-in method kvarn_cpu_0123abcd.store>", "cache kernels"),
        ("~", "<built-in method kvarn_cpu_0123abcd.dequant>", "cache kernels"),
        ("~", "<built-in method torch._ops._C.cpu_attn_reshape_and_cache>", "cache kernels"),
        (str(ROOT / "kvarn" / "vllm" / "forward.py"), "run_layer", "kvarn host"),
        ("/site-packages/vllm/v1/core/sched/scheduler.py", "schedule", "other"),
    ],
)
def test_each_function_goes_to_its_part(file: str, name: str, part: str) -> None:
    assert prof.part_of(file, name) == part


def test_a_profile_splits_into_parts_that_add_up() -> None:
    p = cProfile.Profile(time.process_time)
    a = torch.randn(256, 256)
    p.enable()
    for _ in range(20):
        torch.nn.functional.linear(a, a)
    p.disable()
    parts = prof.split(p)
    assert set(parts) == set(prof.PARTS)
    assert parts["linears"] > 0.0
    assert parts["linears"] >= 0.5 * sum(parts.values())


def test_table_ratios_are_against_the_first_cache() -> None:
    def phases(scale: float) -> dict[str, dict[str, float]]:
        parts = {
            "linears": 10.0,
            "attention": 2.0 * scale,
            "cache kernels": 0.5 * scale,
            "kvarn host": 0.0,
            "other": 1.0,
        }
        return dict.fromkeys(prof.PHASES, parts)

    rows = [
        {"kv_cache_dtype": "auto", "phases": phases(2.0)},
        {"kv_cache_dtype": "kvarn_k4v2_g128", "phases": phases(1.0)},
    ]
    lines = prof.table(rows).splitlines()
    assert len(lines) == 2 + 2 * len(prof.PHASES)
    kvarn = [c.strip() for c in lines[3].strip("|").split("|")]
    assert kvarn[:2] == ["miss", "`kvarn_k4v2_g128`"]
    assert kvarn[-3:] == ["13.50", f"{13.5 / 16.0:.2f}x", "0.50x"]  # totals 13.5 vs 16; own work 2.5 vs 5
