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

Sliding-window layers (Gemma 2/3, Mistral-style; see :mod:`kvarn.hf.geometry`) stay unquantized by
default, exact and windowed as in transformers' own ``DynamicCache(config=...)``, beside quantized
full-attention layers (KVarN's behaviour). ``quantize_sliding=True`` quantizes them too, for any
spec: tiles aligned at multiples of the tile length from the sequence start, as a server's blocks,
and a tile is dropped once all of its tokens have left the window. Bits and bytes are reported per
layer type and overall (:meth:`KVarNCache.by_layer_type`) at the cache's current length.

Hybrid models (Mamba / linear-attention layers beside attention layers): the recurrent layers get
transformers' own ``LinearAttentionLayer`` (their conv and recurrent states, in the model's dtype,
as ``DynamicCache(config=...)`` gives them); only the attention layers are quantized, and bits and
bytes count the attention layers only (a recurrent state does not grow with the context).
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache, LinearAttentionLayer

from kvarn.hf.geometry import STATE_TYPES, CacheGeometry, cache_geometry
from kvarn.hf.layers import BaselineCommitter, KVarNLayer, TileCommitter
from kvarn.hf.spec import BaselineLike, Spec, resolve_spec, spec_name
from kvarn.schemes import Scheme


def _commit_unit(spec: Spec) -> int:
    """Tokens one commit stores: a scheme's tile, a baseline's group; 1 for fp16."""
    if spec is None:
        return 1
    return spec.group_size if isinstance(spec, Scheme) else int(spec.commit_tokens)


def _layer(
    spec: Spec, layer: int, geometry: CacheGeometry, quantize_before_read: bool, quantize_sliding: bool
) -> KVarNLayer | LinearAttentionLayer:
    if geometry.layer_types[layer] in STATE_TYPES:  # a hybrid model's recurrent layer: as transformers keeps it
        return LinearAttentionLayer()
    window = geometry.windows[layer]
    if window is not None:  # every sliding layer drops alike (one mask serves them all)
        unit = _commit_unit(spec) if quantize_sliding else 1
        s = spec.for_layer(layer) if isinstance(spec, Scheme) else spec
        if s is None or not quantize_sliding:
            return KVarNLayer(None, sliding_window=window, drop_unit=unit)
        committer = (
            TileCommitter(s, geometry.head_dim) if isinstance(s, Scheme) else BaselineCommitter(s, geometry.head_dim)
        )
        return KVarNLayer(committer, 0, quantize_before_read, sliding_window=window, drop_unit=unit)
    if spec is None:
        return KVarNLayer(None)
    if isinstance(spec, Scheme):
        s = spec.for_layer(layer)
        if s is None:
            return KVarNLayer(None)
        sink = s.group_size if s.sink_tile else 0
        return KVarNLayer(TileCommitter(s, geometry.head_dim), sink, quantize_before_read, exact_tokens=s.sink_tokens)
    return KVarNLayer(BaselineCommitter(spec, geometry.head_dim), 0, quantize_before_read)


def _bits(layers: list[KVarNLayer], unquantized_bits: int) -> float:
    """Stored bits per held number of ``layers``; unquantized numbers (and exact copies) at ``unquantized_bits``."""
    q = sum(layer.quantized_bytes() for layer in layers)
    elements = sum(layer.quantized_elements() + layer.unquantized_elements() for layer in layers)
    if elements == 0:
        raise ValueError("the cache is empty; bits per element are undefined")
    held = sum(layer.unquantized_elements() + layer.copy_elements() for layer in layers)
    return (8.0 * q + unquantized_bits * held) / elements


class KVarNCache(Cache):
    """A transformers cache for a kvarn scheme, a baseline, or ``"fp16"`` (no quantization).

    Args:
        scheme_or_name: a :class:`Scheme`, a baseline, or a name (``"fp16"``, a baseline name, a
            preset or canonical kvarn name).
        config: the model's transformers config (layer types, sliding windows, KV heads, head_dim).
        quantize_before_read: a chunk reads its own tokens quantized once committed (default: it
            reads them as computed and later chunks read them as stored; see :mod:`kvarn.hf.layers`).
        quantize_sliding: quantize sliding-window layers too (default: they stay exact, 16-bit).
            Their tiles carry no sink (a sliding layer's first tokens leave its window).

    Raises:
        UnknownSchemeError: unknown name (the message lists the valid ones).
        SchemeError: the scheme does not support the model's head_dim.
        ValueError: the model has layers other than full or sliding-window attention; with
            ``quantize_sliding``, a baseline whose unquantized window is not shorter than the model's.
    """

    def __init__(
        self,
        scheme_or_name: str | Scheme | BaselineLike,
        config: Any,
        *,
        quantize_before_read: bool = False,
        quantize_sliding: bool = False,
    ) -> None:
        self.spec: Spec = resolve_spec(scheme_or_name)
        self.name = spec_name(self.spec)
        self.geometry = cache_geometry(config)
        self.quantize_sliding = quantize_sliding
        self.num_layers, self.num_kv_heads, self.head_dim = (
            self.geometry.num_layers,
            self.geometry.num_kv_heads,
            self.geometry.head_dim,
        )
        g = self.geometry
        layers = [_layer(self.spec, i, g, quantize_before_read, quantize_sliding) for i in range(g.num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    @property
    def kv_layers(self) -> list[KVarNLayer]:
        """The layers that cache keys and values (a hybrid model's recurrent layers excluded)."""
        return [layer for layer in self.layers if isinstance(layer, KVarNLayer)]

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer of :attr:`kv_layers`, ``"full_attention"`` or ``"sliding_attention"``."""
        return tuple(self.geometry.layer_types[i] for i in self.geometry.attention_layers)

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes held: ``quantized`` (packed records, or baselines' honest bytes), ``unquantized``
        (sink, tail, sliding windows and exact sink-token copies in the model's dtype), ``total``;
        and ``quantized_elements`` / ``unquantized_elements`` / ``copy_elements`` (keys and values
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
        """Stored bits per held number right now, unquantized numbers counted at ``unquantized_bits``
        (what a 16-bit server would hold, whatever dtype the model runs in here). Sliding layers
        count what they hold (at most their window), so ``16 / bits`` is the ratio to the 16-bit
        cache with the same windows."""
        return _bits(self.kv_layers, unquantized_bits)

    def by_layer_type(self, unquantized_bits: int = 16) -> dict[str, dict[str, float]]:
        """Per layer type present, and ``"all"``, at the cache's current length (``context``).

        Each entry: ``layers``, ``context`` (tokens of the sequence), ``held_tokens`` (per layer,
        summed over the type's layers), ``bytes`` (as stored: packed records, baselines' honest
        bytes and unquantized numbers at ``unquantized_bits``), ``fp16_bytes`` (the same held
        numbers at 16 bits), ``bits_per_element`` (NaN for a layer type that holds nothing yet).

        Raises:
            ValueError: the cache is empty.
        """
        groups: dict[str, list[KVarNLayer]] = {}
        for t, layer in zip(self.layer_types, self.kv_layers, strict=True):
            groups.setdefault(t, []).append(layer)
        groups["all"] = self.kv_layers
        out: dict[str, dict[str, float]] = {}
        for t, layers in groups.items():
            held = sum(layer.quantized_elements() + layer.unquantized_elements() for layer in layers)
            bits = _bits(layers, unquantized_bits) if held or t == "all" else float("nan")
            out[t] = {
                "layers": len(layers),
                "context": self.get_seq_length(),
                "held_tokens": sum(layer.held_tokens() for layer in layers),
                "bytes": bits * held / 8.0,
                "fp16_bytes": 2.0 * held,
                "bits_per_element": bits,
            }
        return out
