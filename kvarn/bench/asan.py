"""The native CPU extension built with AddressSanitizer, for ``tools/asan.py``.

The extension's sources (``kvarn/kernels/cpu/*.cpp``) are built by ``torch.utils.cpp_extension`` with
``-fsanitize=address`` into their own build folder (never the cache the ops load from). Python itself
is not built with ASan, so a process that loads this build needs the compiler's ``libasan.so``
preloaded (``LD_PRELOAD``, :func:`libasan`) and :data:`ASAN_OPTIONS` in its environment.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address", "-fopenmp"]
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=0:halt_on_error=1:exitcode=86"  # 86: ASan found an error


def libasan() -> str | None:
    """The compiler's ``libasan.so`` (resolved), or None without g++ or libasan."""
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        return None
    out = subprocess.run([gxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    path = Path(out)
    return str(path.resolve()) if path.is_absolute() and path.exists() else None


def build(build_dir: Path) -> object:
    """The extension's sources built with ASan into ``build_dir``."""
    from torch.utils import cpp_extension

    from kvarn.kernels.cpu import native

    here = Path(native.__file__).parent
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="kvarn_cpu_asan",
        sources=[str(here / f) for f in native.SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fsanitize=address", "-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
