"""Attention kernels over packed KV tiles, by backend, behind one contract.

* :mod:`kvarn.kernels.api`: the argument both backends take (:class:`PagedContext`), their
  protocol (:class:`AttentionOps`).
* :mod:`kvarn.kernels.dispatch`: :func:`ops_for`, which picks a backend for a device.
* :mod:`kvarn.kernels.triton`: Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).
* :mod:`kvarn.kernels.cpu`: a native C++ kernel built with ``torch.utils.cpp_extension``, and the
  torch path (vectorized PyTorch, no compiler needed).

Importing this package imports neither Triton nor a compiler.
"""

from __future__ import annotations

from kvarn.kernels._checks import KernelArgumentError
from kvarn.kernels.api import AttentionOps, PagedContext, split_lengths
from kvarn.kernels.dispatch import ops_for

__all__ = ["AttentionOps", "KernelArgumentError", "PagedContext", "ops_for", "split_lengths"]
