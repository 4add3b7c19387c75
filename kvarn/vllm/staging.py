"""A step's plan of each request (:class:`RequestPlan`) and the blocks live requests hold
(:class:`LiveBlocks`).

A vLLM block is one tile of ``block_size`` tokens. Until it is full its tokens cannot be quantized
(a tile's scales need all of them): they wait unquantized in the request's own lookahead blocks
(:mod:`kvarn.vllm.tail`), and a step attends them from a 16-bit scratch tile, numbered within the
step (``read_slot``, ``new_slot``). :func:`kvarn.vllm.tail.plan_tails` makes the plans,
:class:`kvarn.vllm.sinks.SinkPool` adds the sink slots, and :mod:`kvarn.vllm.step` turns them into the
device tensors every layer uses. Pure bookkeeping (no tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class LiveBlocks:
    """The blocks live requests hold in one engine, refreshed every step by
    :func:`kvarn.vllm.live.publish` (one per :class:`~kvarn.vllm.context.EngineState`).

    ``first``: each live request's first block (the keys of :class:`kvarn.vllm.sinks.SinkPool`). None
    until published: every block then counts as possibly live.
    ``uncache``: drops a first block (a sink key) from vLLM's prefix cache, so that no later request
    reads it as a prefix hit; set by the engine's KV-cache manager where it runs in the workers'
    process (:class:`kvarn.vllm.tail_spec.TailManager`), None elsewhere.
    """

    first: set[int] | None = None
    uncache: Callable[[int], None] | None = None


@dataclass
class RequestPlan:
    """What one request of a step reads and writes (token counts, block ids, slots).

    Positions: ``ctx`` tokens were computed before this step, ``q_len`` are new; ``row`` holds the
    block ids of tiles ``0..ceil((ctx + q_len) / block_size) - 1``.
    """

    q_start: int  # first token of this request in the step's flattened query
    q_len: int  # new tokens this step
    ctx: int  # tokens computed before this step
    row: list[int]  # block ids of the tiles this step reads or writes, in order
    read_slot: int = -1  # slot of the partial tile ctx // T (ctx % T staged tokens), -1 when none
    new_slot: int = -1  # slot of the last, partial tile when it is not the staged one, -1 when none
    dummy: bool = False  # a profiling/warm-up request on the null block: no cache reads or writes
    # exact first tokens (schemes with sink_tokens or a sink tile; set by kvarn.vllm.sinks.SinkPool.plan)
    sink_slot: int = -1  # the request's sink slot, -1 when it neither reads nor writes one
    sink_write: int = 0  # this step's first tokens to copy into the slot, at row ctx
    sink_read: int = 0  # exact rows readable from the slot by tiles after tile 0 (0: tile 0 quantized)

    def staged(self, t: int) -> int:
        """Staged tokens read from ``read_slot`` (those of tile ``ctx // t`` before this step)."""
        return self.ctx % t
