"""Sink slots: the exact first tokens of each sequence, for schemes that keep them unquantized.

Two kinds, one pool (``[num_slots, num_kv_heads, capacity, head_dim]`` keys and values per layer,
model dtype, unrotated):

* ``sink_tokens = S`` (S = 1 in every plain name such as ``kvarn_k4v2_g128``, the default;
  ``_sink2`` ... ``_sink8``): capacity ``S``. Every tile is packed as without a sink (tile 0
  included); attention over the packed tile 0 takes positions ``0..S-1`` from the slot.
  ``_sink0`` names keep no exact token and get no pool.
* ``sink_tile`` (``_sink``, KVarN's behaviour): capacity ``group_size``. The whole first tile stays
  16-bit for the request's life: attention reads it from the slot, then packed tiles ``1..``. Its
  page is written (quantized) all the same, so a request whose copies were reclaimed still reads
  a valid, quantized tile 0.

Key: a request's first block id (``row[0]``), stable while it runs (requests sharing a cached first
block share its copies: same tokens). The step that computes positions ``ctx..capacity-1`` writes them
(before attention, so later tiles of the same step read them). Tiles after tile 0 read the copies
once the slot holds all ``capacity`` rows.

Prefix caching: block hashes cover a block's tokens and its prefix, so a hit on block ``X`` as a
first block means ``X`` was filled as the first block of a sequence with the same first tokens,
and that fill wrote the slot keyed ``X``: the request reads it while it survives. Slots of finished
requests stay until a slot is needed (KVarN retires a finished request's sink rather than dropping
it). A slot is reclaimed only from a sequence no running request holds, and its first block then
leaves vLLM's prefix cache (:attr:`~kvarn.vllm.staging.LiveBlocks.uncache`): a later request with the
same first tokens computes them again rather than reading tile 0 without its exact rows. Where that
hook is not set (the scheduler in another process than the workers: tensor or pipeline
parallelism), such a request reads its tile 0 quantized (:attr:`SinkPool.missing` counts such reads;
the backend logs a warning the first time).

Bound and reclaim: ``max_num_seqs`` slots, allocated at start-up. A new sequence takes a free slot,
else the least recently used slot whose key is no live request's first block
(the engine's :class:`~kvarn.vllm.staging.LiveBlocks` ``.first``), else the least recently used slot no request
of this step touches (that request falls back to the quantized tile 0). A request never waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvarn.vllm.staging import LiveBlocks, RequestPlan


@dataclass
class SinkPool:
    """Assigns sink slots to sequences, keyed by their first block id. One per engine (its shared planner).

    ``live``: the blocks the engine's live requests hold (dead sequences' slots are reclaimed first).
    """

    num_slots: int
    capacity: int  # exact rows per slot: sink_tokens, or group_size for a sink tile
    block_size: int
    live: LiveBlocks = field(default_factory=LiveBlocks)
    slot_of_block: dict[int, int] = field(default_factory=dict)
    fill: dict[int, int] = field(default_factory=dict)  # slot -> exact tokens it holds (<= capacity)
    last_step: dict[int, int] = field(default_factory=dict)  # slot -> step it was last read or written
    missing: int = 0  # reads of a packed tile 0 without its copies (read quantized); the backend logs it
    step: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be >= 1")
        if not 1 <= self.capacity <= self.block_size:
            raise ValueError(f"capacity={self.capacity} must be in 1..block_size={self.block_size}")
        self._free = list(range(self.num_slots - 1, -1, -1))

    def _claim(self, busy: set[int]) -> int:
        """A free slot, else the LRU idle slot (dead first); -1 when every slot is busy this step."""
        if self._free:
            return self._free.pop()
        live = self.live.first
        idle = [b for b in self.slot_of_block if b not in busy]
        dead = [b for b in idle if live is not None and b not in live]
        if not idle:
            return -1
        victim = min(dead or idle, key=lambda b: self.last_step.get(self.slot_of_block[b], -1))
        slot = self.slot_of_block.pop(victim)
        self.fill.pop(slot, None)
        if self.live.uncache is not None:
            self.live.uncache(victim)
        return slot

    def full_slot(self, first_block: int) -> int:
        """The slot holding all ``capacity`` exact rows of the sequence whose first block is
        ``first_block``; -1 if none."""
        slot = self.slot_of_block.get(first_block, -1)
        return slot if slot >= 0 and self.fill.get(slot, 0) >= self.capacity else -1

    def adopt(self, first_block: int) -> int:
        """A slot for the sequence whose first block is ``first_block``, marked full because the caller
        is about to write all its rows (a KV connector loading them): the sequence's own slot, a free
        one, or the least recently used slot of a sequence no live request holds. -1 when every slot
        belongs to a live request (the sequence then reads its tile 0 quantized, as after a reclaimed
        slot).

        Called between steps, never while a planned step's tensors are in use: it takes no slot that a
        live request keys.
        """
        slot = self.slot_of_block.get(first_block, -1)
        if slot < 0:
            live = self.live.first
            busy = set(live) if live is not None else set(self.slot_of_block)
            slot = self._claim(busy - {first_block})
            if slot < 0:
                return -1
            self.slot_of_block[first_block] = slot
        self.fill[slot] = self.capacity
        self.last_step[slot] = self.step
        return slot

    def plan(self, plans: list[RequestPlan]) -> None:
        """Set ``sink_slot``, ``sink_write`` and ``sink_read`` of this step's plans in place.

        Writers are planned before readers, so a request whose first block is a prefix-cache hit on a
        block another request of the same step fills reads that request's copies.
        """
        self.step += 1
        cap, t = self.capacity, self.block_size
        active = [p for p in plans if not p.dummy]
        busy = {p.row[0] for p in active}
        for p in active:
            seq_len = p.ctx + p.q_len
            if p.ctx >= cap:
                continue
            first = p.row[0]
            slot = self.slot_of_block.get(first, -1)
            if p.ctx and (slot < 0 or self.fill.get(slot, 0) < p.ctx):
                continue  # the earlier ones were lost: no partial copy (reads tile 0 quantized)
            if slot < 0:
                slot = self._claim(busy)
                if slot < 0:
                    continue
                self.slot_of_block[first] = slot
            p.sink_slot, p.sink_write = slot, min(cap, seq_len) - p.ctx
            self.fill[slot] = min(cap, seq_len)
            self.last_step[slot] = self.step
        for p in active:
            if p.ctx + p.q_len <= t:  # every tile this step attends is tile 0, read exactly
                continue
            slot = self.slot_of_block.get(p.row[0], -1)
            if slot < 0 or self.fill.get(slot, 0) < cap:
                self.missing += 1
                continue
            p.sink_slot, p.sink_read = slot, cap
            self.last_step[slot] = self.step
