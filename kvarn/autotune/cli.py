"""``kvarn-tune``: the smallest KV cache that keeps a model within an accuracy budget.

Example::

    kvarn-tune --model smollm2-135m --budget kl=0.01 --storage sqlite:///study.db

Exit codes: 0 a preset was written; 1 bad arguments; 2 the budget is unreachable in the trials run
(the closest trade-off is printed); 3 no calibration winner held on held-out text; 130 interrupted
(Ctrl-C: one line with how to resume).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvarn.autotune.budget import BudgetError, parse_budget
from kvarn.autotune.config import STRATEGIES, TuneConfig, derived_name
from kvarn.autotune.corpus import CALIBRATION_DOCS, HELDOUT_DOCS, parse_names
from kvarn.autotune.report import check_writable, plot_front, summary_table, to_json, write_presets
from kvarn.autotune.result import Outcome
from kvarn.autotune.search import resume_hint
from kvarn.autotune.space import SINK_CHOICES, SINKS
from kvarn.autotune.storecost import OBJECTIVES
from kvarn.autotune.texts import SPLITS
from kvarn.autotune.tuner import model_dims, tune
from kvarn.clihelp import DefaultsHelpFormatter

EXIT_CODES: dict[Outcome, int] = {
    Outcome.OK: 0,
    Outcome.UNREACHABLE: 2,
    Outcome.UNCONFIRMED: 3,
    Outcome.INTERRUPTED: 130,
}
MAX_PPL_BUDGET = 100.0  # percent: a perplexity budget is an increase of at most double
_NEGATIVE_BUDGET_RE = re.compile(r"\s*(?:(?:ppl|kl|greedy)\s*=\s*)?-", re.IGNORECASE)
# TuneConfig fields taken from the flag of the same name unchanged (the rest are parsed in _config)
_FLAGS_AS_GIVEN = (
    "model", "tokens", "holdout", "split", "strategy", "trials", "timeout", "seed", "storage", "study_name", "pareto",
    "allow_kv_inversion", "allow_fp16_layers", "search_tiles", "context", "max_protect", "prune_tokens", "prune_slack",
    "sensitivity_tokens", "cache_dir", "confirm", "device", "dtype", "feasibility", "objective",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvarn-tune",
        description="Search kvarn schemes (bits, tiles, scales, per-layer precision) for the fewest bits per element "
        "within an accuracy budget, confirm the winner on held-out text, and write it as a preset.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    p.add_argument(
        "--budget",
        default="kl=0.01",
        help="'kl=0.01' (mean KL divergence in nats, above 0; the default and the recommended form: it varies "
        "far less between texts than perplexity, docs/tuning.md), '1%%' or 'ppl=1%%' (perplexity increase in "
        "percent, above 0 and at most 100) or 'greedy=200' (greedy tokens that agree with the 16-bit cache, a "
        "whole number above 0; needs --text)",
    )
    p.add_argument(
        "--text",
        type=Path,
        help="one text file, split by paragraphs into calibration and held-out parts (--holdout, --split) "
        "instead of the documents below",
    )
    p.add_argument(
        "--calibration-docs",
        default=",".join(CALIBRATION_DOCS),
        help="documents the search calibrates on, comma list: gpl-3, apache-2.0 (legal), kvarn-code[:<package>] "
        "(code), python-docs[:<i>/<n>] (docs), <kind>=<path> (any text file)",
    )
    p.add_argument(
        "--heldout-docs",
        default=",".join(HELDOUT_DOCS),
        help="documents the winner is confirmed on (default: a kind the calibration does not hold)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens evaluated on each part, shared by its documents (default 4096: the more tokens, the tighter "
        "the confidence bound that decides feasibility)",
    )
    p.add_argument("--holdout", type=float, default=0.5, help="--text: fraction of the text held out (default 0.5)")
    p.add_argument(
        "--split",
        choices=SPLITS,
        default=SPLITS[0],
        help="--text: interleaved (default): alternate paragraphs go to calibration and held-out, so both sample the "
        "whole text; contiguous: the first part calibrates, the last part is held out",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=STRATEGIES[0],
        help="allocate (default): bisect per-layer mixes of two bit pairs (k4v2/k4v3, k4v3/k4v4; fp16 or log8 "
        "scales) over the layers ranked by sensitivity; ladder: bisect one precision for all layers (k3v2 to "
        "k8v8, fp16 or log8 scales; no sensitivity pass, the fastest); tpe: Optuna's TPE over bits, tiles, "
        "rotation, scales, sinks and layer tiers",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=30,
        help="measured trials at most (resumed ones included); pruned-unmeasured trials are free",
    )
    p.add_argument("--timeout", type=float, help="stop starting new trials after this many seconds")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (same seed, same result)")
    p.add_argument("--storage", help="Optuna storage URL, e.g. sqlite:///study.db (resumable)")
    p.add_argument("--study-name", help="default: derived from model, text, budget, space and seed")
    p.add_argument("--name", help="preset name (default kvarn_<model>_<budget>)")
    p.add_argument("--out", type=Path, help="preset directory (default: the user preset directory)")
    p.add_argument("--plot", type=Path, help="Pareto plot PNG (default <out>/<name>.png)")
    p.add_argument("--pareto", action="store_true", help="measure the whole front; write a preset per front point")
    p.add_argument("--json", action="store_true", help="print the result as JSON (the table goes to stderr)")
    p.add_argument("--allow-kv-inversion", action="store_true", help="allow fewer key bits than value bits")
    p.add_argument(
        "--sinks",
        default=",".join(SINKS),
        help="sink choices to search, comma list: 0 (none), 1, 2, 4, 8 (first tokens also kept exactly), "
        "tile (first tile unquantized)",
    )
    p.add_argument("--no-sink", action="store_true", help="search no sink at all (same as --sinks 0)")
    p.add_argument(
        "--context",
        type=int,
        help="tokens per sequence the per-sequence sink cost is spread over when counting bits/element "
        "(default: --tokens, which is conservative for long-context serving)",
    )
    p.add_argument(
        "--allow-fp16-layers",
        action="store_true",
        help="let the most sensitive layers stay unquantized (vLLM serves them in its own 16-bit cache, except in "
        "models with sliding-window layers); without it the top rung is k8v8, near-lossless at half the bytes",
    )
    p.add_argument("--no-per-layer", action="store_true", help="one precision for every layer")
    p.add_argument("--max-protect", type=int, default=4, help="most sensitive layers that may get more bits")
    p.add_argument("--group-sizes", default="32,64,128,256", help="comma list of tile sizes to search")
    p.add_argument(
        "--search-tiles",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ladder and allocate: rungs and families at every --group-sizes size that fits the tokens, merged "
        "by bits (the default; --no-search-tiles: the size nearest 128 only; tpe always searches them all)",
    )
    p.add_argument(
        "--prune-tokens",
        type=int,
        default=-1,
        help="tokens of the partial evaluation (-1: half with tpe, off with allocate; 0: off)",
    )
    p.add_argument(
        "--prune-slack", type=float, default=2.0, help="prune when the partial metric exceeds slack x budget"
    )
    p.add_argument("--sensitivity-tokens", type=int, default=256, help="tokens per layer probe (0: no pass)")
    p.add_argument(
        "--feasibility",
        choices=("bound", "point"),
        default="bound",
        help="bound (default): a trial meets the budget when the upper end of its metric's 90%% chunk-bootstrap "
        "interval does; point: when its point estimate does (holds less often on unseen text)",
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="bits",
        help="bits (default): the fewest bits per element within the budget; speed: the fastest store (its "
        "measured ns per token, summed over layers; ties: fewer bits) within the budget, with --strategy tpe",
    )
    p.add_argument("--confirm", type=int, default=3, help="candidates tried on held-out text, fewest bits first")
    p.add_argument(
        "--no-compare-builtin",
        action="store_true",
        help="skip measuring the built-in presets nearest the winner's bits on held-out text",
    )
    p.add_argument("--compare", default="", help="comma list of presets/baselines to measure for the plot")
    p.add_argument("--cache-dir", type=Path, help="sensitivity cache (default <kvarn cache>/sensitivity)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda or cuda:<n>")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="model weights and activations (default float32); the reference cache runs in the same dtype",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def text_source(args: argparse.Namespace) -> str:
    """What the preset's provenance says the run was tuned on."""
    if args.text:
        return str(args.text)
    return f"calibration: {args.calibration_docs}; held-out: {args.heldout_docs} (kvarn.autotune.corpus)"


def _fail(msg: str) -> int:
    print(f"kvarn-tune: error: {msg}", file=sys.stderr)
    return 1


def _config(args: argparse.Namespace) -> TuneConfig | str:
    if _NEGATIVE_BUDGET_RE.match(args.budget):
        return f"--budget {args.budget!r}: a budget must be positive (above 0)"
    try:
        budget = parse_budget(args.budget)
    except BudgetError as e:
        return f"--budget: {e}"
    if budget.metric == "ppl" and budget.limit > MAX_PPL_BUDGET:
        return (
            f"--budget {args.budget!r}: a perplexity budget is an increase in percent above 0% and at most "
            f"{MAX_PPL_BUDGET:g}%"
        )
    if args.trials < 1:
        return f"--trials {args.trials} must be >= 1"
    if args.tokens < 64:
        return f"--tokens {args.tokens} is too few to measure anything; use at least 64"
    if not 0.0 < args.holdout < 1.0:
        return f"--holdout {args.holdout} must be strictly between 0 and 1"
    try:
        groups = tuple(int(g) for g in args.group_sizes.split(",") if g.strip())
    except ValueError:
        return f"--group-sizes {args.group_sizes!r} must be a comma list of integers (32,64,128,256)"
    from kvarn.schemes import ALLOWED_GROUP_SIZES

    bad = [g for g in groups if g not in ALLOWED_GROUP_SIZES]
    if bad or not groups:
        return f"--group-sizes {args.group_sizes!r}: allowed {', '.join(map(str, ALLOWED_GROUP_SIZES))}"
    sinks = ("0",) if args.no_sink else tuple(x.strip() for x in args.sinks.split(",") if x.strip())
    if not sinks or any(x not in SINK_CHOICES for x in sinks):
        return f"--sinks {args.sinks!r}: a comma list of {', '.join(SINK_CHOICES)}"
    if args.context is not None and args.context < 1:
        return f"--context {args.context} must be >= 1 token"
    from kvarn.models import parse_device

    try:
        parse_device(args.device)
    except ValueError as e:
        return f"--device: {e}"
    calib_docs, held_docs = parse_names(args.calibration_docs), parse_names(args.heldout_docs)
    if args.text is None and not (calib_docs and held_docs):
        return "--calibration-docs and --heldout-docs each need at least one document"
    if args.text is None and set(calib_docs) & set(held_docs):
        return (
            f"a document cannot be both calibration and held-out: {', '.join(sorted(set(calib_docs) & set(held_docs)))}"
        )
    text = None
    if args.text is not None:
        try:
            text = args.text.read_text()
        except OSError as e:
            return f"--text {args.text}: {e.strerror or e}"
    return TuneConfig(
        budget=budget,
        text=text,
        calibration_docs=calib_docs,
        heldout_docs=held_docs,
        sinks=sinks,
        per_layer=not args.no_per_layer,
        group_sizes=groups,
        compare=tuple(n.strip() for n in args.compare.split(",") if n.strip()),
        compare_builtin=not args.no_compare_builtin,
        progress=not args.quiet,
        **{name: getattr(args, name) for name in _FLAGS_AS_GIVEN},
    )


def _progress_bar(total: int, quiet: bool) -> tuple[Any, Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="kvarn-tune search", unit="trial", disable=quiet)

    def on_trial(evaluated: int, planned: int, best: float | None) -> None:
        if evaluated == 0:  # the search starts (after the sensitivity pass): time it from here
            bar.reset(total=planned)
        bar.set_postfix_str(f"best feasible {best:.4f} bits" if best is not None else "no feasible trial yet")
        bar.total = planned  # the search's estimate of its measurements: tqdm's ETA reads it
        bar.n = evaluated
        bar.refresh()

    return bar, on_trial


_NEGATIVE_RE = re.compile(r"-[0-9.]")


def _budget_value_joined(argv: Sequence[str]) -> list[str]:
    """``--budget -1%`` as ``--budget=-1%``: argparse takes a value starting with '-' for an option
    ("expected one argument"); joined, it reaches the budget check and its message."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "--budget" and _NEGATIVE_RE.match(out[i + 1]):
            out[i : i + 2] = [f"--budget={out[i + 1]}"]
            break
    return out


def _interrupted(storage: str | None) -> int:
    print(f"kvarn-tune: interrupted; {resume_hint(storage)}", file=sys.stderr)
    return EXIT_CODES[Outcome.INTERRUPTED]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_budget_value_joined(sys.argv[1:] if argv is None else argv))
    try:
        return _run(args)
    except KeyboardInterrupt:  # outside the study (sensitivity pass, held-out checks): nothing half-written
        return _interrupted(args.storage)


def _run(args: argparse.Namespace) -> int:
    config = _config(args)
    if isinstance(config, str):
        return _fail(config)
    from kvarn.models import ModelNotFoundError
    from kvarn.schemes import user_preset_dir

    try:
        dims = model_dims(args.model)
    except (ModelNotFoundError, KeyError, OSError) as e:
        return _fail(f"--model {args.model!r}: {e}")
    out_dir = args.out or user_preset_dir()
    try:
        check_writable(out_dir)
    except PermissionError as e:
        return _fail(str(e))
    name = args.name or derived_name(args.model, config.budget)
    bar, on_trial = _progress_bar(config.trials, args.quiet)
    try:
        res = tune(config, dims=dims, on_trial=on_trial)
    except ValueError as e:
        return _fail(str(e))
    finally:
        bar.close()
    written = write_presets(res, name, out_dir, text_source(args))
    plot = None
    if res.trials and (args.plot or written):  # no preset written: nothing left in the preset folder
        plot = plot_front(res, args.plot or out_dir / f"{name}.png")
    code = EXIT_CODES[res.outcome]
    if res.interrupted:
        if args.json:
            print(json.dumps(to_json(res, written, plot, code), indent=2, default=str))
        print(f"kvarn-tune: {res.message}", file=sys.stderr)
        return code
    human = sys.stderr if args.json else sys.stdout  # --json: stdout is JSON only
    print(summary_table(res), file=human)
    for p in written:
        print(f"wrote {p}  (load it by name: {p.stem})", file=human)
    if plot:
        print(f"plot  {plot}", file=human)
    if args.json:
        print(json.dumps(to_json(res, written, plot, code), indent=2, default=str))
    if code:
        print(f"kvarn-tune: {res.message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
