"""The model's own compute per token on this CPU: what a serving run costs whatever its KV cache.

Times, with torch's ``linear`` in one dtype and thread count, every linear of one decoder layer
(q, k, v, o, gate, up, down; shapes from the model folder's ``config.json``) and the LM head on
``m`` rows at once, for each ``m`` of ``--rows`` (a prefill chunk: vLLM's CPU default is 2,048
tokens; decode batches: the requests running at once). Prints milliseconds per token of all layers'
linears and of the head, and GFLOP/s, as a Markdown table (``--json`` for machines). The fastest of
``--repeats`` calls counts. ``--doc`` replaces a section of a docs page (``--section``) with the
command, date, commit, machine and table.

A server spends about this per token on the model's linears whichever cache it runs (vLLM's CPU
linears are GEMMs of the same kind; their speed may differ by some percent): a prompt token the
layers' time at the chunk's ``m``, a generated token the layers' and the head's time at the batch's
``m``. Set against a serving run's duration (``tools/bench_serving.py``) this estimates the most any
cache can win on that machine (docs/serving.md)::

    taskset -c 0 python tools/bench_linears.py --model llama1b-shapes --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import commit, machine, measuring_args, utc_stamp, write_section
from kvarn.bench.tables import markdown_table
from kvarn.models import BENCH_MODELS, model_folder


def linear_shapes(config: dict[str, Any]) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """``(one decoder layer's linears as (out, in), the LM head's (vocab, hidden), layers)`` of a
    Llama-style ``config.json`` (grouped-query attention: k and v have ``num_key_value_heads``)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer, (config["vocab_size"], hidden), config["num_hidden_layers"]


def _best_s(calls: list[tuple[Any, Any]], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` passes of ``linear(x, w)`` over ``calls``, after one
    untimed pass (allocation, dispatch, oneDNN/MKL set-up)."""
    import torch

    best = float("inf")
    for k in range(repeats + 1):
        t = time.perf_counter()
        for x, w in calls:
            torch.nn.functional.linear(x, w)
        best = best if k == 0 else min(best, time.perf_counter() - t)
    return best


def time_linears(
    config: dict[str, Any], rows: list[int], dtype: str = "float32", repeats: int = 3
) -> list[dict[str, Any]]:
    """Per ``m`` in ``rows``: ms per token of all layers' linears and of the head, and their GFLOP/s."""
    import torch

    dt = getattr(torch, dtype)
    layer, (vocab, hidden), layers = linear_shapes(config)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen, dtype=dt) for o, i in layer]
    head = torch.randn(vocab, hidden, generator=gen, dtype=dt)
    layer_flops = 2 * sum(o * i for o, i in layer)
    out = []
    for m in rows:
        inputs = {i: torch.randn(m, i, generator=gen, dtype=dt) for _, i in layer}
        calls = [(inputs[i], w) for (_, i), w in zip(layer, weights, strict=True)]
        calls_head = [(torch.randn(m, hidden, generator=gen, dtype=dt), head)]
        t_layer, t_head = _best_s(calls, repeats), _best_s(calls_head, repeats)
        out.append({
            "rows": m,
            "layers_ms_per_token": layers * t_layer / m * 1e3,
            "head_ms_per_token": t_head / m * 1e3,
            "layers_gflops": layer_flops * m / t_layer / 1e9,
            "head_gflops": 2 * vocab * hidden * m / t_head / 1e9,
        })  # fmt: skip
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = ["rows (m)", "layers ms/token", "head ms/token", "layers GFLOP/s", "head GFLOP/s"]
    cells = (
        [str(r["rows"]), f"{r['layers_ms_per_token']:.2f}", f"{r['head_ms_per_token']:.2f}",
         f"{r['layers_gflops']:.1f}", f"{r['head_gflops']:.1f}"]
        for r in results
    )  # fmt: skip
    return markdown_table(head, cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=BENCH_MODELS, default="llama1b-shapes")
    p.add_argument("--layers", type=int, default=4, help="layers of llama1b-shapes (default 4)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--rows", type=int, nargs="+", default=[2048, 48, 32, 16, 8, 1],
                   help="rows per call: a prefill chunk, decode batches (default 2048 48 32 16 8 1)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--doc", type=Path, help="markdown file whose section is replaced (default: none)")
    p.add_argument("--section", default=None, help="doc section name (default linears-MODEL-DTYPE)")
    a = p.parse_args(argv)
    if any(m < 1 for m in a.rows):
        p.error(f"--rows must be positive, got {a.rows}")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    config = json.loads((model_folder(a.model, a.layers) / "config.json").read_text())
    results = time_linears(config, a.rows, a.dtype, a.repeats)
    where = f"{machine()}, {torch.get_num_threads()} torch thread(s)"
    print(f"{a.model}, {a.dtype}, {where}:\n")
    print(table(results))
    if a.doc:
        cmd = "python tools/bench_linears.py " + " ".join(
            measuring_args(argv if argv is not None else sys.argv[1:], ("--json", "--doc", "--section"))
        )
        body = f"Measured {utc_stamp()} at commit {commit()} on {where}:\n\n`{cmd}`\n\n{table(results)}"
        write_section(a.doc, a.section or f"linears-{a.model}-{a.dtype}", body)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "dtype": a.dtype, "threads": torch.get_num_threads(),
                                      "machine": machine(), "rows": results}, indent=1))  # fmt: skip
    return 0
