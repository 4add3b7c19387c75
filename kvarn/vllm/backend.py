"""The kvarn attention backend for vLLM: attention over pages of packed tiles and 16-bit tails.

A layer's page is one tile record per KV head (:mod:`kvarn.vllm.pages`). Partially filled tiles
wait in each request's own lookahead blocks (:mod:`kvarn.vllm.tail`) and, for schemes with a sink
(exact first tokens, or KVarN's 16-bit first tile), each sequence's first tokens in a sink pool
(:mod:`kvarn.vllm.sinks`) of ``max_num_seqs`` slots per layer, allocated once the layer's weights
are loaded, before vLLM measures memory for the KV cache, so the KV capacity vLLM reports is net of
it (an explicit ``kv_cache_memory_bytes`` is reduced by its size). The metadata builder plans and
builds every device tensor of a step once (:mod:`kvarn.vllm.planner`, :mod:`kvarn.vllm.step`); a
layer's forward only launches ops (:mod:`kvarn.vllm.forward`): tile-causal attention over pages,
the step's scratch tiles and the sink pool read in place by slot id.

Each impl and builder holds its engine's :class:`~kvarn.vllm.context.EngineState` (with its
:class:`~kvarn.vllm.context.EngineSpec`: the Scheme its ``kv_cache_dtype`` names, resolved once) and
each impl, from its first forward, its own layer's scheme.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvarn.schemes import Scheme
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS
from kvarn.vllm.admission import check_layer
from kvarn.vllm.context import EngineSpec, EngineState, current_config, engine_state
from kvarn.vllm.forward import run_layer
from kvarn.vllm.pages import hybrid_token_bytes, layer_page_bytes, packed_spec, page_bytes
from kvarn.vllm.planner import StepPlanner, shared_planner
from kvarn.vllm.pools import Pool, pool_bytes, zeros_pool
from kvarn.vllm.registry import is_kvarn_dtype
from kvarn.vllm.sinks import SinkPool
from kvarn.vllm.step import StepTensors

logger = logging.getLogger("kvarn.vllm")


class PackedTileBackend(AttentionBackend):
    """What both kvarn backends (:class:`KvarnAttentionBackend` and
    :class:`kvarn.vllm.mla.KvarnMLABackend`) answer vLLM alike: their name and classes (the class
    attributes below), kvarn presets as their cache dtypes, one vLLM block per tile and a page of one
    tile's record (:meth:`record_bytes`)."""

    backend_name: ClassVar[str]
    impl_cls: ClassVar[type[Any]]
    builder_cls: ClassVar[type[Any]]
    block_multiple: ClassVar[int]  # the block sizes offered for a spec that is not packed yet: multiples of this

    @classmethod
    def get_name(cls) -> str:
        return cls.backend_name

    @classmethod
    def get_impl_cls(cls) -> type[Any]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[Any]:
        return cls.builder_cls

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return is_kvarn_dtype(kv_cache_dtype)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        tps = getattr(kv_cache_spec, "tokens_per_state", 1)
        if isinstance(tps, int) and tps > 1:
            return [tps]  # one block = one tile, never split
        return [MultipleOf(cls.block_multiple)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One state per block per KV head: the record of one tile (:meth:`record_bytes`).

        A layer's own spec arrives here already packed (:meth:`KvarnAttentionImpl.layer_spec`, through
        :func:`kvarn.vllm.patches.patch_attention_kv_cache_spec`) and is kept; a spec of no particular
        layer gets :meth:`record_bytes`.
        """
        if spec.state_content_bytes is not None:
            return spec
        engine = EngineSpec.from_config(current_config())
        return packed_spec(spec, engine.scheme, cls.record_bytes(engine, spec))

    @classmethod
    def record_bytes(cls, engine: EngineSpec, spec: AttentionSpec) -> int:
        """Bytes of the page of a spec of no particular layer."""
        raise NotImplementedError


class KvarnMetadataBuilder(AttentionMetadataBuilder[StepTensors]):
    """Builds the step's device tensors once per step, through the model's shared
    :class:`~kvarn.vllm.planner.StepPlanner`."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.state = engine_state(vllm_config)
        self.planner = shared_planner(self.state, kv_cache_spec.block_size, layer_names, StepPlanner)
        self.scheme = self.state.spec.scheme

    @property
    def sinks(self) -> SinkPool | None:
        return self.planner.sinks

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> StepTensors:
        return self.planner.build(common_attn_metadata)


class KvarnAttentionImpl(AttentionImpl):  # type: ignore[type-arg]
    """Per-layer attention over packed tiles plus staged and new tokens; owns the layer's sink pool
    (allocated by :meth:`process_weights_after_loading`)."""

    kvarn_pools = True  # its sink pool keys on blocks (kvarn.vllm.live publishes the live ones)

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_layer(
            kv_cache_dtype,
            head_size,
            sliding_window=sliding_window,
            alibi_slopes=alibi_slopes,
            logits_soft_cap=logits_soft_cap,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name,
            sinks=kwargs.get("sinks"),
            attn_type=attn_type,
        )
        self.state: EngineState = engine_state(get_current_vllm_config(), create=True)
        self.spec = self.state.spec
        self.scheme = self.spec.scheme
        page_bytes(self.scheme, head_size, self.spec.num_layers)  # raises if no layer has a kvarn page
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layer_scheme: Scheme | None = None
        self.ops = self.spec.ops
        # partial tiles wait in the requests' own tail blocks (kvarn.vllm.tail); exact first tokens in a sink pool
        self.sink: Pool | None = None
        self.allocated = False

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Allocate the layer's sink pool (once), before vLLM measures memory for the KV cache, and count
        it against it (vLLM calls this when the model's weights are loaded)."""
        if self.allocated:
            return
        spec, h, d = self.spec, self.num_kv_heads, self.head_size
        if spec.sink_capacity:
            self.sink = zeros_pool(spec.slots, h, spec.sink_capacity, d, spec.dtype, spec.device)
        self.state.reserve(pool_bytes(self.scheme, h, d, spec.dtype, spec.slots))
        self.allocated = True

    def layer_spec(self, spec: AttentionSpec, layer_name: str) -> AttentionSpec:
        """Layer ``layer_name``'s packed spec: a page of its own scheme's tile record per KV head."""
        layer = extract_layer_index(layer_name)
        return packed_spec(spec, self.scheme, layer_page_bytes(self.scheme, spec.head_size, layer))

    def _layer_scheme(self, layer: Any) -> Scheme:
        if self.layer_scheme is None:
            s = self.spec.layer_scheme(extract_layer_index(layer.layer_name))
            if s is None:  # the plugin gives such layers to vLLM's own cache; kept for safety
                raise ValueError(f"{self.scheme.name}: layer {layer.layer_name} is unquantized")
            self.layer_scheme = s
        return self.layer_scheme

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: StepTensors | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[N, Hq, D]``, key/value ``[N, H, D]``, kv_cache ``[B, H, 1, page_bytes]`` uint8."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up
            return output
        out = output.view(-1, self.num_heads, self.head_size)
        scheme = self._layer_scheme(layer)
        pages = kv_cache[:, :, 0, :]
        run_layer(query, key, value, pages, self.sink, attn_metadata, scheme, self.scale, out, self.ops)
        return output


class KvarnAttentionBackend(PackedTileBackend):
    """Selected by the plugin whenever ``kv_cache_dtype`` is a kvarn preset name."""

    backend_name = "KVARN"
    impl_cls = KvarnAttentionImpl
    builder_cls = KvarnMetadataBuilder
    block_multiple = 32
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(ALLOWED_HEAD_DIMS)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def record_bytes(cls, engine: EngineSpec, spec: AttentionSpec) -> int:
        """The widest layer's page."""
        return page_bytes(engine.scheme, spec.head_size, engine.num_layers)


def _smallest_block(backend: Any) -> int:
    sizes = backend.get_supported_kernel_block_sizes()
    return min(s.base if isinstance(s, MultipleOf) else int(s) for s in sizes) if sizes else 1


def shared_page(vllm_config: VllmConfig) -> int | None:
    """Bytes of the page kvarn layers and 16-bit sliding-window layers share, or None (no such mix).

    A model with sliding-window layers is served with those layers 16-bit (the plugin adds
    ``sliding_window`` to ``kv_cache_dtype_skip_layers``): vLLM's own backend and sliding-window
    spec, in their own KV-cache group. vLLM's groups share one block pool, so every page has the
    same size: the larger of the widest kvarn page (one tile per KV head, one block = one tile) and
    the sliding backend's smallest kernel block of 16-bit tokens. The sliding layers pick the
    largest kernel block that fits it (vLLM's ``skip_page_size_padded``); kvarn pages are padded to it.
    """
    layers = list(vllm_config.compilation_config.static_forward_context.values())
    kvarn = [a for a in layers if isinstance(getattr(a, "impl", None), KvarnAttentionImpl)]
    sliding = [
        a
        for a in layers
        if a not in kvarn and getattr(a, "sliding_window", None) is not None and hasattr(a, "kv_cache_torch_dtype")
    ]
    if not kvarn or not sliding:
        return None
    widest = max(a.num_kv_heads * page_bytes(a.impl.scheme, a.head_size, a.impl.spec.num_layers) for a in kvarn)
    per_block = max(
        a.num_kv_heads
        * (a.head_size + a.head_size_v)
        * a.kv_cache_torch_dtype.itemsize
        * _smallest_block(a.get_attn_backend())
        for a in sliding
    )
    return int(max(widest, per_block))


def hybrid_probe(vllm_config: VllmConfig) -> type[AttentionBackend]:
    """The backend vLLM's hybrid block-size alignment should ask: kvarn's, with a page of one token of
    :func:`hybrid_token_bytes` and the tile as its only kernel block size."""
    engine = EngineSpec.from_config(vllm_config)
    token, tile = hybrid_token_bytes(engine), engine.group_size

    class HybridProbe(KvarnAttentionBackend):
        @classmethod
        def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
            return replace(
                spec,
                dtype=torch.uint8,
                num_head_slots=1,
                tokens_per_state=spec.block_size,
                state_content_bytes=token * spec.block_size,
            )

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
            return [tile]

    return HybridProbe
