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


def cpu_has(flag: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists the CPU flag ``flag`` (``avx512f``, ``amx_int8``)."""
    try:
        return f" {flag}" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def needs_cpu(flag: str, name: str) -> pytest.MarkDecorator:
    """Skip where there is no compiler or the CPU lacks ``flag`` (``name`` in the reason)."""
    return pytest.mark.skipif(not (HAS_COMPILER and cpu_has(flag)), reason=f"needs g++ and an {name} CPU")


needs_avx512 = needs_cpu("avx512f", "AVX-512")


@functools.cache
def build_without(*flags: str) -> ModuleType:
    """The extension built for this CPU with ``flags`` added (``-mno-...``: less an instruction set)."""
    return native._build((*native.FLAGS, *native.NATIVE_FLAGS, *flags))


def fallback() -> ModuleType:
    """The extension built with ``-mno-avx512f`` (the AVX2 8-lane paths)."""
    return build_without("-mno-avx512f")
