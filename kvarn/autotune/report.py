"""Outputs of a tuning run: the preset(s) with provenance, the summary table, JSON, the Pareto plot."""

from __future__ import annotations

import datetime as _dt
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvarn.autotune.budget import Budget
from kvarn.autotune.result import Candidate, TuneResult, fmt_ci
from kvarn.schemes import Preset, Scheme, save_preset


def check_writable(out_dir: Path) -> None:
    """Fail before the search, not after it, when presets cannot be written to ``out_dir``.

    Raises:
        PermissionError: with the directory and the reason.
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvarn-tune-probe.", dir=out_dir)
        os.close(fd)
        Path(tmp).unlink()
    except OSError as e:
        raise PermissionError(f"cannot write presets to --out {out_dir}: {e.strerror or e}") from None


def provenance(res: TuneResult, c: Candidate, text_source: str) -> dict[str, Any]:
    """The provenance block stored in a tuned preset (plain YAML types only)."""
    from kvarn import __version__

    return {
        "tool": "kvarn-tune",
        "kvarn_version": __version__,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": res.config["model"],
        "head_dim": res.head_dim,
        "num_layers": res.num_layers,
        "text": text_source,
        "text_sha256": res.text_sha256,
        "tokens": res.config["tokens"],
        "holdout_fraction": res.config["holdout"],
        "split": res.config.get("split", "contiguous"),
        "calibration_docs": res.config.get("calibration_docs"),
        "heldout_docs": res.config.get("heldout_docs"),
        "bits_context": res.config.get("bits_context"),
        "device": res.config.get("device", "cpu"),
        "dtype": res.config.get("dtype", "float32"),
        "budget": res.config["budget"]["text"],
        "metric": res.config["budget"]["metric"],
        "limit": res.config["budget"]["limit"],
        "scheme": c.scheme,
        "bits_per_element": round(c.bits, 6),
        "compression": round(16.0 / c.bits, 4),
        "calibration": dict(c.calib or {}),
        "heldout": dict(c.heldout or {}),
        "feasibility": res.config.get("feasibility", "point"),
        "objective": res.config.get("objective", "bits"),
        "store_ns_per_token": None if c.store_ns is None else round(c.store_ns, 1),
        "confidence": res.config.get("confidence"),
        "calibration_interval": None if c.calib_ci is None else [round(x, 6) for x in c.calib_ci],
        "heldout_interval": None if c.heldout_ci is None else [round(x, 6) for x in c.heldout_ci],
        "meets_budget_on_heldout": bool(c.meets_heldout),
        "trials": len(res.trials),
        "seed": res.config["seed"],
        "study": res.study_name,
        "sensitive_layers": res.ranking[:8],
    }


def write_presets(res: TuneResult, name: str, out_dir: Path, text_source: str) -> list[Path]:
    """Write the winner as ``<name>.yaml`` (and, with ``--pareto``, every front point that meets the
    budget on held-out text as ``<name>_p<i>.yaml``), atomically via :func:`save_preset`."""
    written: list[Path] = []
    todo: list[tuple[str, Candidate]] = []
    if res.winner is not None:
        todo.append((name, res.winner))
    if res.config.get("pareto"):
        todo += [(f"{name}_p{i}", c) for i, c in enumerate(res.front) if c.meets_heldout]
    for n, c in todo:
        desc = (
            f"kvarn-tune: {res.config['model']} within {res.config['budget']['text']} "
            f"({res.config['budget']['metric']}), {c.bits:.4f} bits/element"
        )
        p = Preset(n, Scheme.from_name(c.scheme), "kvarn-tune", desc, provenance(res, c, text_source))
        written.append(save_preset(p, out_dir / f"{n}.yaml"))
    return written


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def summary_table(res: TuneResult) -> str:
    """A plain-text table: front, confirmed candidates, references, and the verdict."""
    metric = res.config["budget"]["metric"]
    measured = sum(bool(t.get("evaluated")) for t in res.trials)
    free = len(res.trials) - measured  # pruned unmeasured: they could not beat the best feasible bits
    lines = [
        f"kvarn-tune {res.config['model']} budget {res.config['budget']['text']} ({metric}), "
        f"{measured} measured trials (+{free} pruned unmeasured: could not beat the best feasible bits), "
        f"{res.seconds:.0f} s, study {res.study_name}",
        f"{'role':<10} {'bits/el':>8} {'x fp16':>7} {'calib':>9} {'calib 90% CI':>18} {'held-out':>9} "
        f"{'held-out 90% CI':>18}  scheme",
    ]

    def row(role: str, c: Candidate) -> str:
        return (
            f"{role:<10} {c.bits:>8.4f} {16 / c.bits:>7.2f} {_fmt(c.calib_metric):>9} {fmt_ci(c.calib_ci):>18} "
            f"{_fmt(c.heldout_metric):>9} {fmt_ci(c.heldout_ci):>18}  {c.scheme}"
        )

    for c in res.front:
        lines.append(row("front", c))
    for c in res.confirmed:
        lines.append(row("winner" if c is res.winner else "rejected", c))
    for r in res.references:
        ci = fmt_ci(r.get("interval"))
        lines.append(
            f"{'reference':<10} {r['bits']:>8.4f} {16 / r['bits']:>7.2f} {'-':>9} {'':>18} {_fmt(r['metric']):>9} "
            f"{ci:>18}  {r['name']}"
        )
    versus = builtin_comparison(res)
    if versus:
        lines.append(versus)
    if res.config.get("feasibility") == "bound":
        lines.append("feasible on calibration = the upper end of the 90% CI (chunk bootstrap) within the budget")
    if res.extra:
        lines.append("time (s): " + ", ".join(f"{k.removesuffix('_seconds')} {v}" for k, v in res.extra.items()))
    lines.append(("OK: " if res.ok else "FAILED: ") + res.message)
    return "\n".join(lines)


def builtin_comparison(res: TuneResult) -> str | None:
    """One line: the winner against the built-in presets measured beside it on held-out text
    (references marked ``builtin``), and what it saves over the cheapest one within the budget."""
    w = res.winner
    refs = sorted((r for r in res.references if r.get("builtin")), key=lambda r: r["bits"])
    if w is None or w.heldout_metric is None or not refs:
        return None
    b = res.config["budget"]
    budget = Budget(b["metric"], b["limit"], b["text"])
    parts = [
        f"{r['name']} {r['bits']:.2f} bits {budget.fmt(r['metric'])} ({'within' if budget.met(r['metric']) else 'over'})"
        for r in refs
    ]
    line = f"vs built-in presets (held-out, budget {budget.text}): tuned {w.bits:.2f} bits {budget.fmt(w.heldout_metric)}; "
    line += "; ".join(parts)
    within = [r for r in refs if budget.met(r["metric"])]
    if within:
        r = within[0]
        saved = r["bits"] - w.bits
        if saved > 0:
            line += f" -> {saved:.2f} bits/element ({100 * saved / r['bits']:.1f}%) fewer than {r['name']}"
        else:
            line += f" -> {-saved:.2f} bits/element more than {r['name']}, which also meets the budget here"
    else:
        line += " -> no nearby built-in meets the budget"
    return line


def to_json(res: TuneResult, written: list[Path], plot: Path | None, exit_code: int) -> dict[str, Any]:
    """The result as plain JSON types, with the presets written, the plot and the CLI's exit code."""
    d = asdict(res)
    d["interrupted"] = res.interrupted
    d["exit_code"] = exit_code
    d["presets"] = [str(p) for p in written]
    d["plot"] = str(plot) if plot else None
    return d


def plot_front(res: TuneResult, path: Path) -> Path:
    """Bits per element vs the budget metric: trials and front (calibration), winner and references
    (held-out), and the budget line. Written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = res.config["budget"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    pts = [(r["bits"], r["metric"]) for r in res.trials if r["metric"] is not None]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, c="0.7", label="trials (calibration)")
    if res.front:
        ax.plot(
            [c.bits for c in res.front],
            [float("nan") if c.calib_metric is None else c.calib_metric for c in res.front],
            "o-",
            c="tab:blue",
            ms=4,
            label="Pareto front (calibration)",
        )
        held = [(c.bits, c.heldout_metric) for c in res.front if c.heldout_metric is not None]
        if held:
            ax.plot(*zip(*held, strict=True), "s--", c="tab:cyan", ms=4, label="front (held-out)")
    for r in res.references:
        ax.scatter([r["bits"]], [r["metric"]], marker="^", s=36, c="tab:orange")
        ax.annotate(r["name"], (r["bits"], r["metric"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if res.references:
        ax.scatter([], [], marker="^", c="tab:orange", label="presets / baselines (held-out)")
    if res.winner is not None and res.winner.heldout_metric is not None:
        ax.scatter([res.winner.bits], [res.winner.heldout_metric], marker="*", s=160, c="tab:red", zorder=5,
                   label=f"winner (held-out): {res.winner.bits:.3f} bits")  # fmt: skip
    ax.axhline(budget["limit"], ls=":", c="k", lw=1, label=f"budget {budget['text']}")
    ax.set_xlabel("bits per element (scales included)")
    ax.set_ylabel(
        {"ppl": "perplexity increase (%)", "kl": "mean KL (nats)", "greedy": "greedy agreement (tokens)"}[
            budget["metric"]
        ]
    )
    if budget["metric"] != "greedy":
        ax.set_yscale("symlog", linthresh=max(budget["limit"] / 4, 1e-4))
    ax.set_title(f"kvarn-tune: {res.config['model']}, {res.config['tokens']} tokens per part", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
