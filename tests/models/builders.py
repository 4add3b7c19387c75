"""Small random-weight models built from configs, and a byte-level tokenizer, for tests and docs.

Nothing is downloaded: the configs are written here and the weights drawn from a fixed seed.

* ``gemma3``: Gemma-3-like (``Gemma3ForCausalLM``): five sliding-window layers per full-attention
  layer, head_dim 256, one KV head, query_pre_attn_scalar 256.
* ``llama``: Llama-like (``LlamaForCausalLM``): full attention only, GQA (4 query heads, 2 KV heads).
* ``granite_hybrid``: GraniteMoeHybrid-like: Mamba2 layers between attention layers (a hybrid model).
* :func:`other_sliding_models`: Gemma-2-like (sliding and full layers alternate, head_dim 128)
  and Mistral-like (every layer sliding), for the layer-type paths only.

A folder for ``kvarn eval --model FOLDER`` (model plus tokenizer)::

    python -m tests.models.builders gemma3 OUT_FOLDER [--hidden 256 --layers 6 --window 512]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteMoeHybridConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

EOS = "<eos>"
VOCAB = 257  # 256 byte symbols and <eos>


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0-255) plus ``<eos>`` (256): any text, no download."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def gemma3_config(
    hidden: int = 64, layers: int = 6, window: int = 48, head_dim: int = 256, heads: int = 2
) -> Gemma3TextConfig:
    """Gemma-3-like: layers 0-4 sliding (``window`` tokens), layer 5 full, and so on; one KV head."""
    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=window,
        max_position_embeddings=4096,
        pad_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 1,
    )


def llama_config(hidden: int = 128, layers: int = 2, head_dim: int = 64) -> LlamaConfig:
    """Llama-like: full attention, 4 query heads over 2 KV heads."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        pad_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 1,
    )


def granite_hybrid_config(
    hidden: int = 256, heads: int = 4, kv_heads: int = 2, d_state: int = 64, intermediate: int | None = None
) -> GraniteMoeHybridConfig:
    """GraniteMoeHybrid-like: layers Mamba2, attention, Mamba2, attention; ``heads`` query heads over
    ``kv_heads`` KV heads (head_dim ``hidden // heads``); Mamba2 with ``hidden // 32`` heads of 64
    (expand 2) and ``d_state``; dense MLPs of ``intermediate`` (default ``hidden``). With the
    defaults (head_dim 64, 2 KV heads, ``d_state`` 64) a Mamba state page (69,376 bytes in bf16)
    outgrows a 128-token kvarn page, so vLLM gives attention blocks of several tiles."""
    return GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        num_local_experts=0,  # dense MLP
        shared_intermediate_size=intermediate or hidden,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=hidden // 32,
        mamba_n_groups=1,
        mamba_d_state=d_state,
        mamba_d_head=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        position_embedding_type="rope",
        pad_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 1,
    )


def build(config: Any, seed: int = 0) -> Any:
    """A float32 model in eval mode with weights drawn from ``seed``."""
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    cls: Any = LlamaForCausalLM
    if isinstance(config, Gemma3TextConfig):
        cls = Gemma3ForCausalLM
    elif isinstance(config, GraniteMoeHybridConfig):
        cls = GraniteMoeHybridForCausalLM
    return cls(config).eval()


def other_sliding_models(window: int = 40, seed: int = 0) -> list[Any]:
    """A Gemma-2-like (4 layers alternating sliding/full, head_dim 128) and a Mistral-like model
    (2 layers, all sliding, head_dim 64), both tiny, with random weights."""
    common: dict[str, Any] = dict(vocab_size=VOCAB, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(seed)
    gemma2 = Gemma2ForCausalLM(
        Gemma2Config(**common, hidden_size=64, num_hidden_layers=4, head_dim=128, sliding_window=window)
    )
    mistral = MistralForCausalLM(
        MistralConfig(**common, hidden_size=128, num_hidden_layers=2, head_dim=64, sliding_window=window)
    )
    return [gemma2.eval(), mistral.eval()]


def save(model: Any, folder: Path) -> Path:
    """Write ``model`` and the byte tokenizer as a Hugging Face folder that ``load_model`` reads."""
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a small random-weight model folder")
    p.add_argument("arch", choices=("gemma3", "llama"))
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--window", type=int, default=512, help="sliding window (gemma3)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = (
        gemma3_config(a.hidden, a.layers, a.window, heads=4) if a.arch == "gemma3" else llama_config(a.hidden, a.layers)
    )
    save(build(cfg, a.seed), a.out)
    print(f"{a.arch}: {cfg.num_hidden_layers} layers {getattr(cfg, 'layer_types', None)}, written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
