"""The ``kvarn`` command: ``kvarn presets`` (and ``kvarn eval`` from the accuracy harness).

Thin: parse arguments, make one library call, print. Library code never reads ``sys.argv``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvarn.clihelp import DefaultsHelpFormatter
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


class _Parser(argparse.ArgumentParser):
    """``kvarn``'s parsers and subcommand parsers: defaults shown in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def preset_rows(head_dim: int, context: int = DEFAULT_CONTEXT, num_layers: int | None = None) -> list[dict[str, Any]]:
    """One row per known preset at ``head_dim``: bits, group size, bits/element, compression.

    ``bits_per_element``/``compression`` are the packed tiles' alone; the ``*_at_context`` figures
    add the exact sink tokens or sink tile of one sequence of ``context`` tokens. For a preset with
    per-layer overrides they are the mean over the model's layers (:meth:`Scheme.bits_per_element`,
    as ``kvarn-tune`` computes them), over ``num_layers`` layers or else the count its tuning run
    recorded (:attr:`Preset.num_layers`); ``layers`` then lists every layer's bits. Without a layer
    count (``num_layers`` None in the row) the figures are the base layout's.
    """
    rows = []
    for p in list_presets():
        s = p.scheme
        n = (num_layers or p.num_layers) if s.overrides else None
        per_layer = None
        if n is not None:
            bits, at_context = s.layer_bits(head_dim, n), s.layer_bits(head_dim, n, context)
            per_layer = [
                {
                    "layer": i,
                    "key_bits": None if ls is None else ls.key_bits,
                    "value_bits": None if ls is None else ls.value_bits,
                    "unquantized": ls is None,
                    "bits_per_element": bits[i],
                    "bits_per_element_at_context": at_context[i],
                }
                for i, ls in ((i, s.for_layer(i)) for i in range(n))
            ]
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
                "overrides": [
                    {"first": o.first, "last": o.last, "key_bits": o.key_bits, "value_bits": o.value_bits}
                    for o in s.overrides
                ],
                "num_layers": n,
                "bits_per_element": s.bits_per_element(head_dim, n),
                "compression": s.compression(head_dim, n),
                "context": context,
                "bits_per_element_at_context": s.bits_per_element(head_dim, n, context),
                "compression_at_context": s.compression(head_dim, n, context),
                "layers": per_layer,
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


def _cmd_recommend(args: argparse.Namespace) -> int:
    """``kvarn presets --model M``: the presets measured on ``M`` and the one for ``--budget``."""
    from kvarn.autotune.budget import parse_budget
    from kvarn.autotune.recommend import by_scheme, recommend

    budget = parse_budget(args.budget)
    pick = recommend(args.model, budget)
    groups = by_scheme(args.model)
    if args.json:
        measured = [r.to_dict() for g in groups.values() for r in g]
        out = {"model": args.model, "budget": budget.to_dict(), "scheme": pick.scheme, "holds": pick.holds,
               "closest": pick.closest, "bits_per_element": pick.bits_per_element, "measured": measured}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    lengths = sorted({r.tokens for g in groups.values() for r in g})
    print(f"{'scheme':<48} {'bits/elem':>9} " + " ".join(f"{'KL@' + str(n) + ' [90%]':>26}" for n in lengths))
    for scheme, g in groups.items():
        at = {r.tokens: r for r in g}
        cells = [at[n].kl_text if n in at else "-" for n in lengths]
        mark = "  <- " + budget.text if scheme == pick.scheme else ""
        print(f"{scheme:<48} {g[-1].bits_per_element:>9.3f} " + " ".join(f"{c:>26}" for c in cells) + mark)
    print(pick.sentence())
    print("(measured in decode mode against the 16-bit cache on the bundled text: docs/guide/presets.md)")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _cmd_recommend(args)
    if args.context < 1:
        raise ValueError(f"--context {args.context} must be >= 1 token")
    if args.num_layers is not None and args.num_layers < 1:
        raise ValueError(f"--num-layers {args.num_layers} must be >= 1")
    rows = preset_rows(args.head_dim, args.context, args.num_layers)
    bad = _warn_bad_files()
    status = 1 if bad and args.strict else 0
    if args.json:
        print(json.dumps(rows, indent=2))
        return status
    sink = {True: "tile"}
    print(
        f"{'name':<28} {'K':>2} {'V':>2} {'group':>5} {'sink':>4} {'layers':>6} {'bits/elem':>9} {'vs fp16':>8} "
        f"{'@' + str(args.context):>9} {'vs fp16':>8}  source"
    )
    for r in rows:
        layers = "-" if not r["overrides"] else "?" if r["num_layers"] is None else str(r["num_layers"])
        print(
            f"{r['name']:<28} {r['key_bits']:>2} {r['value_bits']:>2} {r['group_size']:>5} "
            f"{sink.get(r['sink_tile'], str(r['sink_tokens'])):>4} {layers:>6} {r['bits_per_element']:>9.4f} "
            f"{r['compression']:>7.2f}x {r['bits_per_element_at_context']:>9.4f} {r['compression_at_context']:>7.2f}x  "
            f"{r['source']}"
        )
    print(
        f"(head_dim {args.head_dim}; bits/element counts every scale, zero point and factor; sink: exact first "
        f"tokens per sequence (tile: the first tile), counted in the @{args.context} columns over a sequence of "
        f"{args.context} tokens; layers: a preset with per-layer overrides is averaged over that many layers, "
        "as kvarn-tune does ('?': no layer count recorded, the base layers' figures; pass --num-layers); "
        "--json lists every layer)"
    )
    if bad:
        print(f"kvarn: {bad} preset file problem(s): see the warnings above", file=sys.stderr)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvarn", description="KV-cache quantization into packed low-bit tiles.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("presets", help="list every known scheme with its size at a head_dim")
    p.add_argument("--head-dim", type=int, default=128, choices=ALLOWED_HEAD_DIMS, help="head dimension (default 128)")
    p.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        help=f"tokens per sequence the exact sink tokens are spread over (default {DEFAULT_CONTEXT})",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        help="layers to average presets with per-layer overrides over (default: the count their tuning run recorded)",
    )
    p.add_argument(
        "--model",
        help="recommend for this model: the presets measured on it and the one of fewest bits within --budget",
    )
    p.add_argument(
        "--budget",
        default="kl=0.01",
        help="with --model: 'kl=0.01' (mean KL to the 16-bit cache) or '1%%' (perplexity increase)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list (with per-layer bits) instead of a table")
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
