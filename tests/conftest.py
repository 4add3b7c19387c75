"""Shared test setup.

Without a CUDA GPU, Triton kernels run under the interpreter (numpy on the CPU). The variable must
be set before triton is first imported, so it is set here, at the top of the session.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker's vLLM engines bind their OpenMP threads to one core of their own:
# vLLM's default binds every engine to every core, and two engines at once then take twice as long
# each, no faster than one after the other; on a core each, each runs as fast as alone (docs/testing.md).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_getaffinity"):
    _CORES = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_CORES[int(_WORKER[2:]) % len(_CORES)]))


# Modules whose tests share one session fixture (``tests/vllm/conftest.py: default_run``, an engine run):
# one group for pytest-xdist, so that the run is made once.
SHARED_GROUPS = {"tests/vllm/test_e2e.py": "default_run", "tests/vllm/test_pages.py": "default_run"}


def _group(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return SHARED_GROUPS.get(module, module)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test``'s two workers take whole groups: a module (its module fixtures, such as a vLLM
    engine, run once), or the modules of :data:`SHARED_GROUPS` together."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present. Order the groups of
    :func:`pytest_xdist_make_scheduler` so that those holding ``slow`` tests come first, in
    collection order: two workers take the long groups at the start and finish together."""
    slow_groups = {_group(item.nodeid) for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: _group(item.nodeid) not in slow_groups)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
