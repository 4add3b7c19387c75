"""Engine runs shared by several test modules of ``tests/vllm``.

The default (16-bit) cache's run on the shared prompt is the baseline every kvarn run is compared
with; it is made once per session, so that the modules that compare against it start one engine
for it, not one each.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def default_run() -> Any:
    """vLLM's own 16-bit cache on the prompt of ``test_e2e`` (a ``test_e2e.RunResult``)."""
    pytest.importorskip("vllm")
    from tests.vllm.test_e2e import _run

    return _run("auto")
