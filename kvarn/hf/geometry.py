"""The attention layers a cache serves: their types, sliding windows, KV heads and head_dim.

Read from a transformers config the way transformers builds its own caches
(``DynamicCache(config=...)`` calls ``transformers.cache_utils.get_layer_types_and_kwargs``):
``config.layer_types`` when given (Gemma 2/3: five ``sliding_attention`` layers per
``full_attention`` layer), else every layer is ``sliding_attention`` when ``config.sliding_window``
is set (Mistral-style) and ``full_attention`` otherwise. A sliding layer with window ``W`` lets a
query at position ``p`` read keys ``p-W+1..p``, so it never holds more than ``W`` tokens.

Example:
    >>> from transformers import Gemma3TextConfig
    >>> g = cache_geometry(Gemma3TextConfig(num_hidden_layers=6, sliding_window=512, num_key_value_heads=1))
    >>> g.count("sliding_attention"), g.count("full_attention"), g.head_dim
    (5, 1, 256)
    >>> s = Scheme.from_name("kvarn_k4v2_g128")  # 3.28 bits/element at head_dim 256
    >>> round(g.bits_per_element(s, context=4096), 2), round(g.bits_per_element(s, context=32768), 2)
    (8.17, 4.2)

With sliding layers left 16-bit, the saving grows with the context: the full-attention layers'
share of the held tokens does.

Hybrid models (Mamba / linear attention beside attention: Granite 4, Qwen3-Next, ...): transformers
gives their recurrent layers the type ``linear_attention`` or ``conv`` (a ``LinearAttentionLayer``
holding conv and recurrent states, no per-token keys and values). They hold no tokens here
(:meth:`CacheGeometry.held_tokens` is 0), so bits per element count the attention layers only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvarn.hf.spec import Spec
from kvarn.schemes import Scheme

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES: tuple[str, ...] = (FULL, SLIDING)
# transformers' recurrent-state layer types (``LinearAttentionLayer``): no per-token keys and values
STATE_TYPES: tuple[str, ...] = ("linear_attention", "conv")


@dataclass(frozen=True)
class CacheGeometry:
    """One model's attention layers as a KV cache sees them.

    Attributes:
        layer_types: per layer, ``"full_attention"``, ``"sliding_attention"``, or a recurrent-state
            type of a hybrid model (:data:`STATE_TYPES`).
        windows: per layer, the sliding window in tokens, or None for full attention.
        num_kv_heads, head_dim: the same for every layer.
    """

    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def count(self, layer_type: str) -> int:
        """How many layers are of ``layer_type``."""
        return sum(t == layer_type for t in self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that cache keys and values (all but a hybrid model's state layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t not in STATE_TYPES)

    def held_tokens(self, layer: int, context: int) -> int:
        """Tokens layer ``layer`` must hold at ``context`` tokens: all of them, or its window (none for
        a recurrent-state layer)."""
        if self.layer_types[layer] in STATE_TYPES:
            return 0
        w = self.windows[layer]
        return context if w is None else min(context, w)

    def layer_bits(self, spec: Spec, layer: int, quantize_sliding: bool = False, context: int | None = None) -> float:
        """Stored bits per held number of one layer (16 when the layer stays unquantized).

        Full-attention layers: the scheme's own figure (its sink spread over ``context``). Sliding
        layers: 16 bits unless ``quantize_sliding``; then the scheme's tiles without any sink (a
        sliding layer keeps no sink: its first tokens leave the window).
        """
        if spec is None:
            return 16.0
        sliding = self.windows[layer] is not None
        if sliding and not quantize_sliding:
            return 16.0
        if not isinstance(spec, Scheme):
            return float(spec.bits_per_element(self.head_dim))
        s = spec.for_layer(layer)
        if s is None:
            return 16.0
        if sliding:
            return replace(s, sink_tile=False, sink_tokens=0).bits_per_element(self.head_dim)
        return s.bits_per_element(self.head_dim, context=context)

    def bits_per_element(self, spec: Spec, context: int, quantize_sliding: bool = False) -> float:
        """Stored bits per held number over all layers at ``context`` tokens of one sequence.

        Each layer weighs by the tokens it holds (:meth:`held_tokens`), so sliding layers count for
        at most their window. The 16-bit cache with the same windows is ``16 / this`` times larger.
        Without sliding layers this equals ``scheme.bits_per_element(head_dim, num_layers, context)``.

        Raises:
            ValueError: ``context`` below 1.
        """
        if context < 1:
            raise ValueError(f"context={context} must be >= 1 token")
        bits = held = 0.0
        for layer in range(self.num_layers):
            n = self.held_tokens(layer, context)
            bits += n * self.layer_bits(spec, layer, quantize_sliding, context)
            held += n
        return bits / held


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _layer_types_and_windows(text: Any) -> tuple[list[str], list[int | None]]:
    if hasattr(text, "per_layer_config"):  # a transformers config: exactly what DynamicCache builds
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(text)
        return list(types), [
            kw.get("sliding_window") if t == SLIDING else None for t, kw in zip(types, kwargs, strict=True)
        ]
    types = layer_types(text)  # a plain namespace (tests, duck-typed configs): the same rules
    window = getattr(text, "sliding_window", None)
    return types, [window if t == SLIDING else None for t in types]


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type, as transformers reads it: ``layer_types``, else every layer
    ``sliding_attention`` when ``sliding_window`` is set (and ``use_sliding_window`` is not false), else
    every layer ``full_attention`` (one layer at least).

    The one reader of a config's layer types for kvarn's caches (:func:`cache_geometry`) and its vLLM
    admission (:mod:`kvarn.vllm.admission`).
    """
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    types = list(getattr(config, "layer_types", None) or [])
    if types:
        return types
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
    return [SLIDING if sliding else FULL] * max(n, 1)


def _kv_heads(c: Any) -> int:
    return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)


def _head_dim(c: Any) -> int:
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def cache_geometry(config: Any) -> CacheGeometry:
    """The :class:`CacheGeometry` of a transformers config (or its text config, for multimodal ones).

    Raises:
        ValueError: a layer type other than full or sliding-window attention (the message lists the
            model's types and the supported ones), a sliding layer without a window, layers whose
            KV heads or head_dim differ (Gemma 4), or latent attention (MLA).
    """
    text = _text_config(config)
    if getattr(text, "kv_lora_rank", None):  # DeepSeek-style MLA: a latent, keys wider than values
        raise ValueError(
            "KVarNCache does not support latent attention (MLA, kv_lora_rank set): its keys and values have "
            "different widths, and KVarN's int4 latent layout is not implemented here"
        )
    types, windows = _layer_types_and_windows(text)
    other = sorted(set(types) - set(LAYER_TYPES) - set(STATE_TYPES))
    if other:
        raise ValueError(
            f"KVarNCache supports the layer types {', '.join(LAYER_TYPES + STATE_TYPES)} (the last two: a hybrid "
            f"model's recurrent layers, kept as transformers keeps them); this model also has {', '.join(other)}"
        )
    if all(t in STATE_TYPES for t in types):
        raise ValueError(f"this model has no attention layer (layer types {', '.join(sorted(set(types)))})")
    if any(t == SLIDING and (w is None or int(w) < 1) for t, w in zip(types, windows, strict=True)):
        raise ValueError(f"a sliding_attention layer needs a sliding_window of at least 1 token, got {windows}")
    per_layer = list(text.per_layer_config) if getattr(text, "is_heterogeneous", False) else [text] * len(types)
    shapes = {(_kv_heads(c), _head_dim(c)) for c in per_layer}
    if len(shapes) > 1:  # Gemma 4: full-attention layers with a wider head_dim and other KV heads
        raise ValueError(
            f"KVarNCache needs the same KV heads and head_dim in every layer; this model has (kv_heads, head_dim) "
            f"{sorted(shapes)} across its layers"
        )
    kv_heads, head_dim = shapes.pop()
    return CacheGeometry(tuple(types), tuple(None if w is None else int(w) for w in windows), kv_heads, head_dim)


def model_geometry(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config (see :func:`cache_geometry`).

    Raises:
        ValueError: see :func:`cache_geometry`.
    """
    g = cache_geometry(config)
    return g.num_layers, g.num_kv_heads, g.head_dim
