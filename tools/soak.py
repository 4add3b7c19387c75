"""Soak run through ``vllm serve``: N minutes of mixed traffic against one server with kvarn's cache
(or vLLM's own, ``--kv-cache-dtype auto``), then: back to idle? anything logged? memory growth? greedy
answers under load equal to those served alone?

What it sends and checks: :mod:`kvarn.bench.soak`. What each column means: the Soak section of
``docs/reliability.md``. Examples::

    python tools/soak.py --minutes 1                                   # a quick look
    taskset -c 1 python tools/soak.py --minutes 20 --json soak.json --doc-section soak:kvarn-float32
    python tools/soak.py --kv-cache-dtype auto --minutes 20            # vLLM's own cache, as a baseline

Exit status 1 when a request failed, a check answer differed from alone (float32), the server did not
return to idle, it logged an ERROR line or a traceback, or its memory grew past ``--max-rss-growth``.
Progress lines every ``--progress-every`` seconds; Ctrl-C stops the load early and still reports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import ROOT, commit, machine, measuring_args, utc_stamp, write_section
from kvarn.bench.soak import SoakConfig, failures, run, section, table

DOC = ROOT / "docs" / "reliability.md"
MAX_RSS_GROWTH = 25.0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse(argv: list[str]) -> argparse.Namespace:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--minutes", type=float, default=d.minutes, help="minutes of traffic (default %(default)s)")
    p.add_argument("--model", default=d.model, help="model alias or folder (default %(default)s)")
    p.add_argument(
        "--kv-cache-dtype", default=d.kv_cache_dtype,
        help="a kvarn preset, or auto for vLLM's own cache as a baseline (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default=d.dtype, choices=("float32", "bfloat16"),
        help="model dtype (default %(default)s: where a greedy answer must not depend on its batch)",
    )  # fmt: skip
    p.add_argument("--clients", type=int, default=d.clients, help="client threads (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="(default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="(default %(default)s)")
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens,
        help="most output tokens of an ordinary request, 16 up to this (default %(default)s); prompts take "
        "up to --max-model-len less this",
    )  # fmt: skip
    p.add_argument(
        "--kv-tokens", type=int,
        help="KV memory (--kv-cache-memory-bytes of the server) that holds about this many tokens of the cache "
        "(default 4 x --max-model-len: a burst of --clients full-length requests does not fit, so vLLM "
        "preempts); VLLM_CPU_KVCACHE_SPACE is removed from the server's environment, since it would override it",
    )  # fmt: skip
    p.add_argument("--kv-cache-memory-bytes", type=int, help="KV memory in bytes, instead of --kv-tokens")
    p.add_argument(
        "--burst-every", type=float, default=d.burst_every_s,
        help="seconds between bursts: each client's next request a full-length prompt (default %(default)s)",
    )  # fmt: skip
    p.add_argument("--checks", type=int, default=d.checks, help="check prompts (default %(default)s)")
    p.add_argument("--check-len", type=int, default=d.check_len, help="tokens of a check prompt (default %(default)s)")
    p.add_argument(
        "--check-tokens", type=int, default=d.check_tokens, help="greedy tokens of a check (default %(default)s)"
    )
    p.add_argument(
        "--idle", type=float, default=d.idle_s,
        help="seconds to wait after the load for no running request and no used KV block (default %(default)s)",
    )  # fmt: skip
    p.add_argument("--rss-every", type=float, default=d.rss_every_s, help="seconds between RSS samples")
    p.add_argument("--progress-every", type=float, default=d.progress_every_s, help="seconds between progress lines")
    p.add_argument(
        "--max-rss-growth", type=float, default=MAX_RSS_GROWTH,
        help="percent of resident-memory growth after warm-up that fails the run (default %(default)s: a "
        "manual mixed-load run measured 9-15%% growth after the first minute for vLLM's own cache and "
        "kvarn's alike, allocator and cache warm-up rather than a leak; 25%% leaves room for that and "
        "catches a leak that grows with the requests served)",
    )  # fmt: skip
    p.add_argument(
        "--reserve-full-prompt", action="store_true",
        help="keep vLLM's admission (a request only when its whole prompt fits: it then rarely preempts); by "
        "default the server runs with --no-scheduler-reserve-full-isl, so that bursts preempt",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the clients' choices (default %(default)s)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    p.add_argument("--log", type=Path, help="keep the server's log here (default: a temporary file)")
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--doc-section", help="write the table into this section of --doc (default: none)")
    p.add_argument("--doc", type=Path, default=DOC, help="the page of --doc-section (default docs/reliability.md)")
    p.add_argument("--from-json", type=Path, help="run nothing: the table and doc section of a saved --json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.from_json:
        saved = json.loads(a.from_json.read_text())
        result, meta = saved["result"], saved["meta"]
    else:
        signal.signal(signal.SIGTERM, _interrupt)
        cfg = SoakConfig(
            minutes=a.minutes, model=a.model, kv_cache_dtype=a.kv_cache_dtype, dtype=a.dtype, clients=a.clients,
            max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, max_tokens=a.max_tokens,
            kv_tokens=a.kv_tokens, kv_cache_memory_bytes=a.kv_cache_memory_bytes, burst_every_s=a.burst_every, checks=a.checks,
            check_len=a.check_len, check_tokens=a.check_tokens, idle_s=a.idle, rss_every_s=a.rss_every,
            progress_every_s=a.progress_every, seed=a.seed, reserve_full_prompt=a.reserve_full_prompt, serve_args=tuple(a.serve_arg),
        )  # fmt: skip
        env = dict(os.environ)
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < (os.cpu_count() or 0):  # under taskset: vLLM's OpenMP threads on those cores only
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        args = measuring_args(argv, ("--json", "--log", "--doc", "--doc-section", "--progress-every"))
        meta = {"date": utc_stamp(), "commit": commit(), "machine": machine(), "args": args,
                "max_rss_growth": a.max_rss_growth}  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            log = a.log or Path(tmp) / "serve.log"
            result = run(cfg, log, env, lambda line: print(line, flush=True))
        if a.json:
            a.json.write_text(json.dumps({"meta": meta, "result": result}, indent=1))
    print(table(result))
    fails = failures(result, meta["max_rss_growth"])
    print("\n".join(["FAILED:", *fails]) if fails else "passed")
    if a.doc_section:
        write_section(a.doc, a.doc_section, section(result, meta), "# Reliability")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
