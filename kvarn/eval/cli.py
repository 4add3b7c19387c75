"""``kvarn eval``: measure schemes in decode mode on a real model; table, JSON and Pareto plot.

Thin: parse arguments, make library calls (:class:`kvarn.eval.harness.Evaluator`), print.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from kvarn.baselines import VLLM033
from kvarn.eval.harness import BOS_CHOICES, EvalResult, Evaluator
from kvarn.eval.report import format_table, plot_pareto, write_json
from kvarn.hf import FP16, baselines, resolve_spec
from kvarn.models import DEVICES, DTYPES, parse_device
from kvarn.schemes import BUILTINS

GROUPS = ("all", "kvarn", "baselines", "vllm")


def expand_schemes(spec: str) -> list[str]:
    """Split a comma-separated list; ``kvarn`` = the built-in presets, ``baselines`` = every
    baseline, ``vllm`` = vLLM 0.33's KV dtypes, ``all`` = fp16, then both. Duplicates are dropped, order kept."""
    out: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if item == "all":
            names = [FP16, *BUILTINS, *baselines()]
        elif item == "kvarn":
            names = list(BUILTINS)
        elif item == "vllm":
            names = [b.name for b in VLLM033]
        elif item == "baselines":
            names = list(baselines())
        elif item:
            names = [item]
        else:
            continue
        out += [n for n in names if n not in out]
    if not out:
        raise ValueError(f"--schemes {spec!r} names no scheme")
    return out


def _positive(what: str, minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {value}")
        return value

    return parse


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``kvarn eval`` to ``kvarn``'s subcommands."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "eval",
        help="measure schemes in decode mode on a real model (perplexity, KL, top-1, greedy agreement)",
        description="The text is fed through the quantized cache in chunks, as a server fills tiles; every "
        "scheme is compared with fp16 on the same tokens.",
    )
    p.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    p.add_argument(
        "--schemes",
        default="all",
        help="comma-separated: fp16, kvarn presets/canonical names, baselines; groups: all (default), kvarn, baselines, vllm (vLLM 0.33's KV dtypes)",
    )
    p.add_argument(
        "--text", type=Path, help="UTF-8 text file (default: the bundled GPL-3, then Apache-2.0; 9,881 SmolLM2 tokens)"
    )
    p.add_argument("--tokens", type=_positive("--tokens", 2), default=2048, help="first N tokens (default 2048)")
    p.add_argument("--chunk", type=_positive("--chunk", 1), default=128, help="tokens per forward pass (default 128)")
    p.add_argument(
        "--greedy-tokens", type=_positive("--greedy-tokens", 0), default=256, help="greedy continuation (0: none)"
    )
    p.add_argument("--json", type=Path, help="write one JSON object per scheme to this file")
    p.add_argument("--plot", type=Path, help="write the Pareto plot (bits/element vs KL) to this PNG")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--device", default="cpu", help=f"where the model runs: {', '.join(DEVICES)} or cuda:<n> (default cpu)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=tuple(DTYPES),
        help="model weights and activations (default float32); the fp16 reference runs in the same dtype",
    )
    p.add_argument("--threads", type=_positive("--threads", 0), default=0, help="torch CPU threads (0: default)")
    p.add_argument(
        "--bos",
        default="auto",
        choices=BOS_CHOICES,
        help="prepend the beginning-of-sequence token: auto (the tokenizer's config, default), yes, no",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    """The ``kvarn eval`` command. Bad input raises (``kvarn`` prints it and exits with 2)."""
    names = expand_schemes(args.schemes)
    for n in names:
        resolve_spec(n)  # unknown names fail before the model loads
    parse_device(args.device)  # so does cuda without CUDA
    text = None
    if args.text is not None:
        if not args.text.is_file():
            raise FileNotFoundError(f"--text {args.text}: no such file")
        text = args.text.read_text(encoding="utf-8")
    if args.threads:
        torch.set_num_threads(args.threads)
    ev = Evaluator(
        args.model,
        text,
        tokens=args.tokens,
        chunk=args.chunk,
        greedy_tokens=args.greedy_tokens,
        device=args.device,
        dtype=args.dtype,
        bos=args.bos,
    )
    if ev.tokens < args.tokens:
        print(f"kvarn eval: note: the text has only {ev.tokens} tokens; evaluating all of them", file=sys.stderr)
    meta = {
        "model": args.model,
        "text": str(args.text) if args.text else "gpl-3 + apache-2.0 (bundled)",
        "text_sha256": ev.text_sha256,
        "chunk": args.chunk,
        "greedy_tokens": args.greedy_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "bos": args.bos,
        "bos_prepended": ev.bos,
    }
    done: list[EvalResult] = []

    def save(r: EvalResult) -> None:  # after every scheme, so a long run keeps what it measured
        done.append(r)
        if args.json:
            write_json(done, args.json, meta)

    results = ev.evaluate_all(names, progress=not args.no_progress, on_result=save)
    print(
        f"{args.model}, {ev.tokens} tokens, chunk {args.chunk}, greedy {args.greedy_tokens} (decode mode; "
        f"{args.dtype} on {args.device}; BOS {'prepended' if ev.bos else 'not prepended'}, --bos {args.bos})"
    )
    print(format_table(results, markdown=args.markdown))
    if args.plot:
        plot_pareto(results, args.plot, title=f"{args.model}, {ev.tokens} tokens, decode mode (chunk {args.chunk})")
        print(f"plot: {args.plot}")
    if args.json:
        print(f"json: {args.json}")
    return 0
