"""``make run``: kvarn's main job on the embedded default model, as a sequence of steps.

Steps (each a function ``(args, run) -> exit code``, run in order; later features append theirs;
``run``: the :class:`JobRun` they share):

1. ``presets``  -- the scheme table at the model's head_dim (64 for SmolLM2-135M).
2. ``accuracy`` -- ``kvarn eval`` in decode mode for fp16, the kvarn presets and the baselines.
3. ``tune``     -- ``kvarn-tune`` at a KL budget in a setting that takes minutes
   (:mod:`kvarn.job.tune`); writes a preset into the user preset directory.
4. ``serve``    -- vLLM (when installed) serves the model with exactly the preset file the tune step
   wrote, by its name; only when the tune step is skipped (``--skip tune``), the preset of the
   full tuning run committed in docs/tuned (docs/tuning.md). When the tune step failed, or the
   name resolves to another file (a name clash, see :func:`kvarn.schemes.preset_clashes`), the
   built-in ``kvarn_k4v2_g128`` is served and the step says why. Prints the file, the preset's bits
   per element and held-out figure, the KV capacity gained and a greedy sample whose 432-token
   prompt reaches past the first tile.

The default accuracy run is shortened (1024 tokens, 64 greedy tokens: minutes on 2 cores);
``--full`` is the measurement behind docs/accuracy.md (2048 tokens, 256 greedy tokens).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvarn.cli import main as kvarn_main


@dataclass
class JobRun:
    """What one ``make run`` carries from step to step.

    Attributes:
        tuned: ``(name, file)`` of the preset the tune step wrote, for the serve step.
        tune_ran: the tune step ran (so the serve step never falls back to docs/tuned).
        summary: step -> one line for the final summary.
    """

    tuned: list[tuple[str, Path]] = field(default_factory=list)
    tune_ran: bool = False
    summary: dict[str, str] = field(default_factory=dict)


Step = Callable[[argparse.Namespace, JobRun], int]


def step_presets(args: argparse.Namespace, run: JobRun) -> int:
    """The preset table at head_dim 64 (SmolLM2-135M)."""
    return kvarn_main(["presets", "--head-dim", "64"])


def step_accuracy(args: argparse.Namespace, run: JobRun) -> int:
    """``kvarn eval`` on the default model and text; prints the table."""
    tokens, greedy = (2048, 256) if args.full else (args.tokens, args.greedy_tokens)
    argv = ["eval", "--model", args.model, "--schemes", args.schemes, "--tokens", str(tokens)]
    argv += ["--chunk", str(args.chunk), "--greedy-tokens", str(greedy), "--threads", str(args.threads)]
    if args.json:
        argv += ["--json", args.json]
    if args.plot:
        argv += ["--plot", args.plot]
    run.summary["accuracy"] = (
        f"decode mode, {tokens} tokens: table above ({'--json ' + args.json if args.json else 'docs/accuracy.md: 2048/8192 tokens'})"
    )
    return kvarn_main(argv)


def step_tune(args: argparse.Namespace, run: JobRun) -> int:
    """A fast ``kvarn-tune`` run (:mod:`kvarn.job.tune`); exit 1 when it wrote no preset."""
    import torch

    from kvarn.job.tune import BUDGET, describe, tune_default
    from kvarn.schemes import user_preset_dir

    torch.set_num_threads(args.threads)
    out = user_preset_dir()
    print(f"kvarn-tune on {args.model}: {describe(BUDGET)}, {args.threads} torch thread(s)", flush=True)
    cpu0 = time.process_time()
    run.tune_ran = True
    name = tune_default(args.model, BUDGET, str(out))
    cpu = time.process_time() - cpu0
    if name is None:
        print("kvarn-tune wrote no preset (its message is above); the serve step serves kvarn_k4v2_g128")
        run.summary["tune"] = f"no preset within {BUDGET} (see above)"
        return 1
    file = out / f"{name}.yaml"
    print(f"tuned preset: {name} in {file} (`kvarn presets` lists it); {cpu:.0f} CPU-seconds")
    print(f"  {preset_line(name)}")
    run.tuned.append((name, file))
    run.summary["tune"] = f"wrote {name} ({BUDGET}, {cpu:.0f} CPU-s)"
    return 0


def preset_line(name: str) -> str:
    """A tuned preset's scheme, bits per element and held-out figure, from its provenance."""
    from kvarn.autotune.budget import parse_budget
    from kvarn.autotune.objective import metric_of
    from kvarn.schemes import get_preset

    p = get_preset(name)
    prov = p.provenance or {}
    if "bits_per_element" not in prov:
        return f"{p.scheme.name} (no tuning provenance)"
    budget = parse_budget(str(prov["budget"]))
    held = prov.get("heldout") or {}
    figure = budget.fmt(metric_of(budget, held)) if held else "-"
    docs = prov.get("heldout_docs")
    where = ", ".join(docs) if isinstance(docs, list) else f"the held-out part of {prov.get('text', 'the text')}"
    return (
        f"{prov['scheme']}: {prov['bits_per_element']:.3f} bits/element ({16 / prov['bits_per_element']:.2f}x "
        f"smaller than 16-bit), held-out {figure} on {where} (budget {budget.text})"
    )


COMMITTED_BUDGET = "1%"  # the budget of the full tuning run whose preset docs/tuned holds


def _committed_preset(model: str) -> tuple[str, Path] | None:
    """(name, file) of the preset of the full tuning run in docs/tuned for ``model``, made findable
    by name (prepended to ``KVARN_PRESET_PATH``, inherited by vLLM's processes); None if absent."""
    from kvarn.autotune.budget import parse_budget
    from kvarn.autotune.config import derived_name
    from kvarn.schemes.registry import PRESET_PATH_ENV

    name = derived_name(model, parse_budget(COMMITTED_BUDGET))
    folder = Path(__file__).resolve().parents[2] / "docs" / "tuned"
    if not (folder / f"{name}.yaml").is_file():
        return None
    os.environ[PRESET_PATH_ENV] = os.pathsep.join(p for p in (str(folder), os.environ.get(PRESET_PATH_ENV)) if p)
    return name, folder / f"{name}.yaml"


def _resolves_to(name: str, file: Path | None) -> str | None:
    """Where preset ``name`` comes from (its file, or ``built-in``), or None when it resolves to
    another file than ``file`` (a name clash; the registry has logged both files)."""
    from kvarn.schemes import get_preset

    source = get_preset(name).source
    if file is not None and Path(source).resolve() != file.resolve():
        print(f"not serving {name}: the name resolves to {source}, not to {file} (see the warning above)")
        return None
    return source


def step_serve(args: argparse.Namespace, run: JobRun) -> int:
    """Serve through vLLM with a kvarn preset; prints its file, capacity vs the 16-bit cache and a sample."""
    from kvarn.job.serve import main as vllm_main

    candidates: list[tuple[str, Path | None]] = [*run.tuned]
    if not run.tune_ran:
        committed = _committed_preset(args.model)
        if committed is not None:
            print(f"tune step skipped: serving the preset of the full tuning run, {committed[0]} (docs/tuning.md)")
            candidates.append(committed)
    candidates.append(("kvarn_k4v2_g128", None))
    for preset, file in candidates:
        source = _resolves_to(preset, file)
        if source is None:
            continue
        print(f"serving {preset} from {source}")
        if file is not None:
            print(f"  {preset_line(preset)}")
        try:
            if vllm_main(["--model", args.model, "--preset", preset], summary=run.summary) == 0:
                run.summary["serve"] = f"{run.summary.get('serve', preset)} from {source}"
                return 0
        except Exception as e:  # a start-up refusal (e.g. a layout the backend does not serve) is reported
            print(f"vLLM could not serve {preset}: {e}")
    run.summary["serve"] = "vLLM could not serve any candidate preset (see above)"
    return 1


STEPS: list[tuple[str, Step]] = [
    ("presets", step_presets),
    ("accuracy", step_accuracy),
    ("tune", step_tune),
    ("serve", step_serve),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvarn.job", description="kvarn's main job (make run).")
    p.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    p.add_argument(
        "--schemes",
        default="all,kvarn_k4v2_g128_sink0",
        help="schemes for the accuracy step (default: all built-ins, each with its exact first token, and baselines, plus kvarn_k4v2_g128_sink0 without it)",
    )
    p.add_argument("--tokens", type=int, default=1024, help="accuracy step: tokens of the text (default 1024)")
    p.add_argument("--greedy-tokens", type=int, default=64, help="accuracy step: greedy continuation (default 64)")
    p.add_argument("--chunk", type=int, default=128, help="accuracy step: tokens per forward pass (default 128)")
    p.add_argument("--full", action="store_true", help="the docs/accuracy.md measurement: 2048 tokens, greedy 256")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the accuracy and tune steps (default 1: robust on shared 2-core machines)",
    )
    p.add_argument("--json", help="accuracy step: write the results as JSON here")
    p.add_argument("--plot", help="accuracy step: write the Pareto plot (PNG) here")
    names = [n for n, _ in STEPS]
    p.add_argument("--skip", action="append", default=[], choices=names, help="skip a step (repeatable)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = JobRun()
    rc = 0
    done: list[tuple[str, str, float]] = []
    for name, step in STEPS:
        if name in args.skip:
            continue
        print(f"\n== step: {name} ==", flush=True)
        t0 = time.perf_counter()
        code = step(args, run)
        status = "ok" if code == 0 else f"exit {code}"
        done.append((name, status, time.perf_counter() - t0))
        print(f"== {name}: {status} in {done[-1][2]:.0f} s ==", flush=True)
        rc = rc or code
    print("\n== summary ==")
    for name, status, secs in done:
        print(f"{name:<9} {status:<7} {secs:6.0f} s  {run.summary.get(name, '')}")
    print(f"{'total':<9} {'ok' if rc == 0 else 'FAILED':<7} {sum(s for _, _, s in done):6.0f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
