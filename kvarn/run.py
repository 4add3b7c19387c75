"""``make run``: kvarn's main job on the embedded default model, as a sequence of steps.

Steps (each a function ``(args) -> exit code``, run in order; later features append theirs):

1. ``presets``  -- the scheme table at the model's head_dim (64 for SmolLM2-135M).
2. ``accuracy`` -- ``kvarn eval`` in decode mode for fp16, the kvarn presets and the baselines.

The default accuracy run is shortened (1024 tokens, 64 greedy tokens: minutes on 2 cores);
``--full`` is the measurement behind docs/accuracy.md (2048 tokens, 256 greedy tokens).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from kvarn.cli import main as kvarn_main

Step = Callable[[argparse.Namespace], int]


def step_presets(args: argparse.Namespace) -> int:
    """The preset table at head_dim 64 (SmolLM2-135M)."""
    return kvarn_main(["presets", "--head-dim", "64"])


def step_accuracy(args: argparse.Namespace) -> int:
    """``kvarn eval`` on the default model and text; prints the table."""
    tokens, greedy = (2048, 256) if args.full else (args.tokens, args.greedy_tokens)
    argv = ["eval", "--model", args.model, "--schemes", args.schemes, "--tokens", str(tokens)]
    argv += ["--chunk", str(args.chunk), "--greedy-tokens", str(greedy), "--threads", str(args.threads)]
    if args.json:
        argv += ["--json", args.json]
    if args.plot:
        argv += ["--plot", args.plot]
    return kvarn_main(argv)


STEPS: list[tuple[str, Step]] = [("presets", step_presets), ("accuracy", step_accuracy)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvarn.run", description="kvarn's main job (make run).")
    p.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    p.add_argument("--schemes", default="all", help="schemes for the accuracy step (default: all)")
    p.add_argument("--tokens", type=int, default=1024, help="accuracy step: tokens of the text (default 1024)")
    p.add_argument("--greedy-tokens", type=int, default=64, help="accuracy step: greedy continuation (default 64)")
    p.add_argument("--chunk", type=int, default=128, help="accuracy step: tokens per forward pass (default 128)")
    p.add_argument("--full", action="store_true", help="the docs/accuracy.md measurement: 2048 tokens, greedy 256")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: robust on shared 2-core machines)")
    p.add_argument("--json", help="accuracy step: write the results as JSON here")
    p.add_argument("--plot", help="accuracy step: write the Pareto plot (PNG) here")
    names = [n for n, _ in STEPS]
    p.add_argument("--skip", action="append", default=[], choices=names, help="skip a step (repeatable)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc = 0
    for name, step in STEPS:
        if name in args.skip:
            continue
        print(f"\n== step: {name} ==", flush=True)
        t0 = time.perf_counter()
        code = step(args)
        print(f"== {name}: {'ok' if code == 0 else f'exit {code}'} in {time.perf_counter() - t0:.0f} s ==", flush=True)
        rc = rc or code
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
