"""``KVarNCache``: a transformers ``Cache`` whose full tiles are packed records of the reference codec.

Example:
    >>> from kvarn.models import load_model
    >>> model, tok = load_model("smollm2-135m")
    >>> cache = KVarNCache("kvarn_k4v2_g128", model.config)
    >>> ids = tok("The GNU General Public License", return_tensors="pt").input_ids
    >>> out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    >>> cache.nbytes() == cache.nbytes_breakdown()["total"]
    True

Per layer (see :mod:`kvarn.hf.layers`), for a kvarn scheme: full tiles of ``group_size`` tokens are
quantized once when they fill (``quantize_tiles``, stored as ``[batch, kv_heads, tiles,
tile_bytes]`` uint8) and read back through ``dequantize_tiles``; the tile being filled, and the sink
tile when ``scheme.sink_tile``, stay in the model's dtype; with ``scheme.sink_tokens`` the first
tokens are also kept exactly and read in place of their packed values; ``scheme.for_layer(i)`` gives each layer's
bits (None: the layer stays unquantized). Baselines are fake-quantized when they commit; ``"fp16"``
quantizes nothing. For speed, each layer also keeps what its committed bytes decode to (a server
decodes them in registers instead); :meth:`KVarNCache.nbytes` counts only what a server stores.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache

from kvarn.hf.layers import BaselineCommitter, KVarNLayer, TileCommitter
from kvarn.hf.spec import BaselineLike, Spec, resolve_spec, spec_name
from kvarn.schemes import Scheme


def model_geometry(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config with full attention only.

    Raises:
        ValueError: the model has sliding-window or other non-full attention layers.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * layers
    other = sorted(set(layer_types) - {"full_attention"})
    if other or getattr(text, "sliding_window", None):
        raise ValueError(
            f"KVarNCache supports full-attention layers only; this model also has {other or 'sliding windows'}"
        )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers, kv_heads, head_dim


def _layer(spec: Spec, layer: int, head_dim: int, quantize_before_read: bool) -> KVarNLayer:
    if spec is None:
        return KVarNLayer(None)
    if isinstance(spec, Scheme):
        s = spec.for_layer(layer)
        if s is None:
            return KVarNLayer(None)
        sink = s.group_size if s.sink_tile else 0
        return KVarNLayer(TileCommitter(s, head_dim), sink, quantize_before_read, exact_tokens=s.sink_tokens)
    return KVarNLayer(BaselineCommitter(spec, head_dim), 0, quantize_before_read)


class KVarNCache(Cache):
    """A transformers cache for a kvarn scheme, a baseline, or ``"fp16"`` (no quantization).

    Args:
        scheme_or_name: a :class:`Scheme`, a baseline, or a name (``"fp16"``, a baseline name, a
            preset or canonical kvarn name).
        config: the model's transformers config (layers, KV heads, head_dim).
        quantize_before_read: a chunk reads its own tokens quantized once committed (default: it
            reads them as computed and later chunks read them as stored; see :mod:`kvarn.hf.layers`).

    Raises:
        UnknownSchemeError: unknown name (the message lists the valid ones).
        SchemeError: the scheme does not support the model's head_dim.
        ValueError: the model has attention layers other than full attention.
    """

    def __init__(
        self, scheme_or_name: str | Scheme | BaselineLike, config: Any, *, quantize_before_read: bool = False
    ) -> None:
        self.spec: Spec = resolve_spec(scheme_or_name)
        self.name = spec_name(self.spec)
        self.num_layers, self.num_kv_heads, self.head_dim = model_geometry(config)
        layers = [_layer(self.spec, i, self.head_dim, quantize_before_read) for i in range(self.num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    @property
    def kv_layers(self) -> list[KVarNLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes held: ``quantized`` (packed records, or baselines' honest bytes), ``unquantized``
        (sink, tail and exact sink-token copies in the model's dtype), ``total``; and
        ``quantized_elements`` / ``unquantized_elements`` / ``copy_elements`` (keys and values
        counted separately; copies are numbers also held packed, so they add bytes, not tokens)."""
        q = round(sum(layer.quantized_bytes() for layer in self.kv_layers))
        u = sum(layer.unquantized_bytes() for layer in self.kv_layers)
        return {
            "quantized": q,
            "unquantized": u,
            "total": q + u,
            "quantized_elements": sum(layer.quantized_elements() for layer in self.kv_layers),
            "unquantized_elements": sum(layer.unquantized_elements() for layer in self.kv_layers),
            "copy_elements": sum(layer.copy_elements() for layer in self.kv_layers),
        }

    def nbytes(self) -> int:
        """Bytes actually held: packed tiles plus the unquantized tail and sink."""
        return self.nbytes_breakdown()["total"]

    def bits_per_element(self, unquantized_bits: int = 16) -> float:
        """Stored bits per cached number right now, unquantized numbers counted at ``unquantized_bits``
        (what a 16-bit server would hold, whatever dtype the model runs in here)."""
        q = sum(layer.quantized_bytes() for layer in self.kv_layers)
        b = self.nbytes_breakdown()
        elements = b["quantized_elements"] + b["unquantized_elements"]
        if elements == 0:
            raise ValueError("the cache is empty; bits per element are undefined")
        held = b["unquantized_elements"] + b["copy_elements"]
        return (8.0 * q + unquantized_bits * held) / elements
