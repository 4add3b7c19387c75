"""Argument checks and cached constant tensors shared by both backends (Triton and CPU)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from kvarn.codec.params import load_positive
from kvarn.codec.rotation import rotation_matrix

if TYPE_CHECKING:
    from kvarn.kernels.api import PagedContext
    from kvarn.schemes.scheme import Scheme

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


def check_scheme(scheme: Scheme, head_dim: int) -> int:
    """Check that ``scheme`` has no per-layer overrides and that its codec takes ``head_dim``;
    returns the bytes of one tile record."""
    if scheme.overrides:
        raise KernelArgumentError(
            f"scheme {scheme.name} has per-layer overrides; pass scheme.for_layer(layer) (a scheme without overrides)"
        )
    return scheme.tile_bytes(head_dim)  # raises on a head_dim the codec does not support


def check_store(
    keys: torch.Tensor,
    values: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    scheme: Scheme,
    device: torch.device,
    *,
    any_strides: bool = False,
) -> tuple[int, int, int, int]:
    """Check the arguments of ``store_tiles``: ``keys``/``values`` ``[N, H, group_size, D]`` of one
    float dtype (a contiguous last axis unless ``any_strides``), ``cache`` ``[blocks, H, tile_bytes]``
    uint8, ``block_ids`` ``[N]`` int32/int64, ``scheme`` without overrides; returns ``(N, H, T, D)``."""
    if keys.dim() != 4:
        raise KernelArgumentError(
            f"keys must be [tiles, kv_heads, {scheme.group_size}, head_dim], got {list(keys.shape)}"
        )
    n, h, t, d = keys.shape
    tile_bytes = check_scheme(scheme, d)
    check_tensor("keys", keys, (n, h, scheme.group_size, d), FLOAT_DTYPES, device, not any_strides)
    check_tensor("values", values, (n, h, t, d), (keys.dtype,), device, not any_strides)
    check_tensor("block_ids", block_ids, (n,), INDEX_DTYPES, device)
    check_tensor("cache", cache, (None, h, tile_bytes), (torch.uint8,), device)
    return n, h, t, d


def refuse_non_finite(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise ``ValueError`` on inf or NaN in ``keys`` or ``values``, as the reference codec does
    (reads a flag on the host: a device sync)."""
    if not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
        raise ValueError("keys or values contain inf or NaN; the codec refuses to store a poisoned tile")


def check_query(query: torch.Tensor, device: torch.device) -> tuple[int, int, int]:
    """Check decode's ``query`` ``[B, Hq, D]`` (float, contiguous last axis); returns ``(B, Hq, D)``."""
    if query.dim() != 3:
        raise KernelArgumentError(f"query must be [batch, num_q_heads, head_dim], got {list(query.shape)}")
    bsz, hq, d = query.shape
    check_tensor("query", query, (bsz, hq, d), FLOAT_DTYPES, device)
    return bsz, hq, d


def check_new_tokens(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor, device: torch.device
) -> int:
    """Check prefill's new tokens: ``query`` ``[N, Hq, D]``, ``key`` and ``value`` ``[N, H, D]`` of
    one float dtype, ``cu_seqlens_q`` ``[B + 1]`` int32; returns ``B``."""
    if query.dim() != 3 or key.dim() != 3:
        raise KernelArgumentError(
            f"query and key must be [tokens, heads, head_dim], got {list(query.shape)}, {list(key.shape)}"
        )
    total, hq, d = query.shape
    check_tensor("query", query, (total, hq, d), FLOAT_DTYPES, device)
    check_tensor("key", key, (total, None, d), FLOAT_DTYPES, device)
    check_tensor("value", value, tuple(key.shape), (key.dtype,), device)
    check_tensor("cu_seqlens_q", cu_seqlens_q, (None,), (torch.int32,), device)
    if cu_seqlens_q.shape[0] < 1:
        raise KernelArgumentError("cu_seqlens_q must hold at least one entry (0)")
    return cu_seqlens_q.shape[0] - 1


def check_pages(ctx: PagedContext, bsz: int, hq: int, d: int, device: torch.device) -> int:
    """Check the paged part of ``ctx`` for ``bsz`` sequences of ``hq`` query heads of head_dim ``d``:
    the scheme, ``cache`` ``[blocks, Hkv, tile_bytes]`` uint8 with ``hq`` a multiple of ``Hkv``,
    ``block_table`` ``[B, *]`` and ``num_tiles`` ``[B]`` int32; returns ``Hkv``."""
    cache = ctx.cache
    tile_bytes = check_scheme(ctx.scheme, d)
    if cache.dim() != 3:
        raise KernelArgumentError(f"cache must be [num_blocks, num_kv_heads, tile_bytes], got {list(cache.shape)}")
    hkv = cache.shape[1]
    if hkv == 0 or hq % hkv:
        raise KernelArgumentError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    check_tensor("cache", cache, (None, hkv, tile_bytes), (torch.uint8,), device)
    check_tensor("block_table", ctx.block_table, (bsz, None), (torch.int32,), device)
    check_tensor("num_tiles", ctx.num_tiles, (bsz,), (torch.int32,), device)
    return hkv


def check_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx: PagedContext,
    device: torch.device,
) -> int:
    """Check prefill's new tokens (:func:`check_new_tokens`) and that ``key`` has the KV heads of
    ``ctx.cache``; returns ``B``. The rest of ``ctx`` is each backend's to check."""
    bsz = check_new_tokens(query, key, value, cu_seqlens_q, device)
    cache = ctx.cache
    if cache.dim() == 3 and key.shape[1] != cache.shape[1]:
        raise KernelArgumentError(f"key has {key.shape[1]} KV heads, cache {cache.shape[1]}")
    return bsz


def output_buffer(
    out: torch.Tensor | None,
    query: torch.Tensor,
    shape: tuple[int, int, int],
    device: torch.device,
    *,
    any_strides: bool = False,
) -> torch.Tensor:
    """An op's output: ``out`` checked against ``shape`` (any float dtype; a contiguous last axis
    unless ``any_strides``), or a new contiguous tensor of ``query``'s dtype."""
    if out is None:
        return torch.empty(shape, dtype=query.dtype, device=device)
    check_tensor("out", out, shape, FLOAT_DTYPES, device, inner_contiguous=not any_strides)
    return out


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
