"""The ``kvarn`` command: ``kvarn presets`` (and ``kvarn eval`` from the accuracy harness).

Thin: parse arguments, make one library call, print. Library code never reads ``sys.argv``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvarn.schemes import (
    PresetError,
    SchemeError,
    UnknownSchemeError,
    list_presets,
    preset_clashes,
    preset_problems,
)
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS

DEFAULT_CONTEXT = 8192  # tokens per sequence the per-sequence sink cost is spread over in `kvarn presets`


def preset_rows(head_dim: int, context: int = DEFAULT_CONTEXT) -> list[dict[str, Any]]:
    """One row per known preset at ``head_dim``: bits, group size, bits/element, compression.

    ``bits_per_element``/``compression`` are the packed tiles' alone; the ``*_at_context`` figures
    add the exact sink tokens or sink tile of one sequence of ``context`` tokens.
    """
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
                "sink_tokens": s.sink_tokens,
                "head_dim": head_dim,
                "tile_bytes": s.tile_bytes(head_dim),
                "bits_per_element": s.bits_per_element(head_dim),
                "compression": s.compression(head_dim),
                "context": context,
                "bits_per_element_at_context": s.bits_per_element(head_dim, context=context),
                "compression_at_context": s.compression(head_dim, context=context),
                "source": p.source,
            }
        )
    return rows


def _warn_bad_files() -> int:
    """Print one warning per preset file that failed to load and per name that several files
    define; returns how many."""
    problems = preset_problems()
    for p in problems:
        print(f"kvarn: warning: skipped preset file: {p}", file=sys.stderr)
    clashes = preset_clashes()
    for c in clashes:
        print(f"kvarn: warning: {c}", file=sys.stderr)
    return len(problems) + len(clashes)


def _cmd_presets(args: argparse.Namespace) -> int:
    if args.context < 1:
        raise ValueError(f"--context {args.context} must be >= 1 token")
    rows = preset_rows(args.head_dim, args.context)
    bad = _warn_bad_files()
    status = 1 if bad and args.strict else 0
    if args.json:
        print(json.dumps(rows, indent=2))
        return status
    sink = {True: "tile"}
    print(
        f"{'name':<28} {'K':>2} {'V':>2} {'group':>5} {'sink':>4} {'bits/elem':>9} {'vs fp16':>8} "
        f"{'@' + str(args.context):>9} {'vs fp16':>8}  source"
    )
    for r in rows:
        print(
            f"{r['name']:<28} {r['key_bits']:>2} {r['value_bits']:>2} {r['group_size']:>5} "
            f"{sink.get(r['sink_tile'], str(r['sink_tokens'])):>4} {r['bits_per_element']:>9.4f} "
            f"{r['compression']:>7.2f}x {r['bits_per_element_at_context']:>9.4f} {r['compression_at_context']:>7.2f}x  "
            f"{r['source']}"
        )
    print(
        f"(head_dim {args.head_dim}; bits/element counts every scale, zero point and factor; sink: exact first "
        f"tokens per sequence (tile: the first tile), counted in the @{args.context} columns over a sequence of "
        f"{args.context} tokens)"
    )
    if bad:
        print(f"kvarn: {bad} preset file problem(s): see the warnings above", file=sys.stderr)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn", description="KV-cache quantization into packed low-bit tiles.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("presets", help="list every known scheme with its size at a head_dim")
    p.add_argument("--head-dim", type=int, default=128, choices=ALLOWED_HEAD_DIMS, help="head dimension (default 128)")
    p.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        help=f"tokens per sequence the exact sink tokens are spread over (default {DEFAULT_CONTEXT})",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 if any preset file fails to load or two files define one name",
    )
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
