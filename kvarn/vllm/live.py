"""Which blocks live requests hold, published every step for the sink pool.

The model runner knows, for every request it holds, its block ids and ``num_computed_tokens``; the
attention metadata builder sees only the requests scheduled in the step. :func:`publish` runs after
the runner's ``_update_states`` (at the start of every step, before the metadata is built:
:func:`kvarn.vllm.patches.patch_update_states`) and fills the engine's
:class:`~kvarn.vllm.staging.LiveBlocks` (:attr:`kvarn.vllm.context.EngineState.live`) with
``first``, each live request's first block (the key of its sink slot).

Only the KV-cache groups that hold kvarn layers are read, each at its own block size: a model with
sliding-window layers has further groups of vLLM's own cache, whose blocks (other ids, often
32-token blocks) are no sink keys.

A hybrid (Mamba / linear-attention) model gets attention blocks of several tiles (vLLM sizes them
so that an attention page holds a Mamba state page); vLLM then splits each block into kernel blocks
of one tile for the kvarn backend (``AttentionGroup.kernel_block_size``): kernel block ``j`` of block
``b`` is ``b * stride + j``, and those are the ids the backend sees, so they are what is published
(a first block as its kernel block 0).

Preempted requests are not live: vLLM frees their blocks, and they recompute their tokens when they
resume.
"""

from __future__ import annotations

from typing import Any

from kvarn.vllm.context import EngineState, Groups


def kvarn_groups(runner: Any, state: EngineState) -> Groups:
    """``(group index, block size, tile, stride)`` of the runner's KV-cache groups that hold kvarn layers.

    Every group has its own block size (a sliding-window group of vLLM's own cache may use 32-token
    blocks beside kvarn's 128-token tiles) and its own block ids in ``req.block_ids[group]``; the
    sink pool keys on kvarn blocks only. Cached in the engine's ``state`` per ``kv_cache_config``.
    Before the KV cache exists (no ``kv_cache_config``): group 0 at the configured block size.
    ``tile``: the kernel block size the kvarn backend sees (the block size unless vLLM splits blocks
    into kernel blocks); ``stride``: kernel block ids per block (kernel block ``j`` of block ``b`` is
    ``b * stride + j``; 1 without a split).
    """
    config = getattr(runner, "kv_cache_config", None)
    cached = state.groups
    if cached is not None and cached[0] is config:
        return list(cached[1])
    if config is None:
        size = int(runner.cache_config.block_size)
        return [(0, size, size, 1)]
    layers = runner.compilation_config.static_forward_context
    kvarn = {n for n, a in layers.items() if getattr(getattr(a, "impl", None), "kvarn_pools", False)}
    groups = []
    for i, g in enumerate(config.kv_cache_groups):
        if not set(g.layer_names) & kvarn:
            continue
        size = int(g.kv_cache_spec.block_size)
        attn = [a for a in (getattr(runner, "attn_groups", None) or [[]] * (i + 1))[i] if set(a.layer_names) & kvarn]
        tile = int(getattr(attn[0], "kernel_block_size", None) or size) if attn else size
        stride = int(getattr(attn[0], "kernel_block_stride", 0) or size // tile) if attn else 1
        groups.append((i, size, tile, stride))
    if getattr(runner, "kv_caches", None):  # bound: vLLM has set its kernel block strides
        state.groups = (config, groups)
    return groups


def publish(runner: Any, scheduler_output: Any, state: EngineState) -> None:
    """Fill the engine's live blocks (``state.live``) from a model runner's requests after it applied
    ``scheduler_output``.

    Only the groups of kvarn layers count, each at its own block size (:func:`kvarn_groups`)."""
    preempted = state.preempted
    preempted |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    preempted -= set(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
    preempted &= set(runner.requests)
    groups = kvarn_groups(runner, state)
    first: set[int] = set()
    for rid, req in runner.requests.items():
        if rid in preempted:
            continue
        for g, _, _, stride in groups:
            if g < len(req.block_ids) and (ids := req.block_ids[g]):
                first.add(ids[0] * stride)
    state.live.first = first
