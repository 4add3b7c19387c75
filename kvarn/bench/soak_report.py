"""What a soak run (:func:`kvarn.bench.soak.run`) found, in words: why it failed, its table and its
section of docs/reliability.md."""

from __future__ import annotations

from typing import Any


def failures(result: dict[str, Any], max_rss_growth: float) -> list[str]:
    """Why the run failed, empty when it passed: a request failed, a check answer differed from its
    alone answer (float32 only: bfloat16 matmuls depend on the batch's shape on some CPUs), the
    server was not idle (KV usage, running or waiting requests), it logged an error, or its resident
    memory grew by more than ``max_rss_growth`` percent after warm-up."""
    out = []
    if result["errors"]:
        out.append(f"{result['errors']} requests failed: {result['error_samples'][:3]}")
    if result["config"]["dtype"] == "float32" and result["checks_differing"]:
        out.append(f"{result['checks_differing']} of {result['checks_compared']} check answers differ from alone")
    idle = (result["idle_kv_usage"], result["idle_running"], result["idle_waiting"])
    if any(x is None or x != 0 for x in idle):
        out.append(f"not idle after the load: KV usage {idle[0]}, running {idle[1]}, waiting {idle[2]}")
    if result["error_line_count"]:
        out.append(f"{result['error_line_count']} ERROR/traceback lines in the log: {result['error_lines'][:3]}")
    growth = result["rss_growth_pct"]
    if growth is not None and growth > max_rss_growth:
        out.append(f"resident memory grew {growth}% after warm-up (bound {max_rss_growth}%)")
    return out


def _gib(x: int | None) -> str:
    return "" if x is None else f"{x / 2**30:.2f}"


def table(result: dict[str, Any]) -> str:
    """The run as a one-row Markdown table (``docs/reliability.md`` says what each column means)."""
    c = result["config"]
    growth = "" if result["rss_growth_pct"] is None else f"{result['rss_growth_pct']:+.1f}%"
    kv = "" if result["idle_kv_usage"] is None else f"{result['idle_kv_usage']:g}"
    return "\n".join([
        "| cache | dtype | minutes | KV tokens | requests served | streamed | dropped | errors | bursts "
        "| preemptions | checks compared | differing | KV usage idle | RSS warm-up GiB | RSS end GiB | RSS growth "
        "| ERROR lines |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| `{c['kv_cache_dtype']}` | {c['dtype']} | {result['duration_s'] / 60:.1f} | {result['kv_tokens'] or ''} "
        f"| {result['served']} | {result['streamed']} | {result['dropped']} | {result['errors']} | {result['bursts']} "
        f"| {result['preemptions']} | {result['checks_compared']} | {result['checks_differing']} | {kv} "
        f"| {_gib(result['rss_warm_bytes'])} | {_gib(result['rss_end_bytes'])} | {growth} "
        f"| {result['error_line_count']} |",
    ])  # fmt: skip


def section(result: dict[str, Any], meta: dict[str, Any]) -> str:
    """The doc section: command, date, commit, machine, the table, what failed."""
    cmd = "python tools/soak.py " + " ".join(meta["args"])
    fails = failures(result, meta["max_rss_growth"])
    verdict = "Passed." if not fails else "Failed: " + "; ".join(fails) + "."
    return (f"Run {meta['date']} at commit {meta['commit']} on {meta['machine']}:\n\n`{cmd}`\n\n{table(result)}\n\n"
            f"{verdict}")  # fmt: skip
