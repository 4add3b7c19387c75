"""Dequantize whole paged blocks on the CPU: what prefill attention reads of cached tiles.

:func:`dequantize_blocks` turns the records of the blocks a prefill call reads into unrotated keys
and values in the query's dtype, laid out ``[H, U, T, D]`` so that each KV head's rows of every block
are one contiguous run. The native path (``dequant.cpp``) unpacks the codes, applies scales, zero
points and factors and un-rotates with a fast Walsh-Hadamard transform, one OpenMP task per side of
each tile; without the extension the reference codec (:func:`kvarn.codec.dequantize_tiles`) runs.
Both decode the same stored numbers: they differ only by float32 rounding of the un-rotation (a
transform instead of a matrix product, relative differences of order 1e-7 before the rounding to
the output dtype).
"""

from __future__ import annotations

import torch

from kvarn.codec.tiles import dequantize_tiles
from kvarn.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KernelArgumentError,
    check_scheme,
    check_tensor,
    log8_table,
)
from kvarn.kernels.cpu import native
from kvarn.kernels.cpu._checks import CPU
from kvarn.schemes.scheme import Scheme

__all__ = ["dequantize_blocks"]


def dequantize_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, scheme: Scheme, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[H, U, T, D]`` of ``dtype`` (float32, float16 or bfloat16), unrotated.

    Args:
        cache: ``[num_blocks, H, >= tile_bytes]`` uint8 pages, the record of block ``b``, head ``h``
            in ``cache[b, h, :tile_bytes]``.
        blocks: ``[U]`` int32/int64 block ids, each in ``0..num_blocks-1``.
        scheme: a scheme without per-layer overrides.
        head_dim: D.
        dtype: of the result.

    Raises:
        KernelArgumentError: an argument of another shape or dtype, or a block id out of range
            (checked on the host before anything is read), named in the message.
    """
    _check(cache, blocks, scheme, head_dim, dtype)
    u, h, t, d = blocks.shape[0], cache.shape[1], scheme.group_size, head_dim
    ext = native.extension()
    if not u:
        empty = torch.empty(h, 0, t, d, dtype=dtype)
        return empty, empty.clone()
    if ext is None or cache.stride(2) != 1:
        nb = scheme.tile_bytes(d)
        dk, dv = dequantize_tiles(cache[blocks, :, :nb].reshape(u * h, nb), scheme, d, dtype=dtype)
        return dk.view(u, h, t, d).transpose(0, 1).contiguous(), dv.view(u, h, t, d).transpose(0, 1).contiguous()
    out_k = torch.empty(h, u, t, d, dtype=dtype)
    out_v = torch.empty(h, u, t, d, dtype=dtype)
    ext.dequant(
        cache,
        blocks.to(torch.int64).contiguous(),
        log8_table(CPU),
        native.store_record(scheme, d),
        *native.rotation_args(scheme, d),
        out_k,
        out_v,
        torch.get_num_threads(),
    )
    return out_k, out_v


def _check(cache: torch.Tensor, blocks: torch.Tensor, scheme: Scheme, head_dim: int, dtype: torch.dtype) -> None:
    nb = check_scheme(scheme, head_dim)
    check_tensor("cache", cache, (None, None, None), (torch.uint8,), CPU, inner_contiguous=False)
    if cache.shape[2] < nb:
        raise KernelArgumentError(
            f"cache holds {cache.shape[2]} bytes per record; scheme {scheme.name} at head_dim {head_dim} needs {nb}"
        )
    check_tensor("blocks", blocks, (None,), INDEX_DTYPES, CPU, inner_contiguous=False)
    if dtype not in FLOAT_DTYPES:
        raise KernelArgumentError(f"dtype={dtype} is not supported; allowed: {', '.join(map(str, FLOAT_DTYPES))}")
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= cache.shape[0]):
        bad = blocks[(blocks < 0) | (blocks >= cache.shape[0])]
        raise KernelArgumentError(f"blocks must be block ids in 0..{cache.shape[0] - 1}, got {bad[:8].tolist()}")
