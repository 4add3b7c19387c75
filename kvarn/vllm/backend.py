"""The kvarn attention backend for vLLM: pages of packed tiles, staging of partial tiles.

Page layout (``[num_blocks, num_kv_heads, 1, page_bytes]`` uint8 per layer, vLLM's LBHNC layout):
one vLLM block is one tile of ``group_size`` tokens per KV head, and its state is the packed
record of :func:`kvarn.codec.quantize_tiles`, so a layer's page is ``tile_bytes(head_dim)`` of
*its own* scheme (``scheme.for_layer(i)``): a preset with per-layer bit widths (what ``kvarn-tune``
writes) gives its layers different page sizes, which vLLM keeps in one KV-cache group
(``UniformTypeKVCacheSpecs``: a block's bytes are the sum of the layers' pages). vLLM derives the
number of blocks, and so the KV tokens it reports, from that sum, so a mixed preset gets exactly
its byte ratio (less the pools below). A layer the preset keeps unquantized (an fp16 override) is
not served here: the plugin lists it in vLLM's ``kv_cache_dtype_skip_layers``, so vLLM builds it with
its own 16-bit cache, spec and attention backend, in the same group (its 16-bit page adds to the sum).

Partially filled tiles live in a staging pool (:mod:`kvarn.vllm.staging`) and, for schemes with a
sink (exact first tokens, or KVarN's 16-bit first tile), each sequence's first tokens in a sink
pool (:mod:`kvarn.vllm.sinks`). Both pools hold ``max_num_seqs`` slots per layer, allocated when
the layer is built, before vLLM measures memory for the KV cache, so the KV capacity vLLM reports is
net of them (an explicit ``kv_cache_memory_bytes`` is reduced by their size). The metadata builder
plans slots and builds every device tensor of a step once (:mod:`kvarn.vllm.step`); a layer's
forward only launches ops (:mod:`kvarn.vllm.forward`): tile-causal attention over pages, staging
and sink pools read in place by slot id.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
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

from kvarn.schemes import Scheme, get_preset
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS
from kvarn.vllm import live
from kvarn.vllm.forward import run_layer
from kvarn.vllm.plugin import is_kvarn_dtype, staging_slots
from kvarn.vllm.pools import POOLS, pool_bytes, reserve, sink_capacity
from kvarn.vllm.sinks import SinkPool
from kvarn.vllm.staging import RequestPlan, StagingPool
from kvarn.vllm.step import StepTensors, build_step

logger = logging.getLogger("kvarn.vllm")


def _scheme_of(cache_dtype: str) -> Scheme:
    return get_preset(cache_dtype).scheme


# (kv_cache_dtype, num_layers) of this process, recorded when the model's attention layers are
# built (a vLLM config is current then); customize_spec runs later, when none may be.
_ACTIVE: dict[str, tuple[str, int]] = {}


def _record_active(config: VllmConfig) -> None:
    layers = config.model_config.get_num_layers(config.parallel_config) if config.model_config else 1
    _ACTIVE["current"] = (str(config.cache_config.cache_dtype), layers)


def _active() -> tuple[Scheme, int]:
    if "current" not in _ACTIVE:
        raise RuntimeError("kvarn: no kvarn attention layer was built in this process")
    name, layers = _ACTIVE["current"]
    if not is_kvarn_dtype(name):
        raise RuntimeError(f"the kvarn backend is active but kv_cache_dtype is {name!r}")
    return _scheme_of(name), layers


def layer_page_bytes(scheme: Scheme, head_dim: int, layer: int) -> int:
    """Bytes of layer ``layer``'s page per KV head: one tile record of the layer's own scheme."""
    if head_dim not in ALLOWED_HEAD_DIMS:
        raise ValueError(
            f"{scheme.name}: head_dim {head_dim} is not supported; supported: {', '.join(map(str, ALLOWED_HEAD_DIMS))}"
        )
    s = scheme.for_layer(layer)
    if s is None:
        raise ValueError(
            f"{scheme.name}: layer {layer} is unquantized (fp16 override): it is served by vLLM's own cache "
            "(the plugin lists it in kv_cache_dtype_skip_layers), never by the kvarn backend"
        )
    return s.tile_bytes(head_dim)


def page_bytes(scheme: Scheme, head_dim: int, num_layers: int) -> int:
    """Bytes of the widest page per KV head over the quantized layers of ``num_layers`` (fp16-override
    layers are vLLM's: :func:`kvarn.vllm.plugin.keep_16bit_layers`).

    Used where vLLM asks for a spec without saying which layer (``customize_spec`` from its
    block-size alignment); each layer's own spec uses :func:`layer_page_bytes`.
    """
    quantized = [i for i in range(max(num_layers, 1)) if scheme.for_layer(i) is not None]
    if not quantized:
        raise ValueError(f"{scheme.name}: every one of the {num_layers} layers is unquantized (fp16 overrides)")
    return max(layer_page_bytes(scheme, head_dim, layer) for layer in quantized)


def packed_spec(spec: AttentionSpec, scheme: Scheme, content_bytes: int) -> AttentionSpec:
    """``spec`` with one state of ``content_bytes`` per KV head per block of ``group_size`` tokens."""
    return replace(spec, dtype=torch.uint8, state_content_bytes=content_bytes, tokens_per_state=scheme.group_size)


def install_layer_specs() -> None:
    """Give each kvarn layer its own page size (once per process).

    vLLM asks a backend to adjust a layer's spec through ``customize_spec(spec)``, which does not say
    which layer it is, so a per-layer width cannot be set there. vLLM's model runner builds every
    spec with the attention layer's ``get_kv_cache_spec``, which knows its ``layer_name``: wrapped
    here, a layer served by :class:`KvarnAttentionImpl` returns its packed spec (``customize_spec``
    then leaves a spec with ``state_content_bytes`` set as it is). Other layers are untouched.
    """
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention, "_kvarn_layer_specs", False):
        return
    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self: Any, vllm_config: VllmConfig) -> Any:
        impl = getattr(self, "impl", None)
        shared = shared_page(vllm_config)
        if shared is not None:  # sliding layers pad their bf16 pages to the shared page
            vllm_config.cache_config.skip_page_size_padded = shared
        spec = original(self, vllm_config)
        if isinstance(impl, KvarnAttentionImpl) and isinstance(spec, AttentionSpec):
            spec = impl.layer_spec(spec, self.layer_name)
            if shared is not None and shared > spec.page_size_bytes:
                spec = replace(spec, page_size_padded=shared)
        return spec

    Attention.get_kv_cache_spec = get_kv_cache_spec  # type: ignore[method-assign]
    Attention._kvarn_layer_specs = True  # type: ignore[attr-defined]


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
    widest = max(a.num_kv_heads * page_bytes(a.impl.scheme, a.head_size, _active()[1]) for a in kvarn)
    per_block = max(
        a.num_kv_heads
        * (a.head_size + a.head_size_v)
        * a.kv_cache_torch_dtype.itemsize
        * _smallest_block(a.get_attn_backend())
        for a in sliding
    )
    return int(max(widest, per_block))


def hybrid_token_bytes(vllm_config: VllmConfig) -> int:
    """Bytes per token of the widest kvarn page in a hybrid (Mamba / linear-attention) model, rounded up.

    vLLM sizes a hybrid model's attention blocks so that one attention page holds at least one Mamba
    state page, and pads the Mamba pages to ``block_size`` x the attention page of one token
    (``Platform._align_hybrid_block_size``). A kvarn page holds whole tiles, so its page of one
    token is 0 bytes (vLLM would divide by it); the plugin gives vLLM this figure instead
    (:class:`HybridProbe`), so blocks become whole tiles (``block_size`` a multiple of the tile) of
    exactly ``block_size`` x this bytes: the plugin refuses pages that the tile does not divide, or
    that differ between layers (``plugin._check_hybrid_pages``), since vLLM cannot split padded
    blocks into one-tile kernel blocks.
    """
    model = vllm_config.model_config
    scheme = _scheme_of(str(vllm_config.cache_config.cache_dtype))
    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    page = heads * page_bytes(scheme, model.get_head_size(), model.get_num_layers(vllm_config.parallel_config))
    return -(-page // scheme.group_size)


def hybrid_probe(vllm_config: VllmConfig) -> type[AttentionBackend]:
    """The backend vLLM's hybrid block-size alignment should ask: kvarn's, with a page of one token of
    :func:`hybrid_token_bytes` and the tile as its only kernel block size."""
    token = hybrid_token_bytes(vllm_config)
    tile = _scheme_of(str(vllm_config.cache_config.cache_dtype)).group_size

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


class KvarnAttentionBackend(AttentionBackend):
    """Selected by the plugin whenever ``kv_cache_dtype`` is a kvarn preset name."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "KVARN"

    @staticmethod
    def get_impl_cls() -> type[KvarnAttentionImpl]:
        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvarnMetadataBuilder]:
        return KvarnMetadataBuilder

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return is_kvarn_dtype(kv_cache_dtype)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(ALLOWED_HEAD_DIMS)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        tps = getattr(kv_cache_spec, "tokens_per_state", 1)
        if isinstance(tps, int) and tps > 1:
            return [kv_cache_spec.tokens_per_state]  # one block = one tile, never split
        return [MultipleOf(32)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One state per block per KV head: the packed record (``tile_bytes``) of one tile.

        A layer's own spec arrives here already packed (:func:`install_layer_specs`) and is kept;
        a spec of no particular layer gets the widest layer's page.
        """
        if spec.state_content_bytes is not None:
            return spec
        scheme, layers = _active()
        return packed_spec(spec, scheme, page_bytes(scheme, spec.head_size, layers))


class _Planner:
    """The slot planning of one model's kvarn layers, shared by all their metadata builders.

    Layers of different page sizes (a mixed-bit preset) fall into different vLLM attention groups,
    each with its own builder, all called every step with the same ``CommonAttentionMetadata``.
    The staging and sink slots are the same for every layer, so the first builder of a step plans
    them and the others reuse its :class:`StepTensors` (planning twice would advance the pools twice).
    """

    def __init__(self, scheme: Scheme, slots: int) -> None:
        self.scheme = scheme
        self.pool = StagingPool(slots, scheme.group_size)
        cap = sink_capacity(scheme)
        self.sinks = SinkPool(slots, cap, scheme.group_size) if cap else None
        self.warned_missing = False
        self.layers: set[str] = set()  # the layers whose builders share this planner
        # the last step's metadata (held, so that its id cannot be reused) and its tensors
        self.last: tuple[CommonAttentionMetadata, StepTensors] | None = None

    def build(self, m: CommonAttentionMetadata) -> StepTensors:
        if self.last is not None and self._same_step(self.last[0], m):
            return self.last[1]
        step = self._plan(m)
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

    def _plan(self, m: CommonAttentionMetadata) -> StepTensors:
        plans, decode = self.plan_requests(m)
        table = m.block_table_tensor[: m.num_reqs]
        has_sink = self.sinks is not None
        return build_step(
            plans, table, self.scheme.group_size, sink_tile=self.scheme.sink_tile, has_sink=has_sink, decode=decode
        )

    def plan_requests(self, m: CommonAttentionMetadata) -> tuple[list[RequestPlan], bool]:
        """The staging (and sink) plans of one step's requests, and whether it is a decode step."""
        n, t = m.num_reqs, self.scheme.group_size
        qsl = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].cpu().tolist()
        host = m.block_table_tensor[:n].cpu()
        rows = [host[i, : (s + t - 1) // t].tolist() for i, s in enumerate(seq_lens)]
        decode = all(b - a == 1 for a, b in zip(qsl, qsl[1:], strict=False))
        plans = self.pool.plan(qsl, seq_lens, rows, reuse_now=not decode)
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


# one planner per engine configuration in this process (vllm_config id -> (config, planner))
_PLANNERS: dict[int, tuple[VllmConfig, _Planner]] = {}


def shared_planner(
    vllm_config: VllmConfig, block_size: int, layer_names: list[str], factory: type[_Planner] = _Planner
) -> _Planner:
    """The planner the kvarn layers of one engine share (made by the first metadata builder; a new
    one when builders are made anew for a new KV cache), logging the pools' size when made.

    Raises ``ValueError`` unless the builder's ``block_size`` is one tile of the engine's scheme."""
    scheme = _scheme_of(vllm_config.cache_config.cache_dtype)
    t = scheme.group_size
    if block_size != t:
        raise ValueError(
            f"kv_cache_dtype={scheme.name} needs block_size={t} (one vLLM block = one tile), "
            f"got {block_size}; pass block_size={t} (--block-size {t})"
        )
    shared = _PLANNERS.get(id(vllm_config))
    names = set(layer_names)
    if (
        shared is not None
        and shared[0] is vllm_config
        and type(shared[1]) is factory
        and shared[1].scheme == scheme
        and not names & shared[1].layers  # else builders are being made anew (a new KV cache)
    ):
        shared[1].layers |= names
        return shared[1]
    slots = staging_slots(vllm_config.scheduler_config.max_num_seqs)[1]
    planner = factory(scheme, slots)
    planner.layers |= names
    _PLANNERS[id(vllm_config)] = (vllm_config, planner)
    cap = sink_capacity(scheme)
    what = "the first tile (16-bit)" if scheme.sink_tile else f"the first {cap} tokens"
    logger.warning(
        "kvarn %s: staging of partial tiles%s: %d slots (max_num_seqs) = %.1f MiB over %d layers, "
        "allocated before the KV cache and counted against its memory",
        scheme.name,
        f" and exact copies of {what}" if cap else "",
        slots,
        POOLS["bytes"] / 2**20,
        POOLS["layers"],
    )
    return planner


class KvarnMetadataBuilder(AttentionMetadataBuilder[StepTensors]):
    """Builds the step's device tensors once per step (through the model's shared :class:`_Planner`)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.planner = shared_planner(vllm_config, kv_cache_spec.block_size, layer_names)
        self.scheme = self.planner.scheme

    @property
    def pool(self) -> StagingPool:
        return self.planner.pool

    @property
    def sinks(self) -> SinkPool | None:
        return self.planner.sinks

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> StepTensors:
        return self.planner.build(common_attn_metadata)


class KvarnAttentionImpl(AttentionImpl):  # type: ignore[type-arg]
    """Per-layer attention over packed tiles plus staged and new tokens; owns the layer's pools."""

    kvarn_pools = True  # its staging and sink pools key on blocks (kvarn.vllm.live publishes the live ones)

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
        self.scheme = _scheme_of(kv_cache_dtype)
        bad = []
        if sliding_window is not None:
            bad.append(f"sliding window ({sliding_window})")
        if alibi_slopes is not None:
            bad.append("ALiBi")
        if logits_soft_cap:
            bad.append(f"logits soft cap ({logits_soft_cap})")
        if kv_sharing_target_layer_name is not None:
            bad.append("KV sharing between layers")
        if kwargs.get("sinks") is not None:
            bad.append("attention sinks")
        if attn_type != AttentionType.DECODER:
            bad.append(f"attention type {attn_type}")
        if head_size not in ALLOWED_HEAD_DIMS:
            bad.append(f"head_dim {head_size} (supported: {', '.join(map(str, ALLOWED_HEAD_DIMS))})")
        if bad:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} cannot serve this model: unsupported {', '.join(bad)}. "
                "Serve it with another kv_cache_dtype."
            )
        config = get_current_vllm_config()
        _record_active(config)
        page_bytes(self.scheme, head_size, config.model_config.get_num_layers(config.parallel_config))
        block = config.cache_config.block_size
        if block % self.scheme.group_size:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs block_size={self.scheme.group_size} "
                f"(one vLLM block = one tile), got block_size={block}; pass "
                f"block_size={self.scheme.group_size} (--block-size {self.scheme.group_size})"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layer_scheme: Scheme | None = None
        # the pools, allocated now: before vLLM measures memory for the KV cache
        slots = staging_slots(config.scheduler_config.max_num_seqs)[1]
        dtype = config.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # resolved from "auto" etc. when the config was built
        device = torch.device(str(config.device_config.device))
        shape = (slots, num_kv_heads, self.scheme.group_size, head_size)
        self.stage = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None
        cap = sink_capacity(self.scheme)
        if cap:
            shape = (slots, num_kv_heads, cap, head_size)
            self.sink = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        reserve(config, pool_bytes(self.scheme, num_kv_heads, head_size, dtype, slots))
        live.install()
        install_layer_specs()

    def layer_spec(self, spec: AttentionSpec, layer_name: str) -> AttentionSpec:
        """Layer ``layer_name``'s packed spec: a page of its own scheme's tile record per KV head."""
        from vllm.model_executor.models.utils import extract_layer_index

        layer = extract_layer_index(layer_name)
        return packed_spec(spec, self.scheme, layer_page_bytes(self.scheme, spec.head_size, layer))

    def _layer_scheme(self, layer: Any) -> Scheme:
        if self.layer_scheme is None:
            from vllm.model_executor.models.utils import extract_layer_index

            s = self.scheme.for_layer(extract_layer_index(layer.layer_name))
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
        run_layer(query, key, value, pages, self.stage, self.sink, attn_metadata, scheme, self.scale, out)
        return output
