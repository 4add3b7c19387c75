"""Page maths of the kvarn backends: how many bytes one vLLM block of a layer holds.

Page layout (``[num_blocks, num_kv_heads, 1, page_bytes]`` uint8 per layer, vLLM's LBHNC layout):
one vLLM block is one tile of ``group_size`` tokens per KV head, and its state is the packed record
of :func:`kvarn.codec.quantize_tiles`, so a layer's page is ``tile_bytes(head_dim)`` of *its own*
scheme (``scheme.for_layer(i)``). Layers of different page sizes (a mixed-bit preset) stay in one
KV-cache group (vLLM's ``UniformTypeKVCacheSpecs``: a block's bytes are the sum of the layers'
pages), so the number of blocks vLLM derives gives exactly the preset's byte ratio, less the pools.
A layer the preset keeps unquantized (an fp16 override) has no kvarn page: vLLM's own cache serves it
(:func:`kvarn.vllm.admission.keep_16bit_layers`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch
from vllm.v1.kv_cache_interface import AttentionSpec

from kvarn.schemes import Scheme
from kvarn.schemes.scheme import ALLOWED_HEAD_DIMS
from kvarn.vllm.context import EngineSpec


@runtime_checkable
class PackedLayerImpl(Protocol):
    """A kvarn attention impl (standard or MLA) that gives its layer's packed spec."""

    def layer_spec(self, spec: AttentionSpec, layer_name: str) -> AttentionSpec:
        """``spec`` (vLLM's spec of the layer) as the layer's packed page: one tile record per KV head."""
        ...


def layer_page_bytes(scheme: Scheme, head_dim: int, layer: int) -> int:
    """Bytes of layer ``layer``'s page per KV head: one tile record of the layer's own scheme.

    Raises:
        ValueError: ``head_dim`` is not supported, or the layer is unquantized (an fp16 override).
    """
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
    """Bytes of the widest page per KV head over the quantized layers of ``num_layers``.

    Used where vLLM asks for a spec without saying which layer (``customize_spec``); each layer's own
    spec uses :func:`layer_page_bytes`.
    """
    quantized = [i for i in range(max(num_layers, 1)) if scheme.for_layer(i) is not None]
    if not quantized:
        raise ValueError(f"{scheme.name}: every one of the {num_layers} layers is unquantized (fp16 overrides)")
    return max(layer_page_bytes(scheme, head_dim, layer) for layer in quantized)


def packed_spec(spec: AttentionSpec, scheme: Scheme, content_bytes: int) -> AttentionSpec:
    """``spec`` with one state of ``content_bytes`` per KV head per block of ``group_size`` tokens."""
    return replace(spec, dtype=torch.uint8, state_content_bytes=content_bytes, tokens_per_state=scheme.group_size)


def hybrid_token_bytes(spec: EngineSpec) -> int:
    """Bytes per token of the widest kvarn page in a hybrid (Mamba / linear-attention) model, rounded up.

    vLLM sizes a hybrid model's attention blocks so that one attention page holds at least one Mamba
    state page, and pads the Mamba pages to ``block_size`` x the attention page of one token. A kvarn
    page holds whole tiles, so its page of one token is 0 bytes; vLLM is given this figure instead
    (:func:`kvarn.vllm.backend.hybrid_probe`), so blocks become whole tiles of exactly
    ``block_size`` x this bytes. :func:`kvarn.vllm.admission.check_model` refuses pages the tile does
    not divide, or that differ between layers, since vLLM cannot split padded blocks into one-tile
    kernel blocks.
    """
    page = spec.num_kv_heads * page_bytes(spec.scheme, spec.head_dim, spec.num_layers)
    return -(-page // spec.group_size)
