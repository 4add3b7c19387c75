"""The quantization scheme: one frozen dataclass, its canonical name, and every byte size.

A scheme fixes how one tile (``group_size`` tokens x ``head_dim`` channels of one KV head) of
keys and of values is stored. Everything derived from it (bytes of one packed tile, bits per
element, compression vs 16-bit) is computed here and nowhere else.

Canonical names::

    kvarn_k{K}v{V}_g{G}[_rot-none|_rot-rh][_it{N}][_s8][_sink|_sink{S}][_L{a}[-{b}]k{K}v{V}|_L{a}[-{b}]fp16 ...]

``kvarn_k4v2_g128`` is 4-bit keys, 2-bit values, 128-token tiles with every other option at its
default (Hadamard rotation, 8 normalization iterations, fp16 scales, the first token of each
sequence kept exactly, no per-layer overrides). Each non-default option adds exactly one suffix, in
the order above, so ``Scheme.from_name(s.name) == s`` for every scheme; ``_sink0`` opts out of the
exact first token, ``_sink2``/``_sink4``/``_sink8`` keep more, ``_sink`` keeps the whole first tile.

Two ways to protect the attention sink (the first tokens of a sequence, which most heads attend to
heavily, so their rounding error is not averaged away):

* ``_sink`` (``sink_tile``): the whole first tile stays unquantized; packed tiles start after it.
* ``sink_tokens=S`` (S in 0, 1, 2, 4, 8; default 1, spelled ``_sink{S}`` otherwise): every tile is
  packed as usual (tile 0 included, so page alignment and record layout do not change), and the
  first ``S`` tokens are *also* kept exactly (model dtype); readers use the exact copies instead of
  their quantized ones. Cost: ``S`` tokens x keys and values x ``head_dim`` x 16 bits per layer, KV
  head and sequence (+0.002 bits/element at 8192 tokens for S = 1).

The default keeps one exact token because it is most of what a sink buys, on more than one text
(docs/accuracy.md, "Exact first tokens by default", has the figures and their commands).

Both are per-sequence costs outside :meth:`Scheme.bits_per_element` unless it is given the
``context`` length to spread them over. With a sink tile, ``sink_tokens`` is 0: the tile already keeps
the first tokens exact (so ``Scheme(sink_tile=True)`` needs no ``sink_tokens=0``).

Example:
    >>> s = Scheme.from_name("kvarn_k4v2_g128")
    >>> s.bits_per_element(head_dim=128)
    3.375
    >>> Scheme(key_bits=3, value_bits=2, scale_dtype="log8").name
    'kvarn_k3v2_g128_s8'
    >>> Scheme(sink_tokens=0).name
    'kvarn_k4v2_g128_sink0'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

ALLOWED_BITS: tuple[int, ...] = (2, 3, 4, 8)
ALLOWED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
ALLOWED_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
ALLOWED_ROTATIONS: tuple[str, ...] = ("hadamard", "none", "rhadamard")
ALLOWED_SCALE_DTYPES: tuple[str, ...] = ("fp16", "log8")
ALLOWED_SINK_TOKENS: tuple[int, ...] = (0, 1, 2, 4, 8)
MAX_NORM_ITERS = 32
DEFAULT_NORM_ITERS = 8
DEFAULT_SINK_TOKENS = 1  # exact first tokens by default; why 1, see the module docstring

Rotation = Literal["hadamard", "none", "rhadamard"]
ScaleDtype = Literal["fp16", "log8"]

_ROT_SUFFIX = {"none": "_rot-none", "rhadamard": "_rot-rh"}
_SCALE_SUFFIX = {"log8": "_s8"}


class SchemeError(ValueError):
    """An invalid scheme field or name; the message names the value and the allowed ones."""


def _check_choice(field_name: str, value: object, allowed: tuple[object, ...]) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise SchemeError(f"{field_name}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")


@dataclass(frozen=True)
class LayerOverride:
    """Layers ``first..last`` (inclusive) use other bit widths, or stay unquantized (bits None)."""

    first: int
    last: int
    key_bits: int | None = None
    value_bits: int | None = None

    def __post_init__(self) -> None:
        if self.first < 0 or self.last < self.first:
            raise SchemeError(f"layer range {self.first}-{self.last} is invalid; need 0 <= first <= last")
        if (self.key_bits is None) != (self.value_bits is None):
            raise SchemeError("a layer override sets both key_bits and value_bits, or neither (unquantized)")
        if self.key_bits is not None:
            _check_choice("override key_bits", self.key_bits, ALLOWED_BITS)
            _check_choice("override value_bits", self.value_bits, ALLOWED_BITS)

    @property
    def unquantized(self) -> bool:
        return self.key_bits is None

    @property
    def suffix(self) -> str:
        rng = f"{self.first}" if self.first == self.last else f"{self.first}-{self.last}"
        body = "fp16" if self.unquantized else f"k{self.key_bits}v{self.value_bits}"
        return f"_L{rng}{body}"


@dataclass(frozen=True)
class Scheme:
    """A KV-cache quantization scheme. Frozen, hashable, and named canonically by :attr:`name`."""

    key_bits: int = 4
    value_bits: int = 2
    group_size: int = 128
    rotation: Rotation = "hadamard"
    norm_iters: int = DEFAULT_NORM_ITERS
    scale_dtype: ScaleDtype = "fp16"
    sink_tile: bool = False
    overrides: tuple[LayerOverride, ...] = field(default=())
    sink_tokens: int = DEFAULT_SINK_TOKENS  # last, so positional construction of older code keeps working

    def __post_init__(self) -> None:
        _check_choice("key_bits", self.key_bits, ALLOWED_BITS)
        _check_choice("value_bits", self.value_bits, ALLOWED_BITS)
        _check_choice("group_size", self.group_size, ALLOWED_GROUP_SIZES)
        _check_choice("rotation", self.rotation, ALLOWED_ROTATIONS)
        _check_choice("scale_dtype", self.scale_dtype, ALLOWED_SCALE_DTYPES)
        if isinstance(self.norm_iters, bool) or not isinstance(self.norm_iters, int):
            raise SchemeError(f"norm_iters={self.norm_iters!r} must be an integer in 0..{MAX_NORM_ITERS}")
        if not 0 <= self.norm_iters <= MAX_NORM_ITERS:
            raise SchemeError(f"norm_iters={self.norm_iters} is not allowed; allowed: 0..{MAX_NORM_ITERS}")
        if not isinstance(self.sink_tile, bool):
            raise SchemeError(f"sink_tile={self.sink_tile!r} must be true or false")
        _check_choice("sink_tokens", self.sink_tokens, ALLOWED_SINK_TOKENS)
        if self.sink_tile:
            if self.sink_tokens not in (0, DEFAULT_SINK_TOKENS):
                raise SchemeError(
                    f"sink_tile and sink_tokens={self.sink_tokens} exclude each other: the sink tile already keeps "
                    "the first tile unquantized; choose one"
                )
            object.__setattr__(self, "sink_tokens", 0)  # the tile covers the default exact first token
        ordered = tuple(sorted(self.overrides, key=lambda o: o.first))
        for a, b in zip(ordered, ordered[1:], strict=False):
            if b.first <= a.last:
                raise SchemeError(f"layer overrides overlap: {a.suffix[1:]} and {b.suffix[1:]}")
        object.__setattr__(self, "overrides", ordered)

    # ---- names -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Canonical name; ``Scheme.from_name(self.name) == self``."""
        parts = [f"kvarn_k{self.key_bits}v{self.value_bits}_g{self.group_size}"]
        parts.append(_ROT_SUFFIX.get(self.rotation, ""))
        if self.norm_iters != DEFAULT_NORM_ITERS:
            parts.append(f"_it{self.norm_iters}")
        parts.append(_SCALE_SUFFIX.get(self.scale_dtype, ""))
        if self.sink_tile:
            parts.append("_sink")
        elif self.sink_tokens != DEFAULT_SINK_TOKENS:
            parts.append(f"_sink{self.sink_tokens}")
        parts.extend(o.suffix for o in self.overrides)
        return "".join(parts)

    @classmethod
    def from_name(cls, name: str) -> Scheme:
        """Parse a canonical name. Raises :class:`SchemeError` naming the part that is wrong.

        The explicit spelling of the default sink (``_sink1``, canonical before exact first tokens
        became the default) is accepted too: ``from_name("kvarn_k4v2_g128_sink1").name`` is
        ``"kvarn_k4v2_g128"``.
        """
        m = _NAME_RE.fullmatch(name)
        if m is None:
            raise SchemeError(
                f"{name!r} is not a canonical kvarn scheme name; expected "
                "kvarn_k<K>v<V>_g<G>[_rot-none|_rot-rh][_it<N>][_s8][_sink|_sink<S>][_L<a>[-<b>]k<K>v<V>|_L<a>[-<b>]fp16...]"
            )
        rotation = {"_rot-none": "none", "_rot-rh": "rhadamard", None: "hadamard"}[m["rot"]]
        overrides = []
        for om in _OVR_RE.finditer(m["ovr"] or ""):
            first = int(om["a"])
            last = int(om["b"]) if om["b"] else first
            kb = int(om["k"]) if om["k"] else None
            vb = int(om["v"]) if om["v"] else None
            overrides.append(LayerOverride(first, last, kb, vb))
        scheme = cls(
            key_bits=int(m["k"]),
            value_bits=int(m["v"]),
            group_size=int(m["g"]),
            rotation=rotation,  # type: ignore[arg-type]
            norm_iters=int(m["it"]) if m["it"] else DEFAULT_NORM_ITERS,
            scale_dtype="log8" if m["s8"] else "fp16",
            sink_tile=bool(m["sink"]) and m["sinkn"] is None,
            sink_tokens=int(m["sinkn"]) if m["sinkn"] is not None else (0 if m["sink"] else DEFAULT_SINK_TOKENS),
            overrides=tuple(overrides),
        )
        spelled = name
        if m["sinkn"] == str(DEFAULT_SINK_TOKENS):
            spelled = name[: m.start("sink")] + name[m.end("sink") :]
        if scheme.name != spelled:  # e.g. "_it8" spelled out, or overrides out of order
            raise SchemeError(f"{name!r} is not canonical; write it as {scheme.name!r}")
        return scheme

    # ---- per layer -----------------------------------------------------------------------------
    def for_layer(self, layer: int) -> Scheme | None:
        """The scheme that layer ``layer`` uses (no overrides), or None if it stays unquantized."""
        for o in self.overrides:
            if o.first <= layer <= o.last:
                if o.unquantized:
                    return None
                assert o.key_bits is not None and o.value_bits is not None
                return replace(self, key_bits=o.key_bits, value_bits=o.value_bits, overrides=())
        return replace(self, overrides=()) if self.overrides else self

    # ---- sizes: the one place they are computed ------------------------------------------------
    @property
    def param_bytes(self) -> int:
        """Bytes of one stored scale, zero point or normalization factor (2 for fp16, 1 for log8)."""
        return 2 if self.scale_dtype == "fp16" else 1

    def key_code_bytes(self, head_dim: int) -> int:
        return self.group_size * head_dim * self.key_bits // 8

    def value_code_bytes(self, head_dim: int) -> int:
        return self.group_size * head_dim * self.value_bits // 8

    def key_param_bytes(self, head_dim: int) -> int:
        """Keys: a scale and a zero point per channel, a normalization factor per token."""
        return self.param_bytes * (2 * head_dim + self.group_size)

    def value_param_bytes(self, head_dim: int) -> int:
        """Values: a scale and a zero point per token, a normalization factor per channel."""
        return self.param_bytes * (2 * self.group_size + head_dim)

    def tile_bytes(self, head_dim: int) -> int:
        """Bytes of one packed record: keys and values of one tile of one KV head (one layer)."""
        _check_choice("head_dim", head_dim, ALLOWED_HEAD_DIMS)
        return (
            self.key_code_bytes(head_dim)
            + self.value_code_bytes(head_dim)
            + self.key_param_bytes(head_dim)
            + self.value_param_bytes(head_dim)
        )

    @property
    def sink_len(self) -> int:
        """Tokens at the start of a sequence kept unquantized (sink tile or sink tokens), else 0."""
        return self.group_size if self.sink_tile else self.sink_tokens

    def sink_bytes(self, head_dim: int) -> int:
        """Bytes of the exact sink-token copies, keys and values, per layer, KV head and sequence
        (16-bit). The sink tile is not counted here: it replaces a packed tile (see
        :meth:`bits_per_element` with ``context``)."""
        return 2 * self.sink_tokens * head_dim * 2

    def bits_per_element(
        self, head_dim: int, num_layers: int | None = None, context: int | None = None, unquantized_bits: float = 16.0
    ) -> float:
        """Stored bits per cached number (keys and values), every scale and zero point included.

        With per-layer overrides the figure depends on the layer count: pass ``num_layers`` for
        the mean of :meth:`layer_bits` over the layers (unquantized layers count
        ``unquantized_bits``, 16 by default; a server keeping them in a float32 cache stores 32).
        Without it, the overrides are ignored.

        ``context``: spread the per-sequence sink cost over a sequence of this many tokens (the
        sink tile's 16-bit tokens instead of packed ones, or the exact sink-token copies). Without
        it the sink is not counted: the figure is the packed tiles' alone.
        """
        if num_layers is None or not self.overrides:
            return self._tile_bits(head_dim, context)
        per_layer = self.layer_bits(head_dim, num_layers, context, unquantized_bits)
        return sum(per_layer) / num_layers

    def layer_bits(
        self, head_dim: int, num_layers: int, context: int | None = None, unquantized_bits: float = 16.0
    ) -> list[float]:
        """Bits per element of each of ``num_layers`` layers (index = layer), overrides applied:
        :meth:`for_layer`'s scheme, or ``unquantized_bits`` for an unquantized layer. ``context``
        as in :meth:`bits_per_element`."""
        if num_layers < 1:
            raise SchemeError(f"num_layers={num_layers} must be >= 1")
        out = []
        for layer in range(num_layers):
            s = self.for_layer(layer)
            out.append(unquantized_bits if s is None else s._tile_bits(head_dim, context))
        return out

    def _tile_bits(self, head_dim: int, context: int | None) -> float:
        """Bits per element of this scheme's own layout (overrides ignored); see :meth:`bits_per_element`."""
        if context is not None and context < 1:
            raise SchemeError(f"context={context} must be >= 1 token")
        bits = 8.0 * self.tile_bytes(head_dim) / (2 * self.group_size * head_dim)
        if context is not None:
            if self.sink_tile:
                sink = min(self.group_size, context)
                bits = (16.0 * sink + bits * (context - sink)) / context
            else:
                bits += 16.0 * min(self.sink_tokens, context) / context
        return bits

    def compression(self, head_dim: int, num_layers: int | None = None, context: int | None = None) -> float:
        """How many times smaller than a 16-bit cache."""
        return 16.0 / self.bits_per_element(head_dim, num_layers, context)


_NAME_RE = re.compile(
    r"kvarn_k(?P<k>\d+)v(?P<v>\d+)_g(?P<g>\d+)"
    r"(?P<rot>_rot-none|_rot-rh)?(?:_it(?P<it>\d+))?(?P<s8>_s8)?(?P<sink>_sink(?P<sinkn>\d+)?)?"
    r"(?P<ovr>(?:_L\d+(?:-\d+)?(?:k\d+v\d+|fp16))*)"
)
_OVR_RE = re.compile(r"_L(?P<a>\d+)(?:-(?P<b>\d+))?(?:k(?P<k>\d+)v(?P<v>\d+)|fp16)")
