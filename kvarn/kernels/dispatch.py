"""Which backend's :class:`~kvarn.kernels.api.AttentionOps` serve a device: the one place kernels are chosen.

The backends import :mod:`kvarn.kernels.api` for their argument; this module imports them, so the
contract never imports an implementation of itself.
"""

from __future__ import annotations

import torch

from kvarn.kernels.api import AttentionOps

BACKENDS: tuple[str, ...] = ("triton", "cpu")


def ops_for(device: torch.device | str, backend: str | None = None) -> AttentionOps:
    """The attention ops for tensors on ``device``: ``backend`` when named, else Triton on CUDA and
    the CPU ops elsewhere. ``"triton"`` on a CPU runs the CUDA path's kernels under Triton's
    interpreter (``TRITON_INTERPRET=1``).

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    if backend is None:
        backend = "triton" if torch.device(device).type == "cuda" else "cpu"
    if backend == "triton":
        from kvarn.kernels.triton import ops as triton_ops

        return triton_ops
    if backend == "cpu":
        from kvarn.kernels.cpu import ops as cpu_ops

        return cpu_ops
    raise ValueError(f"kernel backend {backend!r} is not one of: {', '.join(BACKENDS)}")
