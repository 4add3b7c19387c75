"""Compile every kvarn kernel variant for sm_90 / sm_80 with Triton's real compiler (no GPU needed).

Usage::

    python tools/compile_gate.py                      # quick subset: each kernel at each head_dim, both archs
    python tools/compile_gate.py --full --jobs 2      # every preset x head_dim x group x dtype x arch
    python tools/compile_gate.py --arch 90 --json gate.json

Prints a table (kernel, variant, registers, spills, stack frame, shared memory, programs per SM) and
exits 1 when any variant fails to compile, spills registers, has a stack frame (local memory) or
needs more shared memory than one block may have. The library is :mod:`kvarn.bench.compile_gate`.
Compiled kernels are cached by Triton (``~/.triton/cache``), ptxas results beside them, so a second
run takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

# the gate compiles kernels: the interpreter (set by the test suite on CPU) must be off before triton loads
os.environ.pop("TRITON_INTERPRET", None)


def table(rows: list[Any]) -> str:
    """Markdown table of gate rows."""
    head = ["arch", "kernel", "variant", "warps", "registers", "spills (B)", "stack (B)", "smem (KiB)", "programs/SM"]
    head.append("status")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = "ok" if not r.problems else "FAIL: " + "; ".join(r.problems)[:300]
        cells = [f"sm_{r.arch}", r.kernel, r.variant, str(r.warps), str(r.registers), str(r.spill_bytes)]
        cells.append(str(r.stack_bytes))
        cells += [f"{r.smem / 1024:.1f}", str(r.programs_per_sm), status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the whole matrix (long: hours on 2 cores when cold)")
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=[90, 80])
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one variant may compile")
    p.add_argument("--only", default="", help="keep variants whose name matches this regex (e.g. 'decode .* d256')")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)

    from kvarn.bench import compile_gate as gate

    archs = tuple(args.arch)
    variants = gate.full_variants(archs) if args.full else gate.quick_variants(archs)
    variants = [v for v in variants if re.search(args.only, v.name)]
    t0 = time.time()
    rows = []
    for got in gate.compile_variants(variants, args.jobs, args.timeout):
        rows += got
        print("\n".join(table(got).splitlines()[2:]), flush=True)
    failed = [r for r in rows if r.problems]
    print()
    print(table(rows))
    import triton

    print(
        f"\n{len(variants)} variants, {len(rows)} kernels, {len(failed)} failing; triton {triton.__version__}; "
        f"{time.time() - t0:.0f} s"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
