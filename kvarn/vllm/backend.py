"""The kvarn attention backend for vLLM: pages of packed tiles, staging of partial tiles.

Page layout (``[num_blocks, num_kv_heads, 1, page_bytes]`` uint8 per layer, vLLM's LBHNC layout):
one vLLM block is one tile of ``group_size`` tokens per KV head, and its state is the packed
record of :func:`kvarn.codec.quantize_tiles`, so ``page_bytes = scheme.tile_bytes(head_dim)``
(the largest over layers when a preset overrides bit widths per layer). vLLM derives the number
of blocks, and so the KV tokens it reports, from this page size.

Partially filled tiles live in staging slots (see :mod:`kvarn.vllm.staging`) and, for schemes with
``sink_tokens``, exact copies of each sequence's first tokens in sink slots (:mod:`kvarn.vllm.sinks`;
pages do not change), both planned once per step by :class:`KvarnMetadataBuilder`. Compute:
:mod:`kvarn.vllm.torch_path` (CPU) and :mod:`kvarn.vllm.triton_path` (CUDA).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import ModuleType
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
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvarn.schemes import Scheme, get_preset
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS
from kvarn.vllm import torch_path, triton_path
from kvarn.vllm.plugin import is_kvarn_dtype, staging_slots
from kvarn.vllm.sinks import SinkPool
from kvarn.vllm.staging import RequestPlan, StagingPool

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


def page_bytes(scheme: Scheme, head_dim: int, num_layers: int) -> int:
    """Bytes of one page per KV head: the largest tile record over the layers."""
    if head_dim not in ALLOWED_HEAD_DIMS:
        raise ValueError(
            f"{scheme.name}: head_dim {head_dim} is not supported; supported: {', '.join(map(str, ALLOWED_HEAD_DIMS))}"
        )
    if scheme.sink_tile:
        raise ValueError(
            f"{scheme.name}: sink_tile presets are not served by the vLLM backend yet; _sink1.._sink8 "
            "(exact first tokens beside unchanged tiles) are"
        )
    sizes = []
    for layer in range(max(num_layers, 1)):
        s = scheme.for_layer(layer)
        if s is None:
            raise ValueError(
                f"{scheme.name}: layer {layer} is unquantized (fp16 override); the vLLM backend stores "
                "every layer as packed tiles in one page size. Use a preset without fp16 layer overrides."
            )
        sizes.append(s.tile_bytes(head_dim))
    return max(sizes)


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
        """One state per block per KV head: the packed record (``tile_bytes``) of one tile."""
        if spec.state_content_bytes is not None:
            return spec
        scheme, layers = _active()
        return replace(
            spec,
            dtype=torch.uint8,
            state_content_bytes=page_bytes(scheme, spec.head_size, layers),
            tokens_per_state=scheme.group_size,
        )


@dataclass
class KvarnMetadata:
    """One step's plan, shared by every layer of the KV-cache group."""

    num_actual_tokens: int
    plans: list[RequestPlan]
    num_slots: int
    num_sink_slots: int = 0  # 0: the scheme keeps no sink tokens


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    """Plans staging (and sink slots) once per step; logs their memory at start-up and on growth."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.scheme = _scheme_of(vllm_config.cache_config.cache_dtype)
        t = self.scheme.group_size
        if kv_cache_spec.block_size != t:
            raise ValueError(
                f"kv_cache_dtype={self.scheme.name} needs block_size={t} (one vLLM block = one tile), "
                f"got {kv_cache_spec.block_size}; pass block_size={t} (--block-size {t})"
            )
        max_seqs = vllm_config.scheduler_config.max_num_seqs
        initial, most = staging_slots(max_seqs)
        self.pool = StagingPool(initial, t, max_slots=most)
        dtype = vllm_config.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # resolved from "auto" etc. when the config was built
        self.per_slot = 2 * kv_cache_spec.num_kv_heads * t * kv_cache_spec.head_size * dtype.itemsize
        self.per_slot *= len(layer_names)
        # sink slots: [num_kv_heads, sink_tokens, head_dim] keys and values per layer, per sequence
        s = self.scheme.sink_tokens
        self.sinks = SinkPool(initial, s, max_slots=most) if s else None
        self.per_sink = 2 * kv_cache_spec.num_kv_heads * s * kv_cache_spec.head_size * dtype.itemsize
        self.per_sink *= len(layer_names)
        self.warned_missing = False
        logger.warning(
            "kvarn %s: staging for partial tiles%s (%s, outside the KV cache space): %d slots = %.1f MiB now, "
            "growing on demand to max_num_seqs=%d slots = %.1f MiB (%.0f KiB per slot over %d layers); "
            "set KVARN_STAGING_SLOTS for the initial size",
            self.scheme.name,
            f" and exact copies of the first {s} tokens" if s else "",
            dtype,
            initial,
            initial * (self.per_slot + self.per_sink) / 2**20,
            most,
            most * (self.per_slot + self.per_sink) / 2**20,
            (self.per_slot + self.per_sink) / 1024,
            len(layer_names),
        )

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KvarnMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].cpu().tolist()
        t = self.scheme.group_size
        table = m.block_table_tensor[:n].cpu()
        rows = [table[i, : (s + t - 1) // t].tolist() for i, s in enumerate(seq_lens)]
        grown = len(self.pool.growths)
        plans = self.pool.plan(qsl, seq_lens, rows)
        if len(self.pool.growths) > grown:
            logger.warning(
                "kvarn: staging grew to %d slots = %.1f MiB (bound: %d slots)",
                self.pool.num_slots,
                self.pool.num_slots * self.per_slot / 2**20,
                self.pool.max_slots,
            )
        if self.sinks is None:
            return KvarnMetadata(m.num_actual_tokens, plans, self.pool.num_slots)
        grown = len(self.sinks.growths)
        self.sinks.plan(plans, seq_lens, rows)
        if len(self.sinks.growths) > grown:
            logger.warning(
                "kvarn: sink slots grew to %d = %.2f MiB (bound: %d)",
                self.sinks.num_slots,
                self.sinks.num_slots * self.per_sink / 2**20,
                self.sinks.max_slots,
            )
        if self.sinks.missing and not self.warned_missing:
            self.warned_missing = True
            logger.warning(
                "kvarn %s: a request reads its first tile without the exact copies of its first %d tokens "
                "(their sink slot was reclaimed: a prefix-cache hit on a sequence that ended long ago, or "
                "more sequences than max_num_seqs); it reads them quantized. Logged once.",
                self.scheme.name,
                self.scheme.sink_tokens,
            )
        return KvarnMetadata(m.num_actual_tokens, plans, self.pool.num_slots, self.sinks.num_slots)


class KvarnAttentionImpl(AttentionImpl):  # type: ignore[type-arg]
    """Per-layer attention over packed tiles plus staged and new tokens."""

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
        if block != self.scheme.group_size:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs block_size={self.scheme.group_size} "
                f"(one vLLM block = one tile), got block_size={block}; pass "
                f"block_size={self.scheme.group_size} (--block-size {self.scheme.group_size})"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layer_scheme: Scheme | None = None
        self.stage: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None

    def _layer_scheme(self, layer: Any) -> Scheme:
        if self.layer_scheme is None:
            from vllm.model_executor.models.utils import extract_layer_index

            s = self.scheme.for_layer(extract_layer_index(layer.layer_name))
            if s is None:  # rejected at start-up by page_bytes; kept for safety
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
        attn_metadata: KvarnMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[N, Hq, D]``, key/value ``[N, H, D]``, kv_cache ``[B, H, 1, page_bytes]`` uint8."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up
            return output
        scheme = self._layer_scheme(layer)
        h, d = self.num_kv_heads, self.head_size
        self.stage = _grown(self.stage, (attn_metadata.num_slots, h, scheme.group_size, d), key)
        sk, sv = self.stage
        sink = None
        if attn_metadata.num_sink_slots:
            sink = self.sink = _grown(self.sink, (attn_metadata.num_sink_slots, h, scheme.sink_tokens, d), key)
        out = output.view(-1, self.num_heads, self.head_size)
        # CUDA: the Triton kernels; CPU (and pages wider than this layer's record): the torch path
        path: ModuleType = torch_path
        if query.is_cuda and triton_path.usable(kv_cache, scheme, self.head_size):
            path = triton_path
        plans = attn_metadata.plans
        path.attend(query, key, value, kv_cache, sk, sv, plans, scheme, self.scale, out, sink=sink)
        path.commit(key, value, kv_cache, sk, sv, plans, scheme, sink=sink)
        return output


def _grown(
    slots: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int, int, int, int], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``shape`` (``[num_slots, H, tokens, D]``, ``like``'s dtype and device):
    ``slots`` if they have that many slots, else new zeros keeping what ``slots`` held."""
    if slots is not None and slots[0].shape[0] >= shape[0]:
        return slots
    grown = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
    if slots is not None:  # the pool grew: keep what is held
        for new, old in zip(grown, slots, strict=True):
            new[: old.shape[0]] = old
    return grown[0], grown[1]
