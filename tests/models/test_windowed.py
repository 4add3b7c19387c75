"""``windowed_copy``: a Llama folder rewritten with Gemma-3-style sliding-window layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from kvarn.hf import cache_geometry
from kvarn.testing.builders import save, windowed_copy


def test_windowed_copy_keeps_the_weights_and_windows_its_layers(llama: Any, tmp_path: Path) -> None:
    """Every third layer stays full attention; the weights load unchanged into the windowed model,
    which equals the Llama while the context fits the window and differs after it."""
    src = save(llama, tmp_path / "llama")  # 2 layers: with --every 2, layer 0 sliding and layer 1 full
    out = windowed_copy(tmp_path / "windowed", window=16, every=2, model=str(src))
    windowed = AutoModelForCausalLM.from_pretrained(out).eval()
    g = cache_geometry(windowed.config)
    assert type(windowed).__name__ == "MinistralForCausalLM"
    assert g.layer_types == ("sliding_attention", "full_attention") and g.windows == (16, None)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = llama(ids).logits, windowed(ids).logits
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-5)  # inside the window: the same model
    assert not torch.allclose(a[:, 16:], b[:, 16:], atol=1e-3)  # beyond it, layer 0 sees 16 tokens only
