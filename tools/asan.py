"""Run the CPU kernels' fuzz tests against an AddressSanitizer build of the native extension.

The extension's sources (``kvarn/kernels/cpu/*.cpp``) are built by ``torch.utils.cpp_extension`` with
``-fsanitize=address`` into their own build folder (never the cache the ops load from;
:mod:`kvarn.bench.asan`), and ``kvarn.kernels.cpu.native.extension`` is pointed at that build for
the run. Python itself is not built with ASan, so its runtime must be loaded first: this script
re-executes itself with ``LD_PRELOAD`` set to the compiler's ``libasan.so``. Any out-of-bounds read or write stops the run
with ASan's report and a non-zero exit code.

Usage::

    OMP_NUM_THREADS=1 python tools/asan.py [--build-dir DIR] [pytest arguments ...]

Without test paths it runs ``tests/fuzz/test_kernels.py`` (the ``ci`` profile unless
``KVARN_FUZZ_PROFILE`` says otherwise). Exit code: pytest's; 3 when no compiler or no libasan.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvarn.bench.asan import ASAN_OPTIONS, build, libasan

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", type=Path, help="where the ASan build goes (default: a temporary folder)")
    args, pytest_args = p.parse_known_args(argv)
    lib = libasan()
    if lib is None:
        print("asan: no g++ or no libasan.so: nothing to run", file=sys.stderr)
        return 3
    if lib not in os.environ.get("LD_PRELOAD", ""):
        env = {**os.environ, "LD_PRELOAD": lib, "ASAN_OPTIONS": ASAN_OPTIONS}
        return subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env)
    with tempfile.TemporaryDirectory(prefix="kvarn-asan-") as tmp:
        module = build(args.build_dir or Path(tmp))
        import pytest

        from kvarn.kernels.cpu import native

        native.extension = lambda: module  # type: ignore[assignment]
        given = any(Path(a.split("::")[0]).exists() for a in pytest_args)
        default = [] if given else [str(ROOT / "tests" / "fuzz" / "test_kernels.py")]
        return int(pytest.main([*default, *pytest_args, "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    raise SystemExit(main())
