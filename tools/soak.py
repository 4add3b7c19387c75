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
import dataclasses
import json
import os
import signal
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import ROOT, commit, machine, measuring_args, utc_stamp, write_section
from kvarn.bench.soak import SoakConfig, run
from kvarn.bench.soak_report import failures, section, table

DOC = ROOT / "docs" / "reliability.md"
MAX_RSS_GROWTH = 25.0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _flag(f: dataclasses.Field[Any]) -> str:
    """The option of a :class:`SoakConfig` field: ``--burst-every`` for ``burst_every_s``."""
    return f.metadata.get("flag") or "--" + f.name.removesuffix("_s").replace("_", "-")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    hints = typing.get_type_hints(SoakConfig)
    for f in dataclasses.fields(SoakConfig):  # one option per field, its help in the field's metadata
        kw: dict[str, Any] = {"help": f.metadata["help"]}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        kind = hints[f.name]
        if kind is bool:
            p.add_argument(_flag(f), action="store_true", **kw)
        elif typing.get_origin(kind) is tuple:
            p.add_argument(_flag(f), action="append", default=[], **kw)
        else:  # the annotation's type (int for int | None)
            arg_type = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            p.add_argument(_flag(f), type=arg_type, default=f.default, **kw)
    p.add_argument(
        "--max-rss-growth", type=float, default=MAX_RSS_GROWTH,
        help="percent of resident-memory growth after warm-up that fails the run (default %(default)s: a "
        "manual mixed-load run measured 9-15%% growth after the first minute for vLLM's own cache and "
        "kvarn's alike, allocator and cache warm-up rather than a leak; 25%% leaves room for that and "
        "catches a leak that grows with the requests served)",
    )  # fmt: skip
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
        # argparse keeps each option under its flag's name, dashes as underscores
        values: dict[str, Any] = {
            f.name: getattr(a, _flag(f)[2:].replace("-", "_")) for f in dataclasses.fields(SoakConfig)
        }
        values["serve_args"] = tuple(values["serve_args"])  # argparse appends to a list
        cfg = SoakConfig(**values)
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
