"""tools/bench_kernels.py: exits 0 without a GPU, and its measuring code runs (tiny shapes, interpreter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvarn.bench import kernels
from kvarn.kernels.triton import decode_bytes
from kvarn.schemes import get_scheme

from ._reference import DEVICE


def _once(fn: Callable[[], Any]) -> float:
    fn()
    return 1.0  # "milliseconds": the code path runs, no timing on the interpreter


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_says_so_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert kernels.main(["--quick"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "packed", "sink_rows"),
    [("kvarn_k4v2_g32", 4, 1), ("kvarn_k4v2_g32_sink0", 4, 0), ("kvarn_k4v2_g32_sink", 3, 32)],
)
def test_bench_rows_and_store_line_on_tiny_shapes(name: str, packed: int, sink_rows: int) -> None:
    rows = kernels.bench_shape(_once, name, 2, 128, 4, 2, 64, copy_gbs=1000.0, dev=str(DEVICE))
    kvarn, sdpa = rows[0], rows[1]
    assert kvarn.kernel == "kvarn" and sdpa.kernel.startswith("sdpa-fp16")
    # packed: 2 sequences x 4 tiles (3 beside a sink tile) x 2 heads x 2112-byte records, plus what
    # else the call moves (exact first tokens, query, output, partials of the rotation, metadata,
    # tables) as decode_bytes counts it
    records = 2 * packed * 2 * 2112
    moved = decode_bytes(get_scheme(name), [128, 128], 2, 4, 64, 1, pools=False)
    assert moved.records == records and kvarn.bytes_read == moved.total > records
    assert moved.sinks == 2 * sink_rows * 2 * 64 * 2 * 2  # sequences x rows x heads x D x (K, V) x fp16
    assert sdpa.bytes_read == 2 * 2 * 2 * 128 * 64 * 2  # 16-bit keys and values
    assert kvarn.cells(sdpa.us)[-1] == "1.00x"
    line = kernels.bench_store(_once, name, 2, 2, 64, decode_us=1000.0, dev=str(DEVICE))
    assert line.startswith(f"store {name} batch 2: 1000.0 us for 4 tiles; 100.0% of a decode step")
