"""Tiny random models for capacity measurements and start-up checks (no download needed).

``make_tiny_llama`` writes a randomly initialized Llama (any head_dim) that vLLM can serve, with
the tokenizer of the embedded SmolLM2; ``write_config_only`` writes just a ``config.json``,
enough for vLLM's front end to build (and kvarn to check) an engine config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def _llama_shape(head_dim: int, num_layers: int, num_heads: int, num_kv_heads: int) -> dict[str, Any]:
    """The ``config.json`` fields of a small bfloat16 Llama with SmolLM2's vocabulary (the MLP twice
    the hidden size)."""
    return {
        "hidden_size": num_heads * head_dim,
        "intermediate_size": 2 * num_heads * head_dim,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }


def write_config_only(folder: Path, **overrides: Any) -> Path:
    """A Llama ``config.json`` (2 layers, head_dim 64 unless overridden) in ``folder``; returns it."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_llama_shape(head_dim=64, num_layers=2, num_heads=4, num_kv_heads=2),
        "rms_norm_eps": 1e-5,
    }
    cfg.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def make_tiny_llama(
    folder: Path, head_dim: int = 128, num_layers: int = 2, seed: int = 0, num_heads: int = 2, num_kv_heads: int = 1
) -> Path:
    """A random Llama with ``head_dim`` and SmolLM2's tokenizer, in ``folder``; returns ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvarn.models import resolve_model

    src = Path(resolve_model("smollm2-135m"))
    torch.manual_seed(seed)
    config = LlamaConfig(**_llama_shape(head_dim, num_layers, num_heads, num_kv_heads))
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)  # type: ignore[no-untyped-call, arg-type]
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, folder / f.name)
    return folder
