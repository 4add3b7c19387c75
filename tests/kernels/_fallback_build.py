"""The native CPU extension built for this CPU less AVX-512 (its 8-lane paths), for the tests that
check those paths against the reference and the default (16-lane) build. They are skipped where
there is no compiler or the CPU lacks AVX-512: there the default build is the fallback, which
tests/kernels/test_cpu.py covers."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from kvarn.kernels.cpu import native

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


needs_avx512 = pytest.mark.skipif(not (HAS_COMPILER and _has_avx512()), reason="needs g++ and an AVX-512 CPU")


@functools.lru_cache(maxsize=1)
def fallback() -> ModuleType:
    """The extension built with ``-mno-avx512f`` (the AVX2 8-lane paths)."""
    return native._build((*native.FLAGS, *native.NATIVE_FLAGS, "-mno-avx512f"))
