"""A model with realistic compute per KV element: Llama-3.2-1B's per-layer shapes, random weights.

SmolLM2-135M (hidden 576, 9 query heads over 3 KV heads, MLP 1536) does ~18K FLOPs of layer work
per KV element it stores, about 6x less than a 1B-8B model: every per-token cost of a KV cache
(storing, quantizing, reading) weighs 6x more on it than on the models users serve. This builds,
with transformers and no download, a ``LlamaForCausalLM`` with Llama-3.2-1B's layer shapes (hidden
2048, 32 query heads, 8 KV heads, head_dim 64, MLP 8192, RoPE theta 500000, tied embeddings), the
SmolLM2 tokenizer and vocabulary (49,152 tokens, so the same prompts tokenize the same) and
``--layers`` layers (default 4, so that it runs on 2 cores), random weights from a fixed seed, in
bfloat16. The folder is built once under kvarn's cache folder (``models/llama1b-shapes-L<layers>``)
and reused; the figures are in docs/serving.md::

    python tools/realistic_model.py [--layers 4]    # prints the folder

:func:`kvarn.models.model_folder` builds it for the serving benchmarks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

NAME = "llama1b-shapes"
LLAMA_3_2_1B: dict[str, Any] = {  # Llama-3.2-1B's per-layer shapes; its vocabulary is replaced by SmolLM2's
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
SMOLLM2: dict[str, Any] = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "intermediate_size": 1536}  # fmt: skip
SEED = 0


def layer_flops_per_token(shapes: dict[str, Any]) -> int:
    """Multiply-adds x 2 of one decoder layer's projections and MLP for one token (attention over the
    context not counted: it scales with the context for every model alike)."""
    h, d = shapes["hidden_size"], shapes["head_dim"]
    q, kv, m = shapes["num_attention_heads"] * d, shapes["num_key_value_heads"] * d, shapes["intermediate_size"]
    return int(2 * (h * q + 2 * h * kv + q * h + 3 * h * m))


def kv_elements_per_token(shapes: dict[str, Any]) -> int:
    """Numbers one layer stores in the KV cache per token (keys and values)."""
    return int(2 * shapes["num_key_value_heads"] * shapes["head_dim"])


def flops_per_kv_element(shapes: dict[str, Any]) -> float:
    return layer_flops_per_token(shapes) / kv_elements_per_token(shapes)


def build(layers: int, cache_dir: Path, smollm2: Path) -> Path:
    """The model folder (bf16 safetensors, config, SmolLM2's tokenizer), built once and reused
    (:func:`kvarn.models.model_folder` passes the arguments).

    Args:
        layers: decoder layers (Llama-3.2-1B has 16).
        cache_dir: kvarn's cache folder; the model goes to ``<cache_dir>/models/``.
        smollm2: SmolLM2-135M's folder (its vocabulary, special tokens and tokenizer).
    """
    out = cache_dir / "models" / f"{NAME}-L{layers}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smol_cfg = json.loads((smollm2 / "config.json").read_text())
    config = LlamaConfig(
        **LLAMA_3_2_1B,
        num_hidden_layers=layers,
        vocab_size=smol_cfg["vocab_size"],
        bos_token_id=smol_cfg.get("bos_token_id"),
        eos_token_id=smol_cfg.get("eos_token_id"),
        pad_token_id=smol_cfg.get("pad_token_id"),
        initializer_range=0.02,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()  # type: ignore[no-untyped-call, arg-type]
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: an interrupted build leaves no half folder behind
    return out
