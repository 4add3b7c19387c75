"""Fixtures shared by several test folders; a folder's ``conftest.py`` imports the ones it uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One torch thread for the module's tests (restored after): see tests/hf/conftest.py for why."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
