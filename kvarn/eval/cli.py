"""``kvarn eval``: measure schemes in decode mode on a real model; table, JSON and Pareto plot.

``--task perplexity`` (default) scores the text; ``--task needle`` retrieves a hidden pass key
(:mod:`kvarn.eval.needle`); ``--task drift`` follows free-running generation (:mod:`kvarn.eval.drift`);
``--task freerun`` scores free-running text from shipped prompts (:mod:`kvarn.eval.freerun`).
Thin: parse arguments, make library calls (:class:`kvarn.eval.harness.Evaluator`, the tasks), print.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from kvarn.baselines import VLLM033
from kvarn.eval import drift, freerun, needle
from kvarn.eval.bos import BOS_CHOICES
from kvarn.eval.harness import EvalResult, Evaluator
from kvarn.eval.report import (
    Result,
    format_drift_table,
    format_freerun_table,
    format_needle_table,
    format_table,
    plot_pareto,
    write_json,
)
from kvarn.hf import FP16, baselines, resolve_spec
from kvarn.models import DEVICES, DTYPES, parse_device
from kvarn.schemes import BUILTINS

GROUPS = ("all", "kvarn", "baselines", "vllm")
TASKS = ("perplexity", "needle", "drift", "freerun")


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


def add_count(p: argparse.ArgumentParser, flag: str, minimum: int, default: int, what: str) -> None:
    """Add the option ``flag``: an integer of at least ``minimum``, ``default`` when absent; its help is
    ``what`` and the default."""
    p.add_argument(flag, type=_positive(flag, minimum), default=default, help=f"{what} (default {default})")


def _lengths(text: str) -> list[int]:
    """``--lengths``: comma-separated token counts, each at least 64."""
    out = []
    for item in text.split(","):
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--lengths takes comma-separated token counts (e.g. 2048,4096,8192); {item!r} is not one"
            ) from None
        if value < 64:
            raise argparse.ArgumentTypeError(f"--lengths: {value} is too short; each length must be >= 64 tokens")
        out.append(value)
    return out


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``kvarn eval`` to ``kvarn``'s subcommands."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "eval",
        help="measure schemes in decode mode on a real model (perplexity and KL, needle retrieval, drift)",
        description="The text is fed through the quantized cache in chunks, as a server fills tiles; every "
        "scheme is compared with fp16 on the same tokens.",
    )
    p.add_argument(
        "--task",
        default="perplexity",
        choices=TASKS,
        help="perplexity: score the text (perplexity, KL, top-1, greedy agreement; default); needle: retrieve a "
        "5-digit pass key hidden at --depths depths of --lengths-token prompts; drift: generate --drift-tokens "
        "greedily from --prompts prompts, tokens until the first divergence from fp16 and KL along the way; freerun: "
        "generate --freerun-tokens greedily and sampled from the shipped prompts, repetition, distinct-2, divergence "
        "and perplexity against fp16's",
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
    add_count(p, "--tokens", 2, 2048, "first N tokens")
    add_count(p, "--chunk", 1, 128, "tokens per forward pass")
    p.add_argument(
        "--greedy-tokens", type=_positive("--greedy-tokens", 0), default=256, help="greedy continuation (0: none)"
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=list(needle.DEFAULT_LENGTHS),
        help="needle: prompt lengths in tokens (default 2048,4096,8192)",
    )
    add_count(p, "--depths", 1, needle.DEFAULT_DEPTHS, "needle: depths per length, evenly spaced from start to end")
    p.add_argument(
        "--prompts",
        type=_positive("--prompts", 1),
        help=f"drift: prompts (default {drift.DEFAULT_PROMPTS}); freerun: the first N shipped prompts of --kinds "
        "(default all)",
    )
    add_count(p, "--prompt-tokens", 1, drift.DEFAULT_PROMPT_TOKENS, "drift: tokens per prompt, from the text")
    add_count(p, "--drift-tokens", 1, drift.DEFAULT_TOKENS, "drift: tokens generated from each prompt")
    add_count(p, "--freerun-tokens", 4, freerun.DEFAULT_TOKENS, "freerun: tokens generated per prompt and mode")
    p.add_argument(
        "--kinds",
        type=lambda t: t.split(","),
        default=list(freerun.KINDS),
        help=f"freerun: prompt kinds, comma-separated (default {','.join(freerun.KINDS)})",
    )
    p.add_argument(
        "--json",
        type=Path,
        help="write one JSON object per scheme to this file, rewritten as each scheme finishes (an interrupted "
        "run keeps the finished rows)",
    )
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


def write_rows(rows: list[Result], path: Path, meta: dict[str, Any]) -> None:
    """Write ``rows`` to ``path`` as :func:`~kvarn.eval.report.write_json` does, atomically: into a
    file beside it, then renamed over it, so that a run killed at any moment leaves either the rows
    before this one or all of them, never a truncated file."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        write_json(rows, part, meta)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def checked_schemes(args: argparse.Namespace) -> list[str]:
    """The scheme names ``args`` asks for, after every check that needs no model: scheme names,
    device, ``--plot`` with the task, ``--text`` a file.

    Raises:
        ValueError, UnknownSchemeError, PresetError, FileNotFoundError: naming the bad value.
    """
    names = expand_schemes(args.schemes)
    for n in names:
        resolve_spec(n)  # unknown names fail before the model loads
    parse_device(args.device)  # so does cuda without CUDA
    if args.plot and args.task != "perplexity":
        raise ValueError(f"--plot draws bits/element vs KL of --task perplexity, not of --task {args.task}")
    if args.task in ("needle", "freerun") and FP16 not in names:
        names.insert(0, FP16)  # the 16-bit row belongs beside every other
    if args.text is not None and not args.text.is_file():
        raise FileNotFoundError(f"--text {args.text}: no such file")
    return names


def run_eval(args: argparse.Namespace) -> int:
    """The ``kvarn eval`` command. Bad input raises (``kvarn`` prints it and exits with 2)."""
    names = checked_schemes(args)
    text = None if args.text is None else args.text.read_text(encoding="utf-8")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = {"perplexity": args.tokens, "needle": max(args.lengths), "drift": 10**9, "freerun": 10**9}[args.task]
    # the evaluator's settings, recorded as given in the JSON
    settings = {"chunk": args.chunk, "device": args.device, "dtype": args.dtype, "bos": args.bos}
    ev = Evaluator(args.model, text, tokens=tokens, greedy_tokens=args.greedy_tokens, **settings)
    if args.task == "perplexity" and ev.tokens < args.tokens:
        print(f"kvarn eval: note: the text has only {ev.tokens} tokens; evaluating all of them", file=sys.stderr)
    meta: dict[str, Any] = {
        "task": args.task,
        "model": args.model,
        "text": str(args.text) if args.text else "gpl-3 + apache-2.0 (bundled)",
        "text_sha256": ev.text_sha256,
        **settings,
        "bos_prepended": ev.bos,
    }
    done: list[Result] = []

    def save(r: Result) -> None:  # after every scheme, so a long run keeps what it measured
        done.append(r)
        if args.json:
            write_rows(done, args.json, meta)

    progress = not args.no_progress
    where = f"{args.dtype} on {args.device}; BOS {'prepended' if ev.bos else 'not prepended'}, --bos {args.bos}"

    def show(what: str, table: str) -> None:
        print(f"{args.model}, {what} (decode mode; {where})")
        print(table)

    if args.task == "needle":
        task = needle.NeedleTask(ev, args.lengths, args.depths)
        found = task.evaluate_all(names, progress=progress, on_result=save)
        lengths = ", ".join(map(str, task.lengths))
        what = f"needle: pass key at {len(task.depths)} depths of {lengths}-token prompts, chunk {args.chunk}"
        show(what, format_needle_table(found, markdown=args.markdown))
    elif args.task == "drift":
        prompts = args.prompts or drift.DEFAULT_PROMPTS
        dt = drift.DriftTask(ev, prompts, args.prompt_tokens, args.drift_tokens)
        runs = dt.evaluate_all(names, progress=progress, on_result=save)
        what = (
            f"drift: {args.drift_tokens} greedy tokens after each of {prompts} prompts of {args.prompt_tokens} "
            f"tokens, chunk {args.chunk}"
        )
        show(what, format_drift_table(runs, markdown=args.markdown))
    elif args.task == "freerun":
        ft = freerun.FreerunTask(ev, args.prompts, args.freerun_tokens, args.kinds)
        free = ft.evaluate_all(names, progress=progress, on_result=save)
        what = (
            f"freerun: {args.freerun_tokens} tokens greedy and sampled (temperature {freerun.TEMPERATURE}, top-p "
            f"{freerun.TOP_P}, seed {freerun.SEED}) from {len(ft.prompts)} prompts, chunk {args.chunk}; mean [95% "
            "bootstrap interval over prompts]"
        )
        show(what, format_freerun_table(free, markdown=args.markdown))
    else:
        meta["greedy_tokens"] = args.greedy_tokens
        results: list[EvalResult] = ev.evaluate_all(names, progress=progress, on_result=save)
        what = f"{ev.tokens} tokens, chunk {args.chunk}, greedy {args.greedy_tokens}"
        show(what, format_table(results, markdown=args.markdown))
        if args.plot:
            plot_pareto(results, args.plot, title=f"{args.model}, {ev.tokens} tokens, decode mode (chunk {args.chunk})")
            print(f"plot: {args.plot}")
    if args.json:
        print(f"json: {args.json}")
    return 0
