"""One torch thread per test module here too: the fixture lives in tests/hf/conftest.py."""

from __future__ import annotations

from ..hf.conftest import _one_thread  # noqa: F401  (autouse fixture, registered by import)
