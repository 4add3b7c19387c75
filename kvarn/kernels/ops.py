"""Launchers: check arguments, allocate outputs, choose the grid, call the Triton kernels.

Paged cache layout (one layer)::

    cache        [num_blocks, num_kv_heads, tile_bytes] uint8   one packed record per (block, KV head),
                                                                 record layout: kvarn.codec.tiles.layout
    block_table  [batch, max_blocks] int32    block ids of each sequence's full tiles, in token order
    num_tiles    [batch] int32                how many entries of block_table are full (quantized) tiles
    tail_k/v     [batch, num_kv_heads, group_size, head_dim] fp16/bf16/fp32, unrotated: the tile
                                              being filled; tail_lens [batch] int32 valid tokens
    sink_k/v     optional, same shape as tail: the first tile kept unquantized (scheme.sink_tile);
                                              sink_lens [batch] int32 valid tokens

A sequence's context is, in token order: sink tokens, then its ``num_tiles`` packed tiles, then its
tail tokens. :func:`split_lengths` turns context lengths into those three counts. Queries and
outputs are unrotated; kernels rotate the query and un-rotate the output when the scheme rotates.
The staging tensors (tail, sink) may be any strided views whose last axis is contiguous.
"""

from __future__ import annotations

import math

import torch

from kvarn.codec.tiles import layout
from kvarn.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, KernelArgumentError, check_tensor, log8_table, rotation
from kvarn.kernels._store import store_side_kernel
from kvarn.kernels.configs import KernelConfig, store_configs
from kvarn.schemes.scheme import Scheme


def _check_scheme(scheme: Scheme, head_dim: int) -> None:
    if scheme.overrides:
        raise KernelArgumentError(
            f"scheme {scheme.name} has per-layer overrides; pass scheme.for_layer(layer) (a scheme without overrides)"
        )
    scheme.tile_bytes(head_dim)  # raises on a head_dim the codec does not support


def _check_cache(cache: torch.Tensor, scheme: Scheme, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
    check_tensor("cache", cache, (None, num_kv_heads, scheme.tile_bytes(head_dim)), (torch.uint8,), device)
    if cache.stride(1) != cache.shape[2]:
        raise KernelArgumentError(f"cache must be contiguous in its last two axes, got strides {cache.stride()}")


def store_tiles(
    keys: torch.Tensor,
    values: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    scheme: Scheme,
    *,
    check_finite: bool = False,
    config: KernelConfig | None = None,
) -> None:
    """Quantize and pack full tiles into the paged cache, in place.

    Args:
        keys: ``[N, num_kv_heads, group_size, head_dim]`` fp16/bf16/fp32, unrotated; any strides with
            a contiguous last axis (a permuted ``[N, group_size, num_kv_heads, head_dim]`` works).
        values: same shape and dtype as ``keys``.
        cache: ``[num_blocks, num_kv_heads, tile_bytes]`` uint8; record ``cache[block_ids[n], h]``
            is overwritten with the record of tile ``n``, head ``h``.
        block_ids: ``[N]`` int32/int64 destination blocks (the slot mapping, one entry per tile).
        scheme: a scheme without per-layer overrides.
        check_finite: refuse inf/NaN like the reference codec (costs a device sync).
        config: launch options; default ``configs.store_configs(...)[0]``.
    """
    if keys.dim() != 4:
        raise KernelArgumentError(
            f"keys must be [tiles, kv_heads, {scheme.group_size}, head_dim], got {list(keys.shape)}"
        )
    n, h, t, d = keys.shape
    _check_scheme(scheme, d)
    dev = keys.device
    check_tensor("keys", keys, (n, h, scheme.group_size, d), FLOAT_DTYPES, dev)
    check_tensor("values", values, (n, h, t, d), (keys.dtype,), dev)
    check_tensor("block_ids", block_ids, (n,), INDEX_DTYPES, dev)
    _check_cache(cache, scheme, h, d, dev)
    if n == 0:
        return
    if check_finite and not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
        raise ValueError("keys or values contain inf or NaN; the codec refuses to store a poisoned tile")
    lay = layout(scheme, d)
    cfg = config or store_configs(scheme, d)[0]
    rot = rotation(scheme.rotation, d, dev)
    lut = log8_table(dev)
    block_ids = block_ids.contiguous()
    sides = (
        (keys, lay.key_codes, lay.key_scale, lay.key_offset, lay.key_factor, scheme.key_bits, True),
        (values, lay.value_codes, lay.value_scale, lay.value_offset, lay.value_factor, scheme.value_bits, False),
    )
    for x, code_off, s_off, o_off, f_off, bits, per_channel in sides:
        store_side_kernel[(n * h,)](
            x,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            rot,
            lut,
            cache,
            cache.stride(0),
            cache.stride(1),
            block_ids,
            h,
            CODE_OFF=code_off,
            SCALE_OFF=s_off,
            OFFSET_OFF=o_off,
            FACTOR_OFF=f_off,
            BITS=bits,
            PER_CHANNEL=per_channel,
            T=t,
            D=d,
            ITERS=scheme.norm_iters,
            LOG8=scheme.scale_dtype == "log8",
            ROTATE=scheme.rotation != "none",
            enable_fp_fusion=False,  # the reference rounds every multiply and add separately
            **cfg.launch_kwargs(),
        )


def quantize_tiles_triton(keys: torch.Tensor, values: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The store kernel with the reference codec's API: ``[N, T, D]`` keys/values -> ``[N, tile_bytes]`` uint8."""
    if keys.dim() != 3:
        raise KernelArgumentError(f"keys must be [tiles, {scheme.group_size}, head_dim], got {list(keys.shape)}")
    n, _, d = keys.shape
    _check_scheme(scheme, d)
    records = torch.empty(n, 1, scheme.tile_bytes(d), dtype=torch.uint8, device=keys.device)
    ids = torch.arange(n, dtype=torch.int32, device=keys.device)
    store_tiles(keys.unsqueeze(1), values.unsqueeze(1), records, ids, scheme)
    return records.squeeze(1)


def _unused() -> None:  # placeholder removed when decode lands
    _ = math
