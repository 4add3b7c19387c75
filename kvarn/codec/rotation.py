"""Orthonormal rotations along head_dim: Hadamard and randomized (sign-flipped) Hadamard.

Because the rotation ``R`` is orthonormal, ``(q R) . (k R) = q . k``: attention over rotated keys
with a rotated query gives the same scores, and the output of attention over rotated values is
un-rotated with ``R^T``. Rotation spreads per-channel outliers over all channels before rounding.
"""

from __future__ import annotations

import functools

import torch

RANDOM_SIGN_SEED = 0x6B76  # fixed: a preset must decode the same way on every machine


@functools.lru_cache(maxsize=32)
def _rotation_cpu(kind: str, head_dim: int) -> torch.Tensor:
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two for a Hadamard rotation")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:  # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / head_dim**0.5
    if kind == "rhadamard":
        h = rotation_signs(kind, head_dim).to(torch.float64)[:, None] * h
    out: torch.Tensor = h.to(torch.float32)
    return out


@functools.lru_cache(maxsize=32)
def rotation_signs(kind: str, head_dim: int) -> torch.Tensor:
    """The ``[head_dim]`` float32 signs ``s`` of ``"rhadamard"`` (``R = diag(s) H / sqrt(head_dim)``,
    so ``x @ R`` is the Walsh-Hadamard transform of ``x * s``); all ones for ``"hadamard"``."""
    if kind == "hadamard":
        return torch.ones(head_dim)
    if kind != "rhadamard":
        raise ValueError(f"rotation={kind!r} has no signs; it is not one of: hadamard, rhadamard")
    gen = torch.Generator().manual_seed(RANDOM_SIGN_SEED + head_dim)
    return (torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64) * 2 - 1).to(torch.float32)


def rotation_matrix(kind: str, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal ``[head_dim, head_dim]`` float32 matrix R of rotation ``kind``.

    ``kind`` is ``"none"`` (identity), ``"hadamard"`` or ``"rhadamard"``. Rows of x are rotated
    as ``x @ R``.
    """
    if kind == "none":
        return torch.eye(head_dim, dtype=torch.float32, device=device)
    if kind not in ("hadamard", "rhadamard"):
        raise ValueError(f"rotation={kind!r} is not one of: hadamard, none, rhadamard")
    return _rotation_cpu(kind, head_dim).to(device)


def rotate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x @ R`` along the last axis, in float32. ``x``: ``[..., head_dim]``."""
    if kind == "none":
        return x.float()
    return x.float() @ rotation_matrix(kind, x.shape[-1], x.device)


def unrotate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x @ R^T`` along the last axis, in float32: the inverse of :func:`rotate`."""
    if kind == "none":
        return x.float()
    return x.float() @ rotation_matrix(kind, x.shape[-1], x.device).T
