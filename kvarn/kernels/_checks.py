"""Argument checks and cached constant tensors shared by both backends (Triton and CPU)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from kvarn.codec.params import load_positive
from kvarn.codec.rotation import rotation_matrix

if TYPE_CHECKING:
    from kvarn.kernels.api import PagedContext

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A kernel argument with the wrong shape, dtype, device or layout; the message names it."""


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    inner_contiguous: bool = True,
) -> None:
    """Check ``t`` against ``shape`` (None = any size), ``dtypes``, ``device`` and a unit last stride."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise KernelArgumentError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise KernelArgumentError(f"{name} dtype {t.dtype} is not supported; allowed: {', '.join(map(str, dtypes))}")
    if t.device != device:
        raise KernelArgumentError(f"{name} is on {t.device}, expected {device} (all kernel tensors on one device)")
    if inner_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        raise KernelArgumentError(f"{name} must have a contiguous last axis (stride 1), got strides {t.stride()}")


def check_rows(
    name: str,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    slot: torch.Tensor | None,
    shape: tuple[int, int, int],
    device: torch.device,
    slot_dtypes: tuple[torch.dtype, ...],
) -> None:
    """Check a tail or sink, ``shape`` = ``(B, Hkv, D)``: per sequence ``[B, Hkv, R, D]``, or a pool
    ``[slots, Hkv, R, D]`` read at ``slot`` ``[B]``; ``lens`` ``[B]`` int32; ``v`` like ``k``."""
    bsz, hkv, d = shape
    check_tensor(f"{name}_k", k, (bsz if slot is None else None, hkv, None, d), FLOAT_DTYPES, device)
    check_tensor(f"{name}_v", v, tuple(k.shape), (k.dtype,), device)
    check_tensor(f"{name}_lens", lens, (bsz,), (torch.int32,), device)
    if slot is not None:
        check_tensor(f"{name}_slot", slot, (bsz,), slot_dtypes, device)


def check_sink_given(ctx: PagedContext) -> bool:
    """Check that ``ctx`` passes the sink its scheme keeps (``sink_k``, ``sink_v`` and ``sink_lens``
    together, ``sink_slot`` only with them); returns whether a sink is given."""
    scheme, sink_k = ctx.scheme, ctx.sink_k
    if sink_k is None and scheme.sink_len:
        kept = "a sink tile" if scheme.sink_tile else f"its first {scheme.sink_tokens} tokens exactly"
        raise KernelArgumentError(f"scheme {scheme.name} keeps {kept}: pass sink_k, sink_v and sink_lens")
    if (sink_k is None) != (ctx.sink_v is None) or (sink_k is None) != (ctx.sink_lens is None):
        raise KernelArgumentError("sink_k, sink_v and sink_lens go together")
    if ctx.sink_slot is not None and sink_k is None:
        raise KernelArgumentError("sink_slot without sink_k, sink_v and sink_lens")
    return sink_k is not None


@functools.lru_cache(maxsize=64)
def rotation(kind: str, head_dim: int, device: torch.device) -> torch.Tensor:
    """``[D, D]`` float32 rotation R on ``device``, contiguous (identity for ``none``)."""
    return rotation_matrix(kind, head_dim, device).contiguous()


@functools.lru_cache(maxsize=8)
def log8_table(device: torch.device) -> torch.Tensor:
    """``[256]`` float32: the value of every log8 byte, from the reference decoder."""
    return load_positive(torch.arange(256, dtype=torch.int32).to(torch.uint8), "log8").to(device).contiguous()
