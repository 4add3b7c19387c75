"""One torch thread for these tests: the CI machines have 2 cores, often shared, and with two
threads the small ops of the codec spend most of their time waiting for each other (measured: a
3-tile quantize_tiles took 29 ms with one thread and 455 ms with two on a busy machine)."""

from __future__ import annotations

from tests.fixtures import _one_thread  # noqa: F401  (autouse)
