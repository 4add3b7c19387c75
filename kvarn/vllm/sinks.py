"""Sink slots: the exact first tokens of each sequence, for schemes with ``sink_tokens = S``.

Every tile is packed as without a sink (tile 0 included; pages do not change). Besides, the first
``S`` tokens of a sequence are kept exactly (unrotated, model dtype) in a *sink slot*
(``[num_kv_heads, S, head_dim]`` keys and values per layer), and attention over a packed tile 0
takes positions ``0..S-1`` from the slot instead of dequantizing them. While tile 0 is not full its
tokens are staged unquantized (:mod:`kvarn.vllm.staging`), so the slot is only read once tile 0 is
a packed context tile.

Key: a request's first block id (``row[0]`` of its block table), unique per live request and
stable while it runs. The step that computes positions ``ctx..min(S, seq_len)-1`` writes them.

Prefix caching: a request whose block 0 is a cache hit never computes tokens ``0..S-1``. Block
hashes cover a block's tokens and its prefix, so a hit on block ``X`` as a first block means ``X``
was last filled as the first block of a sequence with the same first tokens, and that fill wrote
the slot keyed ``X``: the request reads it if it survives. If it was reclaimed, the request reads
its tile 0 quantized (as a scheme without a sink would) and :attr:`SinkPool.missing` counts it;
the backend logs a warning the first time.

Bound and reclaim, as for staging: the pool starts small and grows on demand up to
``max_num_seqs`` slots (each growth logged). A slot stays after its request ends (a later prefix
hit may still use it) until a slot is needed: then the least recently used slot whose key is not
a live request's first block (:data:`kvarn.vllm.staging.LIVE_BLOCKS` ``["first"]``, published by the
plugin) is reclaimed; without one the pool grows; at the bound the least recently used slot that
no request of this step touches is taken, and its request falls back to the quantized tile 0. A
request never waits for a slot.

Pure bookkeeping, like the staging planner: it runs once per step in the metadata builder and
fills the ``sink_*`` fields of the step's :class:`~kvarn.vllm.staging.RequestPlan` list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvarn.vllm.staging import LIVE_BLOCKS, RequestPlan, claim_slot


@dataclass
class SinkPool:
    """Assigns sink slots to sequences, keyed by their first block id. One per KV-cache group."""

    num_slots: int
    sink_tokens: int
    max_slots: int = 0  # grow on demand up to this many slots (0: never grow)
    slot_of_block: dict[int, int] = field(default_factory=dict)
    fill: dict[int, int] = field(default_factory=dict)  # slot -> exact tokens it holds (<= sink_tokens)
    last_step: dict[int, int] = field(default_factory=dict)  # slot -> step it was last read or written
    missing: int = 0  # reads of a packed tile 0 without a slot (read quantized); the backend logs it
    step: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be >= 1")
        if self.sink_tokens < 1:
            raise ValueError(f"sink_tokens={self.sink_tokens} must be >= 1")
        self.max_slots = max(self.max_slots, self.num_slots)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.growths: list[int] = []  # pool sizes after each growth (for logging)

    def _allocate(self, busy: set[int]) -> int:
        """A free slot, or -1 when every slot holds a first block of this step's requests."""
        return claim_slot(self, LIVE_BLOCKS.get("first"), busy)[0]

    def plan(self, plans: list[RequestPlan], seq_lens: list[int], block_table: list[list[int]]) -> None:
        """Set ``sink_slot``, ``sink_write`` and ``sink_read`` of this step's plans in place.

        Args:
            plans: the step's plans from :meth:`kvarn.vllm.staging.StagingPool.plan`.
            seq_lens: ``[num_reqs]`` tokens of each request after this step.
            block_table: per request, its block ids (row 0 is the key of its sink slot).
        """
        self.step += 1
        s = self.sink_tokens
        active = [(p, n, row[0]) for p, n, row in zip(plans, seq_lens, block_table, strict=True) if not p.dummy]
        busy = {first for p, _, first in active if p.q_len}
        for p, seq_len, first in active:
            if p.q_len == 0:
                continue
            ctx = seq_len - p.q_len
            slot = self.slot_of_block.get(first, -1)
            if ctx < s:  # this step computes some of the first tokens: keep them
                if ctx and (slot < 0 or self.fill.get(slot, 0) < ctx):
                    continue  # the earlier ones were lost: no partial copy (reads tile 0 quantized)
                if slot < 0:
                    slot = self._allocate(busy)
                    if slot < 0:
                        continue
                    self.slot_of_block[first] = slot
                p.sink_slot, p.sink_write = slot, min(s, seq_len) - ctx
                self.fill[slot] = min(s, seq_len)
                self.last_step[slot] = self.step
            elif p.ctx_blocks:  # tile 0 is a packed context tile: read the copies instead
                if slot < 0:
                    self.missing += 1
                    continue
                p.sink_slot, p.sink_read = slot, self.fill[slot]
                self.last_step[slot] = self.step
