"""Which blocks live requests are filling, published every step for the staging and sink pools.

The model runner knows, for every request it holds, its block ids and ``num_computed_tokens``; the
attention metadata builder sees only the requests scheduled in the step. Wrapping the runner's
``_update_states`` (it runs at the start of every step, before the metadata is built), this module
publishes into :data:`kvarn.vllm.staging.LIVE_BLOCKS`:

* ``"blocks"``: the block each live request fills next, ``block_ids[num_computed_tokens // block_size]``
  (not its last block: with speculative decoding vLLM allocates blocks ahead, and a rejected draft
  rolls a request back into a tile it had completed);
* ``"first"``: each live request's first block (the key of its sink slot).

Preempted requests are not live: vLLM frees their blocks, and they recompute their tokens when they
resume. Installed by :class:`kvarn.vllm.backend.KvarnAttentionImpl` in the worker process.
"""

from __future__ import annotations

from typing import Any

from kvarn.vllm.staging import LIVE_BLOCKS


def publish(runner: Any, scheduler_output: Any) -> None:
    """Fill :data:`LIVE_BLOCKS` from a model runner's requests after it applied ``scheduler_output``."""
    preempted: set[str] = runner.__dict__.setdefault("_kvarn_preempted", set())
    preempted |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    preempted -= set(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
    preempted &= set(runner.requests)
    t = int(runner.cache_config.block_size)
    blocks: set[int] = set()
    first: set[int] = set()
    for rid, req in runner.requests.items():
        if rid in preempted:
            continue
        at = int(req.num_computed_tokens) // t
        for ids in req.block_ids:
            if ids:
                first.add(ids[0])
                if at < len(ids):
                    blocks.add(ids[at])
    LIVE_BLOCKS["blocks"], LIVE_BLOCKS["first"] = blocks, first


def install() -> None:
    """Wrap ``GPUModelRunner._update_states`` (the CPU runner inherits it) once per process."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # pragma: no cover - another runner layout: the pools then reclaim LRU only
        return
    if getattr(GPUModelRunner, "_kvarn_publish_live", False):
        return
    original = GPUModelRunner._update_states

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        try:
            publish(self, scheduler_output)
        except AttributeError:  # pragma: no cover - a runner without these fields
            LIVE_BLOCKS["blocks"] = LIVE_BLOCKS["first"] = None
        return result

    GPUModelRunner._update_states = _update_states  # type: ignore[method-assign]
    GPUModelRunner._kvarn_publish_live = True  # type: ignore[attr-defined]
