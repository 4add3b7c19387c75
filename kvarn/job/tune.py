"""``make run`` step: tune a preset for the default model in a setting that fits in minutes.

The setting (:data:`FAST`): a KL budget (the stable measure on short texts), the ``ladder`` search
(one precision for all layers, bisected: no sensitivity pass), 768 tokens of each of the two
calibration documents (GPL-3 and kvarn's own code) and of the two held-out ones (the two halves of
Python's documentation, a kind the search never saw). The ladder bounds the work at seven
measurements of 1536 tokens and gives the same preset whatever the machine's load. Its time, how
often such a winner breaks the budget on unseen text, and the full-size runs are in
docs/tuning.md. The preset goes to the user preset directory (or ``--out``), so the serving step
that follows loads it by name.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.cli import main as tune_main
from kvarn.autotune.config import derived_name

BUDGET = "kl=0.01"
FAST = (
    "--strategy", "ladder", "--no-search-tiles", "--tokens", "1536", "--confirm", "2", "--no-compare-builtin", "--quiet",
)  # fmt: skip


def tune_default(model: str = "smollm2-135m", budget: str = BUDGET, out: str | None = None) -> str | None:
    """Run the fast study; returns the preset's name, or None when no preset was written."""
    name = derived_name(model, parse_budget(budget))
    argv = ["--model", model, "--budget", budget, "--name", name, *FAST]
    if out:
        argv += ["--out", out]
    return name if tune_main(argv) == 0 else None


def describe(budget: str = BUDGET) -> str:
    """The fast setting in one line, as the step prints it."""
    return (
        f"budget {budget} (mean KL vs the 16-bit cache, held-out text), kvarn-tune {' '.join(FAST)} "
        "(a shorter search than the default; the full one: kvarn-tune --model MODEL)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvarn.job.tune", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", default=BUDGET)
    parser.add_argument("--out", help="preset directory (default: the user preset directory)")
    args = parser.parse_args(argv)
    print(f"== kvarn-tune: {args.model}, {describe(args.budget)} ==")
    name = tune_default(args.model, args.budget, args.out)
    if name is None:
        print("kvarn-tune wrote no preset (its message is above)")
        return 1
    print(f"tuned preset: {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
