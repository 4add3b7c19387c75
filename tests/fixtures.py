"""Fixtures shared by several test folders; a folder's ``conftest.py`` imports the ones it uses."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One torch thread for the module's tests (restored after): see tests/hf/conftest.py for why."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` loaded by its path (tools/ is not a package), registered in ``sys.modules``
    so that dataclasses can look their module up while the file executes."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
