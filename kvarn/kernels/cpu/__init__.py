"""The CPU backend: a native C++ kernel (decode, store) and the torch path (vectorized PyTorch).

* :mod:`.ops`: the :class:`~kvarn.kernels.api.AttentionOps` of the CPU (decode, prefill, store).
* :mod:`.native`: builds ``decode.cpp``, ``store.cpp`` and ``bind.cpp`` with
  ``torch.utils.cpp_extension`` on first use and calls them with tensors.
* :mod:`.torch_path`: the torch path, the same decode in vectorized PyTorch (no compiler needed).
* :mod:`.prefill`: prefill over packed tiles with torch's CPU flash attention.
* :mod:`.store`: the store of full tiles (native, or the reference codec).

Importing this package imports neither Triton nor a compiler.
"""

from __future__ import annotations

from kvarn.kernels.cpu.ops import decode_attention, prefill_attention, quantize_tiles_cpu, store_tiles

__all__ = ["decode_attention", "prefill_attention", "quantize_tiles_cpu", "store_tiles"]
