"""A step's plan of each request (:class:`RequestPlan`), the blocks live requests hold
(:class:`LiveBlocks`), and a staging pool's slot bookkeeping (:class:`StagingPool`).

kvarn's engines keep partial tiles in each request's own lookahead blocks (:mod:`kvarn.vllm.tail`),
every model kind alike; :class:`StagingPool` remains as the slot bookkeeping of a pool that
:func:`kvarn.vllm.forward.run_layer` can also read (tests drive attention through it without pages
of tails). What follows describes that pool.

A vLLM block is one tile of ``block_size`` tokens. Until it is full its tokens cannot be quantized
(a tile's scales need all of them), so they live unquantized in a *staging slot* (per layer,
``[num_kv_heads, block_size, head_dim]`` keys and values in the model dtype), keyed by the block id.
When the block fills, its tile is quantized into the page; the slot keeps the exact tokens
(``fill == block_size``) until it is needed again, so a step whose draft tokens are rejected
(speculative decoding rolls the sequence back into the tile) still finds them.

Bound: a request owns at most one partially filled block, so a pool of ``max_num_seqs`` slots
never runs out. A new block takes a free
slot, else the least recently used slot that no request of this step touches and that holds a
*full* tile or a *dead* block (the model runner publishes, every step, the block each live request
is filling into the engine's :class:`LiveBlocks`, see :mod:`kvarn.vllm.live`). In a step planned with
``reuse_now=True`` (the backend writes new blocks' tokens only after attention there) a full tile
read by this very step may be taken too. Only if none is left is a live request's idle block
reclaimed; if that request later needs it, :class:`StagingLostError` is raised: never stale tokens,
never a silent wait.

Pure bookkeeping (no tensors): :mod:`kvarn.vllm.step` turns plans into the device tensors every
layer uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LiveBlocks:
    """The blocks live requests hold in one engine, refreshed every step from
    :func:`kvarn.vllm.live.live_blocks` (one per :class:`~kvarn.vllm.context.EngineContext`).

    ``blocks``: the block each live request is filling; ``first``: each live request's first block
    (the keys of :class:`kvarn.vllm.sinks.SinkPool`). None until published: every block then counts
    as possibly live.
    """

    blocks: set[int] | None = None
    first: set[int] | None = None


class StagingLostError(RuntimeError):
    """A partially filled block needed its staged tokens but its slot had been reclaimed."""


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


@dataclass
class StagingPool:
    """Assigns staging slots to partially filled blocks. One per engine (its shared planner).

    ``live``: the blocks the engine's live requests hold (dead blocks' slots are reclaimed first).
    """

    num_slots: int
    block_size: int
    live: LiveBlocks = field(default_factory=LiveBlocks)
    slot_of_block: dict[int, int] = field(default_factory=dict)
    fill: dict[int, int] = field(default_factory=dict)  # slot -> staged tokens (block_size: a full tile)
    last_step: dict[int, int] = field(default_factory=dict)  # slot -> step it was last used
    lost: set[int] = field(default_factory=set)  # blocks whose partial content was reclaimed
    step: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be >= 1")
        self._free = list(range(self.num_slots - 1, -1, -1))

    def _claim(self, busy: set[int], read_now: set[int]) -> tuple[int, int | None]:
        """A slot for a new block: ``(slot, victim)``, ``victim`` the live block it held, or None."""
        if self._free:
            return self._free.pop(), None
        live = self.live.blocks
        full = self.block_size

        def spare(b: int) -> bool:  # a full tile or a block no live request fills
            return self.fill.get(self.slot_of_block[b], 0) >= full or (live is not None and b not in live)

        for pool in (
            [b for b in self.slot_of_block if b not in busy and spare(b)],
            [b for b in self.slot_of_block if b in read_now and spare(b)],  # written after attention
            [b for b in self.slot_of_block if b not in busy],
        ):
            if pool:
                victim = min(pool, key=lambda b: self.last_step.get(self.slot_of_block[b], -1))
                slot = self.slot_of_block.pop(victim)
                self.fill.pop(slot, None)
                return slot, (None if live is not None and victim not in live else victim)
        return -1, None

    def plan(
        self,
        query_start: list[int],
        seq_lens: list[int],
        block_table: list[list[int]],
        *,
        reuse_now: bool = False,
    ) -> list[RequestPlan]:
        """Plan one step for ``len(seq_lens)`` requests; updates the slot table.

        Args:
            query_start: ``[num_reqs + 1]`` offsets of each request's new tokens.
            seq_lens: ``[num_reqs]`` tokens of each request after this step.
            block_table: per request, its block ids (at least ``ceil(seq_len / block_size)``).
            reuse_now: new blocks' tokens are written after this step's attention, so a full tile
                read by this step may hand its slot to a new block of the same step.
        """
        self.step += 1
        t = self.block_size
        plans: list[RequestPlan] = []
        busy: set[int] = set()  # blocks whose slots this step reads or writes
        for i, seq_len in enumerate(seq_lens):
            q0, q_len = query_start[i], query_start[i + 1] - query_start[i]
            row = block_table[i][: (seq_len + t - 1) // t]
            p = RequestPlan(q0, q_len, seq_len - q_len, row)
            p.dummy = q_len == 0 or not row or 0 in row
            plans.append(p)
            if not p.dummy:
                busy.update(row[q // t] for q in (p.ctx, seq_len - 1))
        read_now: set[int] = set()
        for p in plans:  # reads first: a staged tile must have its tokens
            staged = p.staged(t)
            if p.dummy or not staged:
                continue
            block = p.row[p.ctx // t]
            slot = self.slot_of_block.get(block, -1)
            if slot < 0 or self.fill.get(slot, 0) < staged:
                why = "was reclaimed" if block in self.lost else "was never staged"
                raise StagingLostError(
                    f"kvarn: block {block} needs {staged} staged tokens but its staging slot {why} "
                    f"({self.num_slots} slots for max_num_seqs requests)"
                )
            p.read_slot = slot
            self.fill[slot] = min(t, staged + p.q_len)
            self.last_step[slot] = self.step
            read_now.add(block)
        for p in plans:  # then new partial blocks
            seq_len = p.ctx + p.q_len
            if p.dummy or not seq_len % t or seq_len // t == p.ctx // t and p.read_slot >= 0:
                continue
            block = p.row[-1]
            old = self.slot_of_block.pop(block, None)  # reused from row 0: what it held is stale
            if old is not None:
                self.fill.pop(old, None)
                self._free.append(old)
            self.lost.discard(block)
            slot, victim = self._claim(busy, read_now if reuse_now else set())
            if slot < 0:
                raise StagingLostError(
                    f"kvarn: all {self.num_slots} staging slots hold blocks this step reads; "
                    "raise max_num_seqs or KVARN_STAGING_SLOTS"
                )
            if victim is not None:
                self.lost.add(victim)
            self.slot_of_block[block] = slot
            self.fill[slot] = seq_len % t
            self.last_step[slot] = self.step
            p.new_slot = slot
        return plans
