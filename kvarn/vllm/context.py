"""One engine's kvarn context: its preset resolved once, and everything its kvarn layers share.

vLLM builds kvarn's attention impls, metadata builders and backends itself, by class, handing them
only the engine's ``VllmConfig`` (as an argument, or through ``get_current_vllm_config``). Each asks
:func:`context_of` for the engine's :class:`EngineContext`: the ``kv_cache_dtype`` resolved into
its Scheme and per-layer schemes, the model's shape, the tail layout, the pool slots and sink
capacity, the attention ops, and the engine's state (the blocks its live requests hold, the bytes
of the pools its layers allocated, its shared step planner). The front end builds one too
(:meth:`EngineContext.from_config`) to admit the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from kvarn.codec.latent import latent_tile_bytes
from kvarn.kernels.api import AttentionOps
from kvarn.kernels.dispatch import ops_for
from kvarn.schemes import Scheme
from kvarn.vllm.lost_sinks import LostSinks, channel_path
from kvarn.vllm.pools import PoolTotals, sink_capacity
from kvarn.vllm.registry import DTYPES, SETTINGS, PluginSettings
from kvarn.vllm.staging import LiveBlocks

if TYPE_CHECKING:
    from kvarn.vllm.tail import TailLayout


@dataclass(eq=False)
class EngineContext:
    """What every kvarn part of one engine receives: built once from its configuration.

    Attributes:
        name: the ``kv_cache_dtype``; scheme: its Scheme (each layer's own: :meth:`layer_scheme`).
        num_layers: the layers this pipeline stage builds (``get_num_layers``).
        num_kv_heads, head_dim, dtype: of the model's attention layers (``dtype``: the model's,
            that of staged rows and pools); device: where the pools live.
        max_num_seqs: the scheduler's; slots: sink slots per layer; sink_capacity: exact rows per
            sink slot (0: no sink pool).
        mla, hybrid: an MLA model; a hybrid Mamba / linear-attention model (blocks of several tiles).
        latent: an MLA model's ``(kv_lora_rank, qk_rope_head_dim)``, else None.
        max_rollback: the most tokens a step may roll back (speculative tokens per step).
        ops: the attention ops every layer launches.
        live: the blocks live requests hold, published every step (:mod:`kvarn.vllm.live`).
        pools: bytes and layers of the pools this engine's layers allocated.
        planner: the step planner its metadata builders share (:func:`kvarn.vllm.planner.shared_planner`).
    """

    vllm_config: Any = field(repr=False)
    name: str
    scheme: Scheme
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    slots: int
    sink_capacity: int
    mla: bool
    hybrid: bool
    latent: tuple[int, int] | None
    max_rollback: int
    ops: AttentionOps
    live: LiveBlocks = field(default_factory=LiveBlocks)
    pools: PoolTotals = field(default_factory=PoolTotals)
    planner: object | None = None

    @classmethod
    def from_config(cls, vllm_config: Any, settings: PluginSettings = SETTINGS) -> EngineContext:
        """The context of an engine configuration whose ``kv_cache_dtype`` is a kvarn name.

        Raises:
            UnknownSchemeError, PresetError: the name resolves to no scheme.
            ValueError: ``KVARN_STAGING_SLOTS`` or ``KVARN_OPS`` is malformed.
        """
        name = str(vllm_config.cache_config.cache_dtype)
        scheme = DTYPES.scheme(name)
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        dtype = model.dtype
        assert isinstance(dtype, torch.dtype)  # resolved from "auto" etc. when the config was built
        mla = bool(model.use_mla)
        latent = None
        if mla:
            hf = model.hf_text_config
            latent = (int(hf.kv_lora_rank), int(hf.qk_rope_head_dim))
        spec = vllm_config.speculative_config
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        device = torch.device(str(vllm_config.device_config.device))
        try:
            ops = ops_for(device, settings.ops or None)
        except ValueError:
            raise ValueError(f"KVARN_OPS={settings.ops!r} is not one of: triton, cpu (or unset: by device)") from None
        return cls(
            vllm_config=vllm_config,
            name=name,
            scheme=scheme,
            num_layers=int(model.get_num_layers(parallel)),
            num_kv_heads=int(model.get_num_kv_heads(parallel)),
            head_dim=int(model.get_head_size()),
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            slots=settings.slots(max_num_seqs),
            sink_capacity=sink_capacity(scheme),
            mla=mla,
            hybrid=bool(getattr(model, "is_hybrid", False)),
            latent=latent,
            max_rollback=int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0,
            ops=ops,
            live=LiveBlocks(uncache=LostSinks(path).mark if (path := channel_path(vllm_config)) else None),
        )

    def layer_scheme(self, layer: int) -> Scheme | None:
        """Layer ``layer``'s own scheme (its index in the whole model); None where it stays unquantized."""
        return self.scheme.for_layer(layer)

    @property
    def group_size(self) -> int:
        """Tokens per tile: one kernel block."""
        return self.scheme.group_size

    @cached_property
    def layout(self) -> TailLayout:
        """Where partial tiles wait: the requests' tail blocks (:mod:`kvarn.vllm.tail`); an MLA
        model's rows are its latent rows in pages of one latent record (:attr:`record_bytes`).

        Raises:
            ValueError: see :func:`kvarn.vllm.tail.page_layout`.
        """
        from kvarn.vllm.tail import page_layout, tail_layout  # imports vLLM's KV-cache managers: not at plugin load

        if self.latent is not None:
            width = sum(self.latent)
            return page_layout(self.scheme, self.record_bytes, width, self.dtype, self.max_rollback, vectors=1)
        return tail_layout(self.scheme, self.head_dim, self.num_layers, self.dtype, self.max_rollback)

    @property
    def record_bytes(self) -> int:
        """Bytes of one MLA tile record (:func:`kvarn.codec.latent.latent_tile_bytes`).

        Raises:
            RuntimeError: the model has no MLA layers.
        """
        if self.latent is None:
            raise RuntimeError(f"kvarn {self.name}: the model has no MLA layers")
        return latent_tile_bytes(self.scheme, *self.latent)

    @property
    def tile_bytes(self) -> int:
        """Bytes of one tile over every kvarn layer (the packed pages a block holds)."""
        if self.latent is not None:
            return self.record_bytes * self.num_layers
        s = self.scheme
        return self.num_kv_heads * sum(
            x.tile_bytes(self.head_dim) for i in range(self.num_layers) if (x := s.for_layer(i))
        )

    def check_block_size(self, block_size: int) -> None:
        """One vLLM block is one tile (a hybrid model's blocks: whole tiles, split into one-tile kernel blocks).

        Raises:
            ValueError: naming the block size to pass.
        """
        t = self.group_size
        if block_size != t and not (self.hybrid and block_size % t == 0):
            raise ValueError(
                f"kv_cache_dtype={self.name!r} needs block_size={t} (one vLLM block = one tile), got "
                f"block_size={block_size}; pass block_size={t} (--block-size {t}) or leave it unset"
            )

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` of one layer's pools against the KV cache memory: an explicit
        ``kv_cache_memory_bytes`` shrinks by it (vLLM's profiling counts allocated pools by itself otherwise).

        Raises:
            ValueError: the pools need more than the KV cache memory left.
        """
        self.pools.bytes += nbytes
        self.pools.layers += 1
        cache = self.vllm_config.cache_config
        if cache.kv_cache_memory_bytes is None:
            return
        left = int(cache.kv_cache_memory_bytes) - nbytes
        if left <= 0:
            raise ValueError(
                f"kv_cache_dtype={self.name!r}: the sink pools for max_num_seqs={self.max_num_seqs} need "
                f"{self.pools.bytes / 2**20:.1f} MiB so far, more than the KV cache memory left "
                f"({(left + nbytes) / 2**20:.1f} MiB); lower max_num_seqs or give more KV memory"
            )
        cache.kv_cache_memory_bytes = left


# vLLM hands kvarn's impls, builders and backends only the engine's configuration (they are built by
# class, through AttentionBackend.get_impl_cls / get_builder_cls and customize_spec): the context is
# found by it. id(config) -> (config, context); the config is held so that its id is not reused.
_ENGINES: dict[int, tuple[Any, EngineContext]] = {}


def context_of(vllm_config: Any) -> EngineContext:
    """The context of the engine ``vllm_config`` configures, built on first use."""
    held = _ENGINES.get(id(vllm_config))
    if held is not None and held[0] is vllm_config:
        return held[1]
    ctx = EngineContext.from_config(vllm_config)
    _ENGINES.pop(id(vllm_config), None)  # a reused id: the new engine goes last (current_context)
    _ENGINES[id(vllm_config)] = (vllm_config, ctx)
    return ctx


def current_context() -> EngineContext:
    """The context of the engine being set up (``get_current_vllm_config``), else of the engine
    whose context this process built last: for vLLM calls that name no engine (``customize_spec``).

    Raises:
        RuntimeError: no kvarn engine in this process.
    """
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
    except AssertionError:  # no current config (vLLM asserts)
        config = None
    if config is not None and DTYPES.is_kvarn(getattr(config.cache_config, "cache_dtype", None)):
        return context_of(config)
    if not _ENGINES:
        raise RuntimeError("kvarn: no kvarn attention layer was built in this process")
    return next(reversed(_ENGINES.values()))[1]


def tail_counted(vllm_config: Any) -> bool:
    """Whether vLLM's per-request memory counts kvarn's tail blocks (:class:`kvarn.vllm.tail_spec.TailSpec`
    ``counted``), and with it the "KV cache size" and "Maximum concurrency" vLLM logs: a kvarn model
    whose attention layers are all full attention (no sliding-window layers beside them, not hybrid)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None or not DTYPES.is_kvarn(cache.cache_dtype) or getattr(model, "is_hybrid", False):
        return False
    return "sliding_window" not in (getattr(cache, "kv_cache_dtype_skip_layers", None) or [])


def layout_for(vllm_config: Any) -> TailLayout | None:
    """The tail layout of an engine configuration (:attr:`EngineContext.layout`); None for a dtype
    that is not kvarn's or a configuration without a model."""
    if vllm_config.model_config is None or not DTYPES.is_kvarn(vllm_config.cache_config.cache_dtype):
        return None
    return EngineContext.from_config(vllm_config).layout
