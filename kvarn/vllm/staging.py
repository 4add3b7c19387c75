"""Staging of partially filled tiles: which unquantized slot holds the tokens of which vLLM block.

A vLLM block is one tile (``group_size`` tokens) per KV head. Its page only ever holds a packed,
quantized record, so the tokens of a block that is not full yet live unquantized in a *staging
slot* (``[num_kv_heads, group_size, head_dim]`` keys and values per layer, in the model dtype),
keyed by the block id. When the block fills, its tile is quantized into the page and the slot is
released (one step later, so no request of the same step can still be reading it).

Bound: a request owns at most one partially filled block (its last one), so ``max_num_seqs``
slots serve every request the scheduler can run at once. The pool starts smaller and grows on
demand up to that bound (each growth is logged), so a server with a large ``max_num_seqs`` does not
pay for staging it never uses. When no slot is free, the pool first reclaims slots of *dead*
blocks: the model runner publishes, every step, the last block of every request it still holds
(:data:`LIVE_BLOCKS`, set by the plugin); a staged block outside that set belongs to a finished or
preempted request. Only then does it grow; at the bound it reclaims the least recently used slot
that no request of this step touches. A reclaimed block that a later step still needs raises
:class:`StagingLostError` instead of reading stale memory. The pool never blocks a request (no
silent concurrency cap).

This module is pure bookkeeping (no tensors): the planner, :class:`StagingPool`, runs once per step
in the metadata builder and every layer applies the same plan to its own staging tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Last block id ("blocks") and first block id ("first", keys of kvarn.vllm.sinks) of every request
# the model runner holds, refreshed each step by the plugin's hook on the runner (None: no hook ran,
# every staged block counts as possibly live).
LIVE_BLOCKS: dict[str, set[int] | None] = {"blocks": None, "first": None}


class StagingLostError(RuntimeError):
    """A partially filled block needed its staged tokens but its slot had been reclaimed."""


class SlotTable(Protocol):
    """What :func:`claim_slot` needs of a pool (:class:`StagingPool`, ``kvarn.vllm.sinks.SinkPool``)."""

    num_slots: int
    max_slots: int
    slot_of_block: dict[int, int]  # block id -> slot
    fill: dict[int, int]  # slot -> tokens it holds
    last_step: dict[int, int]  # slot -> step it was last used
    growths: list[int]
    _free: list[int]


def claim_slot(pool: SlotTable, live: set[int] | None, busy: set[int]) -> tuple[int, int | None]:
    """A slot for a new block: a free one; else, unless an idle slot holds a *dead* block (not in
    ``live``), grow the pool (doubling, up to ``max_slots``); else reclaim the least recently used
    idle slot (not of a block in ``busy``), dead blocks first.

    Returns:
        ``(slot, victim)``: ``victim`` is the reclaimed block when it may still be live (its owner
        will miss its content), else None; ``(-1, None)`` when every slot is busy this step.
    """
    if pool._free:
        return pool._free.pop(), None
    idle = [(pool.last_step.get(s, -1), b) for b, s in pool.slot_of_block.items() if b not in busy]
    dead = [c for c in idle if live is not None and c[1] not in live]
    if not dead and pool.num_slots < pool.max_slots:
        grown = min(2 * pool.num_slots, pool.max_slots)
        pool._free = list(range(grown - 1, pool.num_slots - 1, -1))
        pool.num_slots = grown
        pool.growths.append(grown)
        return pool._free.pop(), None
    victims = sorted(dead or idle)
    if not victims:
        return -1, None
    _, victim = victims[0]
    slot = pool.slot_of_block.pop(victim)
    pool.fill.pop(slot, None)
    return slot, (None if dead else victim)


@dataclass
class RequestPlan:
    """What one request of a step reads and writes (token counts, block ids, slots)."""

    q_start: int  # first token of this request in the step's flattened query
    q_len: int  # new tokens this step
    ctx_blocks: list[int]  # full, quantized context tiles to read (block ids, in order)
    staged_read: int  # staged context tokens (positions after the full tiles), read from read_slot
    read_slot: int  # -1 when staged_read == 0
    commit_blocks: list[int]  # blocks that become full this step: quantize into their pages
    rem_tokens: int  # tokens left in the last, partial block after this step
    rem_slot: int  # its slot (-1 when rem_tokens == 0)
    dummy: bool = False  # a profiling/warm-up request on the null block: no cache reads or writes
    # exact first tokens (schemes with sink_tokens; set by kvarn.vllm.sinks.SinkPool.plan)
    sink_slot: int = -1  # the request's sink slot, -1 when it neither reads nor writes one
    sink_write: int = 0  # this step's first tokens to copy into the slot, at position ctx
    sink_read: int = 0  # exact tokens replacing positions 0.. of ctx_blocks[0] (0: read it quantized)


@dataclass
class StagingPool:
    """Assigns staging slots to partially filled blocks. One per KV-cache group and process."""

    num_slots: int
    block_size: int
    max_slots: int = 0  # grow on demand up to this many slots (0: never grow)
    slot_of_block: dict[int, int] = field(default_factory=dict)
    fill: dict[int, int] = field(default_factory=dict)  # slot -> staged tokens
    last_step: dict[int, int] = field(default_factory=dict)  # slot -> step it was last used
    lost: set[int] = field(default_factory=set)  # blocks whose partial content was reclaimed
    _free: list[int] = field(default_factory=list)
    _release_next: list[int] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be >= 1")
        self.max_slots = max(self.max_slots, self.num_slots)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.growths: list[int] = []  # pool sizes after each growth (for logging)

    def _release(self, block: int) -> None:
        slot = self.slot_of_block.pop(block, None)
        if slot is not None:
            self.fill.pop(slot, None)
            self._release_next.append(slot)

    def _allocate(self, block: int, busy_blocks: set[int]) -> int:
        self._release(block)  # reused from offset 0: whatever was staged for it is stale
        self.lost.discard(block)
        slot, live_victim = claim_slot(self, LIVE_BLOCKS["blocks"], busy_blocks)
        if slot < 0:
            raise StagingLostError(
                f"all {self.num_slots} kvarn staging slots hold blocks of this step's requests; "
                "raise max_num_seqs or KVARN_STAGING_SLOTS"
            )
        if live_victim is not None:
            self.lost.add(live_victim)
        return slot

    def plan(
        self,
        query_start: list[int],
        seq_lens: list[int],
        block_table: list[list[int]],
    ) -> list[RequestPlan]:
        """Plan one step for ``len(seq_lens)`` requests; updates the slot table.

        Args:
            query_start: ``[num_reqs + 1]`` offsets of each request's new tokens.
            seq_lens: ``[num_reqs]`` tokens of each request after this step.
            block_table: per request, its block ids (at least ``ceil(seq_len / block_size)``).
        """
        self.step += 1
        self._free.extend(self._release_next)  # slots released last step are safe to reuse now
        self._release_next = []
        t = self.block_size
        busy: set[int] = set()  # partial blocks this step reads or writes: never reclaimed now
        for i, (row, s) in enumerate(zip(block_table, seq_lens, strict=True)):
            ctx = s - (query_start[i + 1] - query_start[i])
            busy.update(row[p // t] for p in (ctx, s) if p % t and p // t < len(row))
        plans: list[RequestPlan] = []
        for i, seq_len in enumerate(seq_lens):
            q0, q_len = query_start[i], query_start[i + 1] - query_start[i]
            ctx = seq_len - q_len
            row = block_table[i]
            n_full, staged = divmod(ctx, t)
            last = seq_len // t
            rem = seq_len - last * t
            if q_len == 0 or not row or row[: (seq_len + t - 1) // t].count(0) > 0:
                plans.append(RequestPlan(q0, q_len, [], 0, -1, [], 0, -1, dummy=True))
                continue
            read_slot = -1
            if staged:
                block = row[n_full]
                slot = self.slot_of_block.get(block, -1)
                if slot < 0 or self.fill.get(slot, 0) < staged:
                    why = "was reclaimed" if block in self.lost else "was never staged"
                    raise StagingLostError(
                        f"kvarn: block {block} needs {staged} staged tokens but its staging slot {why}; "
                        f"{self.num_slots} slots are too few here: raise KVARN_STAGING_SLOTS"
                    )
                read_slot = slot
                self.last_step[slot] = self.step
            commit = [row[j] for j in range(n_full, last)]
            rem_slot = -1
            if rem:
                block = row[last]
                if staged and last == n_full:  # the same block keeps filling
                    rem_slot = read_slot
                else:
                    rem_slot = self._allocate(block, busy)
                    self.slot_of_block[block] = rem_slot
                self.fill[rem_slot] = rem
                self.last_step[rem_slot] = self.step
            if staged and last > n_full:  # the staged block is full now
                self._release(row[n_full])
            plans.append(RequestPlan(q0, q_len, row[:n_full], staged, read_slot, commit, rem, rem_slot))
        return plans
