"""Triton kernels generated per scheme: tile store, fused paged decode attention, prefill.

Bodies (``@triton.jit``) live in ``_store.py``, ``_decode.py`` and ``_prefill.py``; the launchers in
:mod:`kvarn.kernels.ops` check arguments, allocate outputs and choose grids; launch options come
from :mod:`kvarn.kernels.configs`. Every kernel is specialized through ``tl.constexpr`` on the
scheme (bits, group size, head_dim, rotation, iterations, scale storage): one source for every
scheme, compiled once per specialization by Triton's cache. Without CUDA, run them under
``TRITON_INTERPRET=1`` (correctness only).
"""

from kvarn.kernels._checks import KernelArgumentError
from kvarn.kernels.configs import KernelConfig, decode_configs, dequant_configs, prefill_configs, store_configs
from kvarn.kernels.ops import (
    choose_num_splits,
    decode_attention,
    prefill_attention,
    quantize_tiles_triton,
    split_lengths,
    store_tiles,
)

__all__ = [
    "KernelArgumentError",
    "KernelConfig",
    "choose_num_splits",
    "decode_attention",
    "decode_configs",
    "dequant_configs",
    "prefill_attention",
    "prefill_configs",
    "quantize_tiles_triton",
    "split_lengths",
    "store_configs",
    "store_tiles",
]
