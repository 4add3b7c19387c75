"""Triton kernels generated per scheme: tile store, fused paged decode attention, prefill.

Bodies (``@triton.jit``) live in ``_store.py``, ``_decode.py`` and ``_prefill.py``; the launchers in
:mod:`kvarn.kernels.ops` check arguments, allocate outputs and choose grids; launch options come
from :mod:`kvarn.kernels.configs`. Every kernel is specialized through ``tl.constexpr`` on the
scheme (bits, group size, head_dim, rotation, iterations, scale storage): one source for every
scheme, compiled once per specialization by Triton's cache. Without CUDA, run them under
``TRITON_INTERPRET=1`` (correctness only).

The CPU kernels (:mod:`kvarn.kernels.cpu`, :mod:`kvarn.kernels.cpu_store`) do not need Triton, so
the names below are imported on first use (PEP 562): importing a CPU module of this package does
not import Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "KernelArgumentError": "kvarn.kernels._checks",
    "KernelConfig": "kvarn.kernels.configs",
    "decode_configs": "kvarn.kernels.configs",
    "dequant_configs": "kvarn.kernels.configs",
    "prefill_configs": "kvarn.kernels.configs",
    "store_configs": "kvarn.kernels.configs",
    "choose_num_splits": "kvarn.kernels.ops",
    "decode_attention": "kvarn.kernels.ops",
    "prefill_attention": "kvarn.kernels.ops",
    "quantize_tiles_triton": "kvarn.kernels.ops",
    "split_lengths": "kvarn.kernels.ops",
    "store_tiles": "kvarn.kernels.ops",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
