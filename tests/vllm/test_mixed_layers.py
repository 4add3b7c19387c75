"""A mixed-bit preset's layers against the uniform scheme's, byte for byte, through ``vllm.LLM``.

Per-layer dispatch must compute each layer exactly as the uniform scheme of that layer would. On the
tiny random Llama (2 layers, 2 KV heads of 64) in float32, one 300-token prompt (two full tiles) is
served by three engines, and each layer's packed records of the prompt's tiles are read in-process
(:mod:`kvarn.testing.layer_pages`):

- ``kvarn_k8v8_g128``, the uniform scheme;
- ``kvarn_k4v2_g128_L0k8v8``: its layer 0 is an override whose input is the embeddings, as in the
  uniform engine, so its records must be the uniform engine's bytes;
- ``kvarn_k8v8_g128_L1k4v2``: its layer 0 is the base before the override, with the uniform engine's
  input, so again the same bytes; its layer 1 is the override (k4v2 pages: the override ran).

The two mixed presets give every layer the same scheme, spelled from the other base: their records
of both layers must be the same bytes and their greedy tokens and logprobs identical (a layer stored
or read with its preset's base scheme would differ), and their logprobs differ from the uniform
engine's (layer 1 is read at 4/2 bits there, not 8/8).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

UNIFORM, OVERRIDE_FIRST, OVERRIDE_LAST = "kvarn_k8v8_g128", "kvarn_k4v2_g128_L0k8v8", "kvarn_k8v8_g128_L1k4v2"
PROMPT = 300  # tokens: two full 128-token tiles, then a partial one


def _serve(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Each preset's pages of the prompt, from one fresh process (vLLM's engine core in it)."""
    import torch

    from kvarn.testing.synthetic import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", head_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    prompt = torch.randint(100, 40_000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    out = tmp_path / "pages.pt"
    names = [UNIFORM, OVERRIDE_FIRST, OVERRIDE_LAST]
    code = f"from kvarn.testing.layer_pages import save_pages; save_pages({str(model)!r}, {names!r}, {prompt!r}, {str(out)!r})"
    # VLLM_CPU_KVCACHE_SPACE (set by other tests of this process) would replace the engines' small KV memory
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pages: dict[str, dict[str, Any]] = torch.load(out)
    return pages


def test_each_layer_of_a_mixed_preset_is_stored_as_its_uniform_scheme_stores_it(tmp_path: Path) -> None:
    import torch

    from kvarn.schemes import Scheme

    pages = _serve(tmp_path)
    uniform, first, last = (pages[n] for n in (UNIFORM, OVERRIDE_FIRST, OVERRIDE_LAST))
    k8v8, k4v2 = (Scheme.from_name(n).tile_bytes(64) for n in ("kvarn_k8v8_g128", "kvarn_k4v2_g128"))
    tiles = PROMPT // 128
    assert [tuple(uniform["records"][i].shape) for i in (0, 1)] == [(tiles, 2, k8v8)] * 2
    for mixed in (first, last):
        assert [tuple(mixed["records"][i].shape) for i in (0, 1)] == [(tiles, 2, k8v8), (tiles, 2, k4v2)]
        assert torch.equal(mixed["records"][0], uniform["records"][0])  # layer 0: k8v8, the uniform input
    assert torch.equal(first["records"][1], last["records"][1])
    assert first["tokens"] == last["tokens"] and first["logprobs"] == last["logprobs"], (first, last)
    assert first["logprobs"] != uniform["logprobs"], (first, uniform)
