"""One engine's kvarn spec and state: its preset resolved once, and what its kvarn layers share.

Two objects, as vLLM's own backends split a plan from its buffers:

- :class:`EngineSpec` (frozen): what an engine configuration fixes: the ``kv_cache_dtype``
  resolved into its Scheme and per-layer schemes, the model's shape, the tail layout, the pool
  slots and sink capacity, the attention ops. Anyone may build it (:meth:`EngineSpec.from_config`):
  the front end to admit the model, a class method of a backend, a tool.
- :class:`EngineState`: what one running engine accumulates: the blocks its live requests hold,
  the bytes of the pools its layers allocated, its shared step planner, the runner's kvarn groups.
  One per engine, held by the engine's kvarn attention layers.

vLLM builds kvarn's attention impls, metadata builders and backends itself, by class, handing them
only the engine's ``VllmConfig``. The engine's own registry of its layers
(``compilation_config.static_forward_context``, which vLLM's builders read through
``get_layers_from_vllm_config``) is where they meet: the first kvarn impl built creates the
engine's :class:`EngineState` and every later impl, builder, runner patch and connector takes it
from a kvarn layer there (:func:`engine_state`). No table of engines, no "last engine built".
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


@dataclass(frozen=True, eq=False)
class EngineSpec:
    """What an engine configuration fixes for kvarn: built from it alone, the same every time.

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
    """

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

    @classmethod
    def from_config(cls, vllm_config: Any, settings: PluginSettings = SETTINGS) -> EngineSpec:
        """The spec of an engine configuration whose ``kv_cache_dtype`` is a kvarn name.

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


Groups = list[tuple[int, int, int, int]]  # (group index, block size, tile, stride): kvarn.vllm.live.kvarn_groups


@dataclass(eq=False)
class EngineState:
    """What one engine's kvarn parts share while it runs: one per engine, created by its first kvarn
    attention impl (:func:`engine_state`) and held by every kvarn layer's impl (``impl.state``).

    Attributes:
        spec: the engine's :class:`EngineSpec`; vllm_config: its configuration.
        live: the blocks live requests hold, published every step (:mod:`kvarn.vllm.live`).
        pools: bytes and layers of the pools this engine's layers allocated.
        planner: the step planner its metadata builders share (:func:`kvarn.vllm.planner.shared_planner`).
        groups: the model runner's kvarn KV-cache groups and the ``kv_cache_config`` they were read
            from (:func:`kvarn.vllm.live.kvarn_groups`); None until read.
        preempted: requests preempted and not scheduled since (:func:`kvarn.vllm.live.publish`).
    """

    spec: EngineSpec
    vllm_config: Any = field(repr=False)
    live: LiveBlocks = field(default_factory=LiveBlocks)
    pools: PoolTotals = field(default_factory=PoolTotals)
    planner: object | None = None
    groups: tuple[Any, Groups] | None = None
    preempted: set[str] = field(default_factory=set)

    @classmethod
    def from_config(cls, vllm_config: Any, settings: PluginSettings = SETTINGS) -> EngineState:
        """A new engine's state (its spec: :meth:`EngineSpec.from_config`, same errors)."""
        path = channel_path(vllm_config)
        live = LiveBlocks(uncache=LostSinks(path).mark if path else None)
        return cls(spec=EngineSpec.from_config(vllm_config, settings), vllm_config=vllm_config, live=live)

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
                f"kv_cache_dtype={self.spec.name!r}: the sink pools for max_num_seqs={self.spec.max_num_seqs} "
                f"need {self.pools.bytes / 2**20:.1f} MiB so far, more than the KV cache memory left "
                f"({(left + nbytes) / 2**20:.1f} MiB); lower max_num_seqs or give more KV memory"
            )
        cache.kv_cache_memory_bytes = left


def engine_state(vllm_config: Any, create: bool = False) -> EngineState:
    """The state of the engine ``vllm_config`` configures, held by its kvarn attention layers.

    vLLM registers each attention layer of an engine in ``compilation_config.static_forward_context``
    when it is built; the first registered layer whose impl holds a state gives it. ``create``: for
    an impl being built (its own layer is not registered yet): a new state when no layer holds one.

    Raises:
        RuntimeError: no kvarn layer of this engine holds a state and ``create`` is false.
    """
    for layer in vllm_config.compilation_config.static_forward_context.values():
        state = getattr(getattr(layer, "impl", None), "state", None)
        if isinstance(state, EngineState):
            return state
    if create:
        return EngineState.from_config(vllm_config)
    raise RuntimeError(
        f"kvarn {vllm_config.cache_config.cache_dtype}: no kvarn attention layer of this engine was built yet"
    )


def current_config() -> Any:
    """The configuration of the engine being set up (``get_current_vllm_config``): for vLLM calls
    that name no engine (a backend's ``customize_spec``).

    Raises:
        RuntimeError: no engine with a kvarn ``kv_cache_dtype`` is being set up.
    """
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
    except AssertionError:  # no current config (vLLM asserts)
        config = None
    if config is None or not DTYPES.is_kvarn(getattr(config.cache_config, "cache_dtype", None)):
        raise RuntimeError("kvarn: asked for the engine being set up, but no kvarn engine is (no current vLLM config)")
    return config


def tail_counted(vllm_config: Any) -> bool:
    """Whether vLLM's per-request memory counts kvarn's tail blocks (:class:`kvarn.vllm.tail_spec.TailSpec`
    ``counted``), and with it the "KV cache size" and "Maximum concurrency" vLLM logs: a kvarn model
    whose attention layers are all full attention (no sliding-window layers beside them, not hybrid)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None or not DTYPES.is_kvarn(cache.cache_dtype) or getattr(model, "is_hybrid", False):
        return False
    return "sliding_window" not in (getattr(cache, "kv_cache_dtype_skip_layers", None) or [])


def layout_for(vllm_config: Any) -> TailLayout | None:
    """The tail layout of an engine configuration (:attr:`EngineSpec.layout`); None for a dtype
    that is not kvarn's or a configuration without a model."""
    if vllm_config.model_config is None or not DTYPES.is_kvarn(vllm_config.cache_config.cache_dtype):
        return None
    return EngineSpec.from_config(vllm_config).layout
