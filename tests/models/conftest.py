"""Fixtures: small random-weight models (see :mod:`kvarn.testing.builders`), one torch thread.

One thread: the CI machines have 2 shared cores, and the codec's small ops with two threads spend
most of their time waiting for each other (see tests/hf/conftest.py for the measurement).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvarn.testing.builders import build, gemma3_config, granite_hybrid_config, llama_config, save, save_deepseek_v2
from tests.fixtures import _one_thread  # noqa: F401  (autouse)

WINDOW = 48  # the Gemma-like model's sliding window: shorter than the test contexts, not a tile multiple


@pytest.fixture(scope="session")
def gemma() -> Any:
    """Gemma-3-like: 6 layers (5 sliding with window 48, then 1 full), head_dim 256, 1 KV head."""
    return build(gemma3_config(hidden=64, layers=6, window=WINDOW))


@pytest.fixture(scope="session")
def llama() -> Any:
    """Llama-like: 2 full-attention layers, head_dim 64, 2 KV heads."""
    return build(llama_config(hidden=128, layers=2))


@pytest.fixture(scope="session")
def gemma_folder(gemma: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Gemma-like model and the byte tokenizer saved as a Hugging Face folder."""
    return save(gemma, tmp_path_factory.mktemp("gemma3-tiny"))


@pytest.fixture(scope="session")
def hybrid() -> Any:
    """GraniteMoeHybrid-like: Mamba2, attention, Mamba2, attention; 2 KV heads at head_dim 64."""
    return build(granite_hybrid_config())


@pytest.fixture(scope="session")
def hybrid_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GraniteMoeHybrid-like (Mamba2, attention, Mamba2, attention; 2 KV heads at head_dim 64), bf16,
    with the byte tokenizer, as a Hugging Face folder."""
    return save(build(granite_hybrid_config()).to(torch.bfloat16), tmp_path_factory.mktemp("granite-hybrid-tiny"))


@pytest.fixture(scope="session")
def mla_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2-like (2 dense layers, 4 heads, latent 512 + RoPE 64), bf16, byte tokenizer."""
    return save_deepseek_v2(tmp_path_factory.mktemp("deepseek-v2-tiny"))
