"""The ``kvarn`` command: ``kvarn presets`` (and ``kvarn eval`` from the accuracy harness).

Thin: parse arguments, make one library call, print. Library code never reads ``sys.argv``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvarn.schemes import PresetError, SchemeError, UnknownSchemeError, list_presets, preset_problems
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS


def preset_rows(head_dim: int) -> list[dict[str, Any]]:
    """One row per known preset at ``head_dim``: bits, group size, bits/element, compression."""
    rows = []
    for p in list_presets():
        s = p.scheme
        rows.append(
            {
                "name": p.name,
                "scheme": s.name,
                "key_bits": s.key_bits,
                "value_bits": s.value_bits,
                "group_size": s.group_size,
                "rotation": s.rotation,
                "norm_iters": s.norm_iters,
                "scale_dtype": s.scale_dtype,
                "sink_tile": s.sink_tile,
                "head_dim": head_dim,
                "tile_bytes": s.tile_bytes(head_dim),
                "bits_per_element": s.bits_per_element(head_dim),
                "compression": s.compression(head_dim),
                "source": p.source,
            }
        )
    return rows


def _warn_bad_files() -> int:
    """Print one warning per preset file that failed to load; returns how many."""
    problems = preset_problems()
    for p in problems:
        print(f"kvarn: warning: skipped preset file: {p}", file=sys.stderr)
    return len(problems)


def _cmd_presets(args: argparse.Namespace) -> int:
    rows = preset_rows(args.head_dim)
    bad = _warn_bad_files()
    status = 1 if bad and args.strict else 0
    if args.json:
        print(json.dumps(rows, indent=2))
        return status
    print(f"{'name':<28} {'K':>2} {'V':>2} {'group':>5} {'bits/elem':>9} {'vs fp16':>8}  source")
    for r in rows:
        print(
            f"{r['name']:<28} {r['key_bits']:>2} {r['value_bits']:>2} {r['group_size']:>5} "
            f"{r['bits_per_element']:>9.4f} {r['compression']:>7.2f}x  {r['source']}"
        )
    print(f"(head_dim {args.head_dim}; bits/element counts every scale, zero point and factor)")
    if bad:
        print(f"kvarn: {bad} preset file(s) failed to load and were skipped (see the warnings above)", file=sys.stderr)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn", description="KV-cache quantization into packed low-bit tiles.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("presets", help="list every known scheme with its size at a head_dim")
    p.add_argument("--head-dim", type=int, default=128, choices=ALLOWED_HEAD_DIMS, help="head dimension (default 128)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--strict", action="store_true", help="exit with status 1 if any preset file fails to load")
    p.set_defaults(func=_cmd_presets)
    try:  # the accuracy harness adds `kvarn eval` when it is installed
        from kvarn.eval.cli import add_eval_parser
    except ImportError:
        pass
    else:
        add_eval_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UnknownSchemeError, PresetError, SchemeError, ValueError, FileNotFoundError) as e:
        print(f"kvarn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
