"""The Triton backend: tile store, fused paged decode attention and prefill, one source per kernel.

``_store.py``, ``_decode.py`` and ``_prefill.py`` hold the ``@triton.jit`` bodies (``_attend.py``
the parts decode and prefill share); :mod:`.ops` the launchers (the :class:`~kvarn.kernels.api.AttentionOps` of CUDA devices); :mod:`.configs`
the launch options. Importing this package imports Triton.
"""

from __future__ import annotations

from kvarn.kernels.triton.configs import (
    KernelConfig,
    choose_num_splits,
    decode_bytes,
    decode_configs,
    prefill_configs,
    store_configs,
)
from kvarn.kernels.triton.ops import decode_attention, prefill_attention, quantize_tiles_triton, store_tiles

__all__ = [
    "KernelConfig",
    "choose_num_splits",
    "decode_attention",
    "decode_bytes",
    "decode_configs",
    "prefill_attention",
    "prefill_configs",
    "quantize_tiles_triton",
    "store_configs",
    "store_tiles",
]
