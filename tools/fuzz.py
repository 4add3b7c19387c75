"""The full fuzz run: every property of ``tests/fuzz`` at 10,000 generated cases (Hypothesis'
``full`` profile), one line per entry point with its count of cases and the outcome.

Usage::

    OMP_NUM_THREADS=1 python tools/fuzz.py [--examples N] [--asan] [-k EXPRESSION]

``--asan`` runs the kernel properties against the AddressSanitizer build (``tools/asan.py``).
Exit code: pytest's (0: no failure). A failure prints Hypothesis' smallest failing case and the
``@reproduce_failure`` blob that replays it. Figures of a run: ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "  - during generate phase (12.34 seconds):" ... "    - 9950 passing, 0 failing, and 50 invalid test cases"
_TEST_RE = re.compile(r"^(tests/fuzz/\S+::\S+):\s*$", re.MULTILINE)
_COUNTS_RE = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


def summary(output: str) -> list[tuple[str, int, int, int]]:
    """``(test, passing, failing, invalid)`` per test from ``--hypothesis-show-statistics`` output,
    summed over the phases (explicit, reuse, generate, shrink)."""
    rows = []
    starts = [(m.start(), m[1]) for m in _TEST_RE.finditer(output)] + [(len(output), "")]
    for (pos, name), (end, _) in zip(starts, starts[1:], strict=False):
        counts = [tuple(map(int, m.groups())) for m in _COUNTS_RE.finditer(output, pos, end)]
        passing, failing, invalid = (sum(c[i] for c in counts) for i in range(3))
        rows.append((name, passing, failing, invalid))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, help="cases per property (default: the full profile's 10,000)")
    p.add_argument("--asan", action="store_true", help="kernel properties against the ASan build (tools/asan.py)")
    p.add_argument("-k", dest="select", help="pytest -k expression (e.g. 'decode')")
    args = p.parse_args()
    env = {**os.environ, "KVARN_FUZZ_PROFILE": "full"}
    if args.examples:
        env["KVARN_FUZZ_EXAMPLES"] = str(args.examples)
    if args.asan:  # the ASan build is kept where tests/kernels/test_asan.py keeps it
        from kvarn.models import default_cache_dir

        build = default_cache_dir() / "torch_extensions" / "kvarn_cpu_asan"
        cmd = [sys.executable, "tools/asan.py", "--build-dir", str(build), "tests/fuzz/test_kernels.py"]
    else:
        cmd = [sys.executable, "-m", "pytest", "tests/fuzz", "-p", "no:cacheprovider"]
    cmd += ["-q", "--hypothesis-show-statistics"]
    if args.select:
        cmd += ["-k", args.select]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    sys.stdout.write(out.stdout[-20000:])
    sys.stderr.write(out.stderr[-5000:])
    print(f"\n{'test (tests/fuzz/)':<76} {'passing':>8} {'failing':>8} {'invalid':>8}")
    for name, ok, bad, invalid in summary(out.stdout):
        print(f"{name.removeprefix('tests/fuzz/'):<76} {ok:>8} {bad:>8} {invalid:>8}")
    print(f"exit {out.returncode}, {seconds:.0f} s")
    return out.returncode


if __name__ == "__main__":
    raise SystemExit(main())
