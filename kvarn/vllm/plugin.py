"""The ``vllm.general_plugins`` entry point: kvarn presets become KV-cache dtypes of vLLM.

``register()`` runs in every vLLM process (front end, engine core, each worker; vLLM calls it
more than once, so it is idempotent). It

1. registers every known preset name (built-ins, the bundled ``presets/`` folder, the folders in
   ``KVARN_PRESET_PATH`` and the user preset folder, scanned at start-up; plus canonical names
   such as ``kvarn_k4v2_g128_sink1`` that the front end resolved, passed to the processes it
   spawns in ``KVARN_RESOLVED_DTYPES``) as a KV-cache dtype:
   through :mod:`kvarn.vllm.compat` (vLLM 0.33's handler API, or vLLM 0.32's ``CacheDType`` Literal);
2. routes attention to :class:`kvarn.vllm.backend.KvarnAttentionBackend` (MLA layers on the CPU:
   :class:`kvarn.vllm.mla.KvarnMLABackend`) whenever the KV-cache dtype is a kvarn name, by wrapping
   the platform's ``get_attn_backend_cls``; any other dtype gets exactly what the platform chose
   before;
3. resolves every other name with one function, :func:`resolve_dtype`, in ``EngineArgs`` (``LLM()``)
   and as the type of the ``--kv-cache-dtype`` CLI option (``vllm serve``): any name
   :func:`kvarn.schemes.get_preset` accepts, canonical names such as ``kvarn_k4v2_g128_sink1``
   included, is registered on the spot; a name that resolves to nothing, or names a broken preset
   file, fails early with kvarn's message (file, field, value, allowed values) and vLLM's own dtypes.

Usage::

    LLM(model=..., kv_cache_dtype="kvarn_k4v2_g128", block_size=128)
    vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --block-size 128
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

from kvarn.schemes import PresetError, UnknownSchemeError, get_preset, list_presets
from kvarn.vllm import compat

logger = logging.getLogger("kvarn.vllm")

PREFIX = "kvarn_"
BACKEND_PATH = "kvarn.vllm.backend.KvarnAttentionBackend"
BACKEND_NAME = "KVARN"
MLA_BACKEND_PATH = "kvarn.vllm.mla.KvarnMLABackend"
MLA_BACKEND_NAME = "KVARN_MLA"
STAGING_SLOTS_ENV = "KVARN_STAGING_SLOTS"
# Names resolved in the front end that no preset file lists (canonical names such as
# kvarn_k4v2_g128_sink1): exported here so that the engine and worker processes, which vLLM spawns
# with this environment and which only scan the preset folders, register them too.
RESOLVED_ENV = "KVARN_RESOLVED_DTYPES"
DEFAULT_INITIAL_SLOTS = 16
_REGISTERED: set[str] = set()
_PATCHED: set[str] = set()


def is_kvarn_dtype(cache_dtype: object) -> bool:
    """Whether a ``kv_cache_dtype`` value names a kvarn preset (``kvarn_*`` or a registered preset name)."""
    return isinstance(cache_dtype, str) and (cache_dtype.startswith(PREFIX) or cache_dtype in _REGISTERED)


def staging_slots(max_num_seqs: int) -> tuple[int, int]:
    """(initial, maximum) staging slots for partial tiles.

    Initial: ``KVARN_STAGING_SLOTS`` if set, else ``min(max_num_seqs, 16)``; the pool grows on demand
    up to ``max(max_num_seqs, initial)``. The entry point's module is the one place the plugin
    reads the environment.
    """
    raw = os.environ.get(STAGING_SLOTS_ENV, "")
    if raw and (not raw.isdigit() or int(raw) < 1):
        raise ValueError(f"{STAGING_SLOTS_ENV}={raw!r} must be a positive integer")
    initial = int(raw) if raw else min(max_num_seqs, DEFAULT_INITIAL_SLOTS)
    return initial, max(max_num_seqs, initial)


def known_names() -> list[str]:
    """Every preset name found now: built-ins first, then user presets (scanned from disk)."""
    return [p.name for p in list_presets()]


def register_dtypes(names: list[str]) -> None:
    """Make each of ``names`` a valid ``kv_cache_dtype`` (packed bytes, stored as ``uint8``)."""
    compat.register(names)
    _REGISTERED.update(names)


def resolve_dtype(name: str) -> str:
    """The one resolver for ``kv_cache_dtype`` values: vLLM's own pass, kvarn's are registered.

    A name :func:`kvarn.schemes.get_preset` resolves (built-in, preset file or ``name:``, canonical
    scheme name) is registered as given and as its preset's name, and exported in
    ``KVARN_RESOLVED_DTYPES`` for the processes vLLM spawns.

    Raises:
        UnknownSchemeError: neither vLLM's nor kvarn's; lists both (and broken preset files that
            may define the name).
        PresetError: the name is a preset file that cannot be loaded.
    """
    if name in _REGISTERED or name in compat.vllm_dtypes():
        return name
    try:
        preset = get_preset(name)
    except UnknownSchemeError as e:
        msg = str(e).rstrip(".")
        raise UnknownSchemeError(
            f"{msg}{' ' if msg.endswith('?') else '. '}vLLM's own kv-cache dtypes: {', '.join(compat.vllm_dtypes())}"
        ) from None
    register_dtypes(list(dict.fromkeys([name, preset.name])))
    resolved = [n for n in os.environ.get(RESOLVED_ENV, "").split(",") if n]
    if name not in resolved:
        os.environ[RESOLVED_ENV] = ",".join([*resolved, name])
    return name


def _cli_dtype(value: str) -> str:
    """``--kv-cache-dtype``'s argparse type: :func:`resolve_dtype`, its errors as argparse errors."""
    try:
        return resolve_dtype(value)
    except (UnknownSchemeError, PresetError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _patch_cli() -> None:
    """``--kv-cache-dtype`` takes any name :func:`resolve_dtype` accepts (vLLM 0.32 made it a closed
    choice from the Literal, fixed when the parser was built; 0.33 takes any string)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_kvarn_cli", False):
        return
    original = EngineArgs.add_cli_args

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        for action in parser._actions:
            if "--kv-cache-dtype" in action.option_strings:
                action.type, action.choices = _cli_dtype, None
                action.metavar = "{" + ",".join([*compat.vllm_dtypes(), "<kvarn preset or scheme name>"]) + "}"
        return parser

    EngineArgs.add_cli_args = staticmethod(add_cli_args)  # type: ignore[method-assign]
    EngineArgs._kvarn_cli = True  # type: ignore[attr-defined]


def _patch_platform(cls: Any = None) -> None:
    """Route attention to the kvarn backend while a kvarn dtype is active; nothing else changes.

    ``cls``: the platform class to patch; default the current platform's.
    """
    if cls is None:
        from vllm.platforms import current_platform

        cls = type(current_platform)
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key in _PATCHED:
        return
    original = cls.get_attn_backend_cls  # bound classmethod

    def get_attn_backend_cls(_cls: type, selected_backend: Any, attn_selector_config: Any, *a: Any, **kw: Any) -> str:
        if not is_kvarn_dtype(attn_selector_config.kv_cache_dtype):
            return str(original(selected_backend, attn_selector_config, *a, **kw))
        name = attn_selector_config.kv_cache_dtype
        if attn_selector_config.use_sparse:
            raise ValueError(f"kv_cache_dtype={name!r}: sparse attention is not supported by kvarn")
        if attn_selector_config.use_mla:
            if getattr(_cls, "_enum", None) is None or _cls._enum.name != "CPU":
                raise ValueError(
                    f"kv_cache_dtype={name!r}: kvarn serves MLA (latent attention) on vLLM's CPU backend only; "
                    "its GPU kernels for the latent layout are not written. Use another kv_cache_dtype here."
                )
            return MLA_BACKEND_PATH
        return BACKEND_PATH

    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    align = getattr(cls, "_align_hybrid_block_size", None)
    if align is not None:

        def _align_hybrid_block_size(_cls: type, vllm_config: Any, backend_cls: Any, *a: Any, **kw: Any) -> Any:
            if is_kvarn_dtype(vllm_config.cache_config.cache_dtype):
                from kvarn.vllm.backend import hybrid_probe

                backend_cls = hybrid_probe(vllm_config)
            return align(vllm_config, backend_cls, *a, **kw)

        cls._align_hybrid_block_size = classmethod(_align_hybrid_block_size)
    update = cls.check_and_update_config

    def check_and_update_config(_cls: type, vllm_config: Any) -> None:
        update(vllm_config)
        mla_settings(vllm_config)

    cls.check_and_update_config = classmethod(check_and_update_config)
    _PATCHED.add(key)


def mla_settings(vllm_config: Any) -> None:
    """An MLA model on a kvarn dtype: blocks of one tile, no chunked prefill, no prefix caching.

    vLLM's CPU platform forces 16-token blocks for its own MLA kernel (kvarn's MLA backend is not
    that kernel) and turns chunked prefill and prefix caching off unless AMX serves MLA; kvarn's
    MLA path needs them off always (its prefill attends the step's own tokens only).
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None or not getattr(model, "use_mla", False) or not is_kvarn_dtype(cache.cache_dtype):
        return
    try:
        tile = get_preset(cache.cache_dtype).scheme.group_size
    except (UnknownSchemeError, PresetError):
        return  # resolve_dtype reports it
    cache.block_size = tile
    cache.enable_prefix_caching = False
    sched = vllm_config.scheduler_config
    sched.enable_chunked_prefill = False
    sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, model.max_model_len)
    logger.info(
        "kvarn %s on an MLA model: block_size %d (one tile; not the 16 of vLLM's own CPU MLA kernel), chunked "
        "prefill and prefix caching off",
        cache.cache_dtype,
        tile,
    )


def _register_backend() -> None:
    """Add ``KVARN`` and ``KVARN_MLA`` to vLLM's attention backend enum (vLLM looks backends up by name)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in ((BACKEND_NAME, BACKEND_PATH), (MLA_BACKEND_NAME, MLA_BACKEND_PATH)):
        if name not in AttentionBackendEnum.__members__ and not hasattr(AttentionBackendEnum, name):
            register_backend(name, path)


def check_model(name: str, vllm_config: Any) -> None:
    """Start-up checks in the front-end process: raise ``ValueError`` naming what kvarn cannot serve."""

    scheme = get_preset(name).scheme
    model = vllm_config.model_config
    block = vllm_config.cache_config.block_size
    if model is not None:
        _check_layers(name, model)
        _check_fp16_layers(name, scheme, model)
    hybrid = model is not None and getattr(model, "is_hybrid", False)
    if hybrid:
        _check_hybrid_pages(name, scheme, vllm_config)
    if block != scheme.group_size and not (hybrid and block % scheme.group_size == 0):
        raise ValueError(
            f"kv_cache_dtype={name!r} needs block_size={scheme.group_size} (one vLLM block = one tile), "
            f"got block_size={block}; pass block_size={scheme.group_size} (--block-size {scheme.group_size}) "
            "or leave it unset"
        )


def _check_hybrid_pages(name: str, scheme: Any, vllm_config: Any) -> None:
    """A hybrid model's blocks hold several tiles, which vLLM splits into one-tile kernel blocks for
    kvarn; in kvarn's LBHNC layout it can only split unpadded pages. So every quantized layer's tile
    records (KV heads x ``tile_bytes``) must have one size, a multiple of the tile's tokens (then
    the Mamba page is padded to kvarn's instead): a mixed-bit preset, an fp16 override, or a record
    size the tile does not divide is refused here rather than in the engine."""
    model = vllm_config.model_config
    heads, head = model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size()
    types = layer_types(model.hf_text_config)
    fp16 = fp16_layers(scheme, len(types))
    pages = {heads * scheme.for_layer(i).tile_bytes(head) for i in range(len(types)) if i not in fp16}
    why = ""
    if fp16:
        why = f"fp16 layer overrides (layers {_ranges(fp16)})"
    elif len(pages) > 1:
        why = f"layers of different widths (pages of {', '.join(f'{p:,}' for p in sorted(pages))} bytes)"
    elif pages.pop() % scheme.group_size:
        why = f"a page of {heads} x {scheme.tile_bytes(head):,} bytes, not a multiple of {scheme.group_size} tokens"
    if why:
        raise ValueError(
            f"kv_cache_dtype={name!r} cannot serve the hybrid model {model.model}: {why}. Its attention pages would "
            "need padding, and vLLM cannot split padded blocks into one-tile kernel blocks. Use a preset with the "
            "same bits on every layer (e.g. kvarn_k4v2_g128)."
        )


def fp16_layers(scheme: Any, num_layers: int) -> list[int]:
    """The layers a scheme keeps unquantized (``_L{a}-{b}fp16`` overrides), of ``num_layers``."""
    return [i for i in range(num_layers) if scheme.for_layer(i) is None]


def _check_fp16_layers(name: str, scheme: Any, model: Any) -> None:
    """fp16 layer overrides are served by vLLM's own cache (:func:`keep_16bit_layers`): a full-attention
    layer must be left for kvarn, and (not implemented) none may be a full-attention layer beside
    sliding-window layers. An override on a sliding-window layer changes nothing (it is 16-bit)."""
    types = layer_types(model.hf_text_config)
    fp16 = fp16_layers(scheme, len(types))
    full_fp16 = [i for i in fp16 if types[i] == FULL]
    if not full_fp16:
        return
    if SLIDING in types:
        raise ValueError(
            f"kv_cache_dtype={name!r} cannot serve {model.model}: fp16 layer overrides on full-attention "
            f"layers ({_ranges(full_fp16)}) of a model with sliding-window layers are not supported (their "
            "16-bit pages would not fit the page the sliding and kvarn layers share). Use a preset without "
            "them for this model."
        )
    if len(full_fp16) == types.count(FULL):
        raise ValueError(
            f"kv_cache_dtype={name!r} keeps every layer of {model.model} unquantized (fp16 overrides on "
            f"layers {_ranges(fp16)}): nothing would be quantized (use kv_cache_dtype='auto')"
        )


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in layers:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _check_layers(name: str, model: Any) -> None:
    """The model's layers, before the block size: vLLM may have changed it for a model kvarn refuses."""
    from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS

    bad = []
    hf = model.hf_text_config
    types = layer_types(hf)
    kinds = ", ".join(sorted(set(types)))
    if model.use_mla:
        bad += _mla_problems(name, model)
    elif getattr(model, "is_hybrid", False):
        if SLIDING in types or "chunked_attention" in types:
            bad.append(f"layer types {kinds}: sliding-window or chunked attention in a hybrid model (not implemented)")
    elif not set(types) <= {FULL, SLIDING}:
        bad.append(
            f"layer types {kinds} (kvarn serves {FULL} layers, {SLIDING} layers kept 16-bit beside them, and "
            "the attention layers of hybrid Mamba / linear-attention models; chunked attention is not supported)"
        )
    elif FULL not in types:
        bad.append(
            f"sliding-window layers (window {getattr(hf, 'sliding_window', None)}) on every layer: kvarn quantizes "
            f"{FULL} layers and keeps sliding-window layers 16-bit, so nothing would be quantized "
            "(use kv_cache_dtype='auto')"
        )
    head = model.get_head_size()
    if not model.use_mla and head not in ALLOWED_HEAD_DIMS:  # MLA: its head size is the latent's
        bad.append(f"head_dim {head} (supported: {', '.join(map(str, ALLOWED_HEAD_DIMS))})")
    cap = getattr(hf, "attn_logit_softcapping", None)
    if cap:  # Gemma 2: the attention layers would refuse it in the engine; say it here
        bad.append(f"attention logits soft cap ({cap}): kvarn's attention kernels do not apply one")
    if model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        bad.append(f"model dtype {model.dtype} (supported: float16, bfloat16, float32)")
    if bad:
        raise ValueError(
            f"kv_cache_dtype={name!r} cannot serve {model.model}: unsupported {'; '.join(bad)}. "
            "Serve this model with another kv_cache_dtype."
        )


def _mla_problems(name: str, model: Any) -> list[str]:
    """What kvarn's MLA path (:mod:`kvarn.vllm.mla`) cannot serve in an MLA model."""
    from vllm.platforms import current_platform

    hf = model.hf_text_config
    latent, rope = int(getattr(hf, "kv_lora_rank", 0) or 0), int(getattr(hf, "qk_rope_head_dim", 0) or 0)
    bad = []
    if latent % 128 or latent + rope not in (320, 576):
        bad.append(
            f"MLA latent width {latent} + RoPE {rope} (kvarn: a latent that is a multiple of 128, latent + RoPE "
            "320 or 576 as vLLM's MLA layers take)"
        )
    if getattr(hf, "index_topk", None) or getattr(model, "use_sparse", False):
        bad.append("sparse MLA (an indexer selecting top-k tokens)")
    if get_preset(name).scheme.overrides:
        bad.append("per-layer bit overrides on an MLA model (kvarn's MLA pages have one size)")
    if getattr(model, "is_hybrid", False):
        bad.append("MLA layers in a hybrid (Mamba / linear-attention) model (not implemented)")
    if not current_platform.is_cpu():
        bad.append("MLA on this platform (kvarn serves MLA on vLLM's CPU backend only; no GPU kernels for it yet)")
    return bad


FULL, SLIDING = "full_attention", "sliding_attention"


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's attention type, as transformers reads it: ``layer_types``, else every layer
    ``sliding_attention`` when ``sliding_window`` is set (and ``use_sliding_window`` is not false), else
    every layer ``full_attention``."""
    n = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    types = list(getattr(hf_config, "layer_types", None) or [])
    if types:
        return types
    window = getattr(hf_config, "sliding_window", None)
    sliding = window is not None and getattr(hf_config, "use_sliding_window", True) is not False
    return [SLIDING if sliding else FULL] * max(n, 1)


def keep_16bit_layers(vllm_config: Any) -> list[str]:
    """Give the layers kvarn does not quantize to vLLM's own 16-bit cache, spec and attention backend,
    through vLLM's ``kv_cache_dtype_skip_layers`` (vLLM 0.32 and 0.33 build a layer with
    ``kv_cache_dtype="auto"`` when its index, as a string, or ``"sliding_window"`` for a layer with a
    window, is in that list): ``sliding_window`` for a model with sliding-window layers beside
    full-attention ones, and the index of every layer the scheme keeps unquantized (fp16 overrides).
    kvarn quantizes the rest. Returns the entries it added."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    if model is None:
        return []
    types = layer_types(model.hf_text_config)
    wanted = ["sliding_window"] if SLIDING in types else []
    scheme = get_preset(cache.cache_dtype).scheme
    fp16 = fp16_layers(scheme, len(types))
    wanted += [str(i) for i in fp16]
    added = [w for w in wanted if w not in cache.kv_cache_dtype_skip_layers]
    if added:
        cache.kv_cache_dtype_skip_layers = sorted({*cache.kv_cache_dtype_skip_layers, *added})
    if SLIDING in types:
        logger.info("kvarn %s: sliding-window layers stay 16-bit (vLLM's own cache)", cache.cache_dtype)
    if fp16:
        logger.info(
            "kvarn %s: layers %s stay unquantized on vLLM's own cache (%s); %.3f bits per cached number over "
            "the %d layers",
            cache.cache_dtype,
            _ranges(fp16),
            model.dtype,
            served_bits(scheme, model.get_head_size(), len(types), model.dtype),
            len(types),
        )
    return added


def served_bits(scheme: Any, head_dim: int, num_layers: int, dtype: torch.dtype) -> float:
    """Stored bits per cached number over ``num_layers`` full-attention layers as vLLM serves them:
    each quantized layer its own scheme's packed tiles, each fp16-override layer vLLM's own cache in
    the model dtype (16 bits for bfloat16 / float16, 32 for float32). Pools and sinks not counted.

    Equals ``scheme.bits_per_element(head_dim, num_layers)`` for a 16-bit model dtype."""
    return float(scheme.bits_per_element(head_dim, num_layers, unquantized_bits=8.0 * dtype.itemsize))


def _patch_engine_args() -> None:
    """Fail in the front end, before any engine process starts: unknown names and unsupported models.

    Every ``kv_cache_dtype`` goes through :func:`resolve_dtype` (an unknown name raises
    :class:`UnknownSchemeError` listing kvarn's presets and vLLM's dtypes); for a kvarn name an
    unset block size becomes the scheme's tile size.
    """
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_kvarn_checked", False):
        return
    post_init = EngineArgs.__post_init__
    create = EngineArgs.create_engine_config

    def resolve(self: Any) -> None:
        name = getattr(self, "kv_cache_dtype", None)
        if isinstance(name, str) and is_kvarn_dtype(resolve_dtype(name)) and self.block_size is None:
            self.block_size = get_preset(name).scheme.group_size

    def __post_init__(self: Any) -> None:
        resolve(self)
        post_init(self)  # type: ignore[no-untyped-call]

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        resolve(self)  # again: vLLM loads plugins inside the first EngineArgs.__post_init__
        config = create(self, *args, **kwargs)
        if is_kvarn_dtype(config.cache_config.cache_dtype):
            check_model(config.cache_config.cache_dtype, config)
            keep_16bit_layers(config)
        return config

    EngineArgs.__post_init__ = __post_init__  # type: ignore[method-assign]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    EngineArgs._kvarn_checked = True  # type: ignore[attr-defined]


def register() -> None:
    """Entry point (``vllm.general_plugins``): register kvarn dtypes and the attention backend."""
    try:
        names = known_names()
    except Exception as e:  # a broken preset folder must not break vLLM for other dtypes
        logger.warning("kvarn: could not list presets (%s); registering built-ins only", e)
        from kvarn.schemes import BUILTINS

        names = list(BUILTINS)
    for extra in filter(None, os.environ.get(RESOLVED_ENV, "").split(",")):  # see RESOLVED_ENV
        try:  # the name as the front end was given it, and its preset's name
            names += [n for n in (extra, get_preset(extra).name) if n not in names]
        except Exception as e:  # a stale name must not break vLLM for other dtypes
            logger.warning("kvarn: %s lists %r, which does not resolve (%s); skipped", RESOLVED_ENV, extra, e)
    register_dtypes(names)
    _register_backend()
    _patch_platform()
    _patch_engine_args()
    _patch_cli()
    logger.debug("kvarn: registered %d KV-cache dtypes: %s", len(names), ", ".join(names))


__all__ = [
    "BACKEND_PATH",
    "UnknownSchemeError",
    "is_kvarn_dtype",
    "known_names",
    "register",
    "register_dtypes",
    "resolve_dtype",
]
