"""The packed pages a vLLM engine wrote for one request, layer by layer, read in-process.

A mixed-bit preset dispatches each layer to its own scheme. Where two engines give a layer the same
scheme and the same input, that layer's packed tile records must be the same bytes: every layer
before a preset's first override sees the inputs the uniform base scheme's engine gives it, and an
override on layer 0 sees the embeddings, as the uniform override scheme's engine does.
:func:`prompt_pages` serves one prompt and returns, per attention layer, the records of the
prompt's full tiles (``[tiles, num_kv_heads, page_bytes]`` uint8), with the greedy tokens and
their logprobs.

vLLM's engine core and its model runner must live in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before vLLM reads its environment: run it in a fresh process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

KV_MEMORY = 2**26  # bytes: a few hundred tiles of a small model; vLLM zeroes what it is given


@dataclass(frozen=True)
class Pages:
    """One request served by one engine: per attention layer (by index) the records of its prompt's
    full tiles, ``[tiles, num_kv_heads, page_bytes]`` uint8, and the greedy completion."""

    records: dict[int, torch.Tensor]
    tokens: list[int]
    logprobs: list[float]


def _runner(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    engine_core = getattr(core, "engine_core", None)
    if engine_core is None:
        raise RuntimeError("vLLM's engine core runs in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return engine_core, engine_core.model_executor.driver_worker.worker.model_runner


def prompt_pages(model: str, kv_cache_dtype: str, prompt: list[int], *, dtype: str = "float32", gen: int = 2) -> Pages:
    """Serve ``prompt`` alone (one chunk, greedy, ``gen`` tokens) with ``kv_cache_dtype`` and read each
    layer's records of the prompt's full tiles (one vLLM block is one tile)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.utils import extract_layer_index

    from kvarn.vllm.engine import cpu_engine

    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, logprobs=0)
    with cpu_engine(model, kv_cache_dtype, dtype=dtype, enable_prefix_caching=False, max_num_seqs=1,
                    max_num_batched_tokens=1024, kv_cache_memory_bytes=KV_MEMORY) as llm:  # fmt: skip
        core, runner = _runner(llm)
        block = int(runner.cache_config.block_size)
        llm.llm_engine.add_request("0", TokensPrompt(prompt_token_ids=prompt), sp)
        blocks: list[int] = []
        done = None
        while llm.llm_engine.has_unfinished_requests():
            for out in llm.llm_engine.step():
                done = out if out.finished else done
            if not blocks and core.scheduler.requests:  # vLLM's own id of the request, the only one
                blocks = list(core.scheduler.kv_cache_manager.get_block_ids(next(iter(core.scheduler.requests)))[0])
        if done is None or len(blocks) < len(prompt) // block:
            raise RuntimeError(f"the request finished in its first step or holds too few blocks: {blocks}")
        ids = torch.tensor(blocks[: len(prompt) // block])
        records = {}
        for name, layer in runner.compilation_config.static_forward_context.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, list):
                cache = cache[0]
            if isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8 and cache.dim() == 4:
                records[extract_layer_index(name)] = cache[ids, :, 0, :].clone()  # [B, H, 1, page] pages
        completion = done.outputs[0]
        logprobs = [d[t].logprob for t, d in zip(completion.token_ids, completion.logprobs, strict=True)]
    return Pages(records, list(completion.token_ids), logprobs)


def save_pages(model: str, kv_cache_dtypes: list[str], prompt: list[int], out: str) -> None:
    """:func:`prompt_pages` of each of ``kv_cache_dtypes`` in turn (one engine each, float32), saved to
    ``out`` (``torch.save`` of ``{kv_cache_dtype: Pages}`` as dicts): what a test runs in a fresh process."""
    from dataclasses import asdict

    torch.save({name: asdict(prompt_pages(model, name, prompt)) for name in kv_cache_dtypes}, out)
