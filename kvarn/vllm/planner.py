"""The slot planning of one model's kvarn layers, shared by all their metadata builders.

Layers of different page sizes (a mixed-bit preset) fall into different vLLM attention groups,
each with its own builder, all called every step with the same ``CommonAttentionMetadata``. The
tail moves, scratch tiles and sink slots are the same for every layer, so the first builder of a
step plans them and the others reuse its :class:`~kvarn.vllm.step.StepTensors` (planning twice
would advance the sink pool twice). :func:`shared_planner` hands every builder of one engine the same planner, held by its
:class:`~kvarn.vllm.context.EngineState`: a :class:`StepPlanner` for the standard backend, a
:class:`kvarn.vllm.mla.MLAPlanner` for MLA.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from kvarn.schemes import Scheme
from kvarn.vllm.context import EngineState
from kvarn.vllm.pools import sink_capacity
from kvarn.vllm.sinks import SinkPool
from kvarn.vllm.staging import LiveBlocks, RequestPlan
from kvarn.vllm.step import StepTensors, build_step
from kvarn.vllm.tail import Scratch, TailLayout, TailMoves, plan_tails
from kvarn.vllm.tail_cost import describe

logger = logging.getLogger("kvarn.vllm")

StepT = TypeVar("StepT")


class Planner(Generic[StepT]):
    """Plans each step's tail moves, scratch tiles and sink slots once, for every kvarn layer of one model.

    ``build(m)`` returns the step's tensors; called again with the same step's metadata (the same
    object, or vLLM's copy of it for another group) it returns the tensors it already built.
    """

    def __init__(self, scheme: Scheme, slots: int, layout: TailLayout, live: LiveBlocks | None = None) -> None:
        """``slots``: sink slots; ``layout``: where partial tiles wait (:mod:`kvarn.vllm.tail`);
        ``live``: the blocks the engine's live requests hold (the sink pool reclaims dead ones first)."""
        self.scheme = scheme
        self.layout = layout
        live = live if live is not None else LiveBlocks()
        self.scratch = Scratch()
        self.moves: TailMoves | None = None  # the planned step's tail traffic
        cap = sink_capacity(scheme)
        self.sinks = SinkPool(slots, cap, scheme.group_size, live) if cap else None
        self.warned_missing = False
        self.layers: set[str] = set()  # the layers whose builders share this planner
        # the last step's metadata (held, so that its id cannot be reused) and its tensors
        self.last: tuple[CommonAttentionMetadata, StepT] | None = None

    def build(self, m: CommonAttentionMetadata) -> StepT:
        """The step's tensors, planned on the step's first call."""
        if self.last is not None and self._same_step(self.last[0], m):
            return self.last[1]
        step = self.plan(m)
        self.last = (m, step)
        return step

    @staticmethod
    def _same_step(a: CommonAttentionMetadata, b: CommonAttentionMetadata) -> bool:
        # the same object, or a copy vLLM made of it for another group (its tensors are shared)
        return a is b or (
            a.query_start_loc_cpu is b.query_start_loc_cpu
            and a.seq_lens is b.seq_lens
            and torch.equal(a.block_table_tensor, b.block_table_tensor)
        )

    def plan(self, m: CommonAttentionMetadata) -> StepT:
        """Plan one step's slots and build its tensors."""
        raise NotImplementedError

    def writes(self, plans: list[RequestPlan], m: CommonAttentionMetadata, decode: bool) -> StepTensors:
        """The :class:`StepTensors` of planned requests on the device of ``m``'s block table."""
        table = m.block_table_tensor[: m.num_reqs]
        phase = getattr(m, "is_prefilling", None)  # None where vLLM's metadata does not carry it
        prefilling = phase[: m.num_reqs].tolist() if phase is not None else None
        return build_step(
            plans,
            table,
            self.scheme.group_size,
            sink_tile=self.scheme.sink_tile,
            has_sink=self.sinks is not None,
            decode=decode,
            prefilling=prefilling,
            tail=self.moves,
            layout=self.layout,
            scratch=self.scratch,
        )

    def plan_requests(self, m: CommonAttentionMetadata) -> tuple[list[RequestPlan], bool]:
        """The tail (and sink) plans of one step's requests, and whether it is a decode step."""
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].cpu().tolist()
        host = m.block_table_tensor[:n].cpu()
        rows = [host[i, : self.layout.table_blocks(s)].tolist() for i, s in enumerate(seq_lens)]
        decode = all(b - a == 1 for a, b in zip(qsl, qsl[1:], strict=False))
        plans, self.moves = plan_tails(qsl, seq_lens, rows, self.layout, m.block_table_tensor.device)
        if self.sinks is not None:
            self.sinks.plan(plans)
            if self.sinks.missing and not self.warned_missing:
                self.warned_missing = True
                logger.warning(
                    "kvarn %s: a request reads its first tile without its exact copies (their sink slot was "
                    "reclaimed: a prefix-cache hit on a sequence that ended long ago); it reads tile 0 "
                    "quantized. Logged once.",
                    self.scheme.name,
                )
        return plans, decode


class StepPlanner(Planner[StepTensors]):
    """The planner of the standard backend: a step is one :class:`StepTensors`."""

    def plan(self, m: CommonAttentionMetadata) -> StepTensors:
        plans, decode = self.plan_requests(m)
        return self.writes(plans, m, decode)


P = TypeVar("P", bound=Planner[Any])


def shared_planner(state: EngineState, block_size: int, layer_names: list[str], factory: type[P]) -> P:
    """The planner the kvarn layers of one engine share (made by the first metadata builder; a new
    one when builders are made anew for a new KV cache), logging the pools' size when made.

    Raises:
        ValueError: the builder's ``block_size`` is not one tile of the engine's scheme.
    """
    spec = state.spec
    spec.check_block_size(block_size)
    names = set(layer_names)
    shared = state.planner
    if type(shared) is factory and isinstance(shared, factory) and not names & shared.layers:
        shared.layers |= names
        return shared
    scheme, layout = spec.scheme, spec.layout
    planner = factory(scheme, spec.slots, layout, state.live)
    planner.layers |= names
    state.planner = planner
    cap = spec.sink_capacity
    what = "the first tile (16-bit)" if scheme.sink_tile else f"the first {cap} token(s)"
    blocks = int(state.vllm_config.cache_config.block_size or block_size)  # vLLM's: several tiles in a hybrid
    cfg = state.vllm_config
    max_len = getattr(cfg.model_config, "max_model_len", None) if cfg.model_config is not None else None
    num_blocks = getattr(cfg.cache_config, "num_gpu_blocks", None)  # set by the worker before the KV cache
    logger.warning("kvarn %s: %s", scheme.name, describe(layout, spec.tile_bytes, blocks, max_len, num_blocks))
    if cap:
        logger.warning(
            "kvarn %s: exact copies of %s: %d slots per layer (max(max_num_seqs=%d, KVARN_STAGING_SLOTS)) = %.1f MiB "
            "over %d layers, allocated before the KV cache and counted against its memory",
            scheme.name,
            what,
            spec.slots,
            spec.max_num_seqs,
            state.pools.bytes / 2**20,
            state.pools.layers,
        )
    return planner
