"""Reporting evaluation results: text tables (perplexity, needle, drift, freerun), JSON, and the Pareto plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvarn.eval.drift import DriftResult
from kvarn.eval.freerun import MODES, FreerunResult
from kvarn.eval.harness import EvalResult
from kvarn.eval.needle import NeedleResult
from kvarn.hf import FP16

Result = EvalResult | NeedleResult | DriftResult | FreerunResult


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the Pareto front of ``(cost, loss)`` points, lower better on both, by cost: a
    point is on it when every point that costs no more has a higher loss (of equal points, the first).

    >>> pareto([(3.0, 0.02), (4.0, 0.01), (4.0, 0.03), (5.0, 0.01)])
    [0, 1]
    """
    best = math.inf
    out = []
    for i in sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i)):
        if points[i][1] < best:
            out.append(i)
            best = points[i][1]
    return out


def pareto_front(results: Sequence[EvalResult]) -> set[str]:
    """Names of the results on the Pareto front of bits/element and KL (:func:`pareto`)."""
    return {results[i].scheme for i in pareto([(r.bits_per_element, r.kl) for r in results])}


def format_table(results: Sequence[EvalResult], markdown: bool = False) -> str:
    """A table, one row per result; ``*`` marks the Pareto front (bits/element vs KL)."""
    front = pareto_front(results)
    head = ["scheme", "bits/elem", "ppl", "d ppl %", "KL", "top-1", "greedy", "front", "seconds"]
    rows = []
    for r in results:
        greedy = "-" if r.greedy_agreement_tokens is None else str(r.greedy_agreement_tokens)
        rows.append(
            [
                r.scheme,
                f"{r.bits_per_element:.3f}",
                f"{r.ppl:.3f}",
                f"{r.delta_ppl_pct:+.2f}",
                f"{r.kl:.4f}",
                f"{r.top1_agreement:.3f}",
                greedy,
                "*" if r.scheme in front else "",
                f"{r.seconds:.1f}",
            ]
        )
    return _render(head, rows, markdown)


def format_needle_table(results: Sequence[NeedleResult], markdown: bool = False) -> str:
    """A table, one row per result: keys retrieved out of the depths at each length."""
    lengths = sorted({n for r in results for n in r.lengths})
    head = ["scheme", "bits/elem", *(f"{n} tokens" for n in lengths), "seconds"]
    rows = []
    for r in results:
        found = dict(zip(r.lengths, r.retrieved, strict=True))
        cells = [f"{sum(found[n])}/{len(found[n])}" if n in found else "-" for n in lengths]
        rows.append([r.scheme, f"{r.bits_per_element:.3f}", *cells, f"{r.seconds:.1f}"])
    return _render(head, rows, markdown)


def format_drift_table(results: Sequence[DriftResult], markdown: bool = False) -> str:
    """A table, one row per result: tokens before the first divergence from fp16 (mean and per
    prompt) and the mean KL along the scheme's own text."""
    head = ["scheme", "bits/elem", "divergence", "per prompt", "KL", "KL per prompt", "seconds"]
    rows = [
        [
            r.scheme,
            f"{r.bits_per_element:.3f}",
            f"{r.mean_divergence:.1f}",
            " ".join(str(d) for d in r.divergence),
            _kl(r.mean_kl),
            " ".join(_kl(k) for k in r.kl),
            f"{r.seconds:.1f}",
        ]
        for r in results
    ]
    return _render(head, rows, markdown)


def format_freerun_table(results: Sequence[FreerunResult], markdown: bool = False) -> str:
    """A table, one row per result: each score's mean over prompts and its 95% interval, greedy
    (repetition, distinct-2, divergence from fp16, perplexity under the 16-bit model), then sampled;
    then each mode's repetition as a ratio to the fp16 row's (paired interval; ``-`` without one)."""
    cols = [("greedy", "repetition", 3), ("greedy", "distinct2", 3), ("greedy", "divergence", 1), ("greedy", "ppl", 2)]
    cols += [("sampled", "repetition", 3), ("sampled", "distinct2", 3), ("sampled", "ppl", 2)]
    short = {"repetition": "rep-4", "distinct2": "dist-2", "divergence": "diverge", "ppl": "ppl"}
    ratios = [f"{m} rep-4 / fp16" for m in MODES]
    head = ["scheme", "bits/elem", *(f"{m} {short[k]}" for m, k, _ in cols), *ratios, "seconds"]
    ref = next((r for r in results if r.scheme == FP16), None)
    rows = []
    for r in results:
        cells = [_interval(*r.summary(mode, metric), digits) for mode, metric, digits in cols]
        cells += ["-" if ref is None or r is ref else _interval(*r.against(ref, m), 3) for m in MODES]
        rows.append([r.scheme, f"{r.bits_per_element:.3f}", *cells, f"{r.seconds:.0f}"])
    return _render(head, rows, markdown)


def _interval(mean: float, lo: float, hi: float, digits: int) -> str:
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _kl(x: float) -> str:
    """KL to 4 decimals; below 1e-4 (fp16 against itself: rounding only) in exponent form."""
    return f"{x:.4f}" if abs(x) >= 1e-4 else f"{x:.0e}"


def _render(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*row) for row in [head, *rows])


def write_json(results: Sequence[Result], path: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Write a JSON list with one object per scheme: the result's fields plus ``meta`` (model, task, chunk...)."""
    rows = [{**r.to_dict(), **(meta or {})} for r in results]
    Path(path).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


def read_json(path: str | Path) -> list[EvalResult]:
    """Read results written by :func:`write_json` (extra keys are ignored)."""
    fields = EvalResult.__dataclass_fields__
    return [EvalResult(**{k: v for k, v in row.items() if k in fields}) for row in json.loads(Path(path).read_text())]


def plot_pareto(results: Sequence[EvalResult], path: str | Path, title: str = "") -> None:
    """Scatter bits/element (x) against KL (y, log scale); the front as a step line.

    fp16 (KL 0) cannot sit on a log axis and is left out; kvarn schemes and baselines get
    different markers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in results if r.scheme != FP16 and r.kl > 0]
    if not pts:
        raise ValueError("nothing to plot: every result is fp16 or has KL 0")
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for kvarn, marker, color, label in ((True, "o", "tab:blue", "kvarn"), (False, "s", "tab:orange", "baselines")):
        sel = [r for r in pts if r.scheme.startswith("kvarn_") == kvarn]
        if sel:
            ax.scatter(
                [r.bits_per_element for r in sel],
                [r.kl for r in sel],
                marker=marker,
                color=color,
                label=label,
                zorder=3,
            )
        for r in sel:
            ax.annotate(r.scheme, (r.bits_per_element, r.kl), fontsize=7, xytext=(4, 3), textcoords="offset points")
    fr = sorted((r for r in pts if r.scheme in front), key=lambda r: r.bits_per_element)
    ax.step(
        [r.bits_per_element for r in fr], [r.kl for r in fr], where="post", color="gray", lw=1, label="Pareto front"
    )
    ax.set_yscale("log")
    ax.set_xlabel("bits per element (scales, zero points, unquantized windows included)")
    ax.set_ylabel("mean KL(fp16 || scheme), nats")
    ax.set_title(title or "KV-cache quantization: size vs accuracy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
