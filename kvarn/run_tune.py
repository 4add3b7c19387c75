"""``make run`` step: tune a preset for the default model at a 1% perplexity budget, fast setting.

A small study (few trials, short texts) that finishes in minutes on 2 CPU cores; the full-size run
and its measurements are in docs/tuning.md. The preset goes to the user preset directory (or
``--out``), so the serving steps that follow load it by name.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.cli import main as tune_main
from kvarn.autotune.config import derived_name

FAST = ("--tokens", "512", "--trials", "8", "--sensitivity-tokens", "192", "--confirm", "2", "--group-sizes", "64,128")


def tune_default(model: str = "smollm2-135m", budget: str = "1%", out: str | None = None) -> str | None:
    """Run the fast study; returns the preset's name, or None when no preset was written."""
    name = derived_name(model, parse_budget(budget))
    argv = ["--model", model, "--budget", budget, "--name", name, *FAST]
    if out:
        argv += ["--out", out]
    return name if tune_main(argv) == 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvarn.run_tune", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", default="1%")
    parser.add_argument("--out", help="preset directory (default: the user preset directory)")
    args = parser.parse_args(argv)
    print(f"== kvarn-tune: {args.model} within {args.budget} perplexity (fast setting: {' '.join(FAST)}) ==")
    name = tune_default(args.model, args.budget, args.out)
    if name is None:
        print(
            "kvarn-tune found no preset within the budget in the fast setting (its short texts are too noisy for a 1% budget)"
        )
        return 0
    print(f"tuned preset: {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
