"""Cache specs: what a name given to ``KVarNCache`` or ``kvarn eval`` stands for.

A spec is one of three things:

* ``"fp16"`` (:data:`FP16`): no quantization; keys and values stay in the model's dtype.
* a :class:`kvarn.schemes.Scheme`: full tiles stored as packed records of the reference codec.
* a baseline (:class:`BaselineLike`, from :mod:`kvarn.baselines`): fake-quantized when committed.

Lookup order for a name: ``fp16``, a baseline name, then anything :func:`kvarn.schemes.get_preset`
resolves (built-in and user presets, preset files, canonical ``kvarn_...`` names).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from kvarn.schemes import Scheme, UnknownSchemeError, get_preset, list_presets

FP16 = "fp16"


@runtime_checkable
class BaselineLike(Protocol):
    """The Baseline interface of :mod:`kvarn.baselines` (see its docstring for the semantics)."""

    @property
    def name(self) -> str: ...

    @property
    def commit_tokens(self) -> int: ...  # tokens quantized together once written

    @property
    def window(self) -> int: ...  # most recent tokens kept unquantized

    def bits_per_element(self, head_dim: int) -> float: ...

    def roundtrip(
        self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


Spec = Scheme | BaselineLike | None  # None = fp16 (unquantized)


def baselines() -> dict[str, BaselineLike]:
    """The registered baselines by name; empty while :mod:`kvarn.baselines` is not installed."""
    try:
        from kvarn.baselines import BASELINES
    except ImportError:
        return {}
    return dict(BASELINES)


def known_names() -> list[str]:
    """Every name accepted by :func:`resolve_spec`, except canonical ``kvarn_...`` names and files."""
    return [FP16, *baselines(), *(p.name for p in list_presets())]


def resolve_spec(spec: str | Scheme | BaselineLike) -> Spec:
    """``"fp16"`` -> None, a baseline name -> the baseline, a kvarn name -> its :class:`Scheme`.

    Raises:
        UnknownSchemeError: the name is none of these; the message lists every valid name.
    """
    if isinstance(spec, (Scheme, BaselineLike)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a cache spec is a name, a Scheme or a Baseline, not {type(spec).__name__}")
    if spec == FP16:
        return None
    found = baselines().get(spec)
    if found is not None:
        return found
    try:
        return get_preset(spec).scheme
    except UnknownSchemeError as e:
        raise UnknownSchemeError(
            f"unknown scheme {spec!r}. Valid names: {', '.join(known_names())}, or any canonical kvarn name "
            f"(kvarn_k<K>v<V>_g<G>...). Details: {e}"
        ) from None


def spec_name(spec: Spec) -> str:
    """The canonical name of a resolved spec."""
    return FP16 if spec is None else spec.name
