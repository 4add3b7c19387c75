"""Launchers: check arguments, allocate outputs, choose the grid, call the Triton kernels.

Paged cache layout (one layer)::

    cache        [num_blocks, num_kv_heads, tile_bytes] uint8   one packed record per (block, KV head),
                                                                 record layout: kvarn.codec.tiles.layout
    block_table  [batch, max_blocks] int32    block ids of each sequence's full tiles, in token order
    num_tiles    [batch] int32                how many entries of block_table are full (quantized) tiles
    tail_k/v     [batch, num_kv_heads, group_size, head_dim] fp16/bf16/fp32, unrotated: the tile
                                              being filled; tail_lens [batch] int32 valid tokens
    sink_k/v     same shape as tail, unrotated, exact first tokens of the sequence in rows
                                              0..sink_lens[b]-1; sink_lens [batch] int32. Required
                                              when scheme.sink_len > 0, meaning one of:

* ``scheme.sink_tile``: the sink is the whole first tile, kept instead of a packed one. A
  sequence's context is, in token order: ``sink_lens`` sink tokens, ``num_tiles`` packed tiles,
  ``tail_lens`` tail tokens.
* ``scheme.sink_tokens = S``: every tile is packed as without a sink (tile 0 included); the context
  is ``num_tiles`` packed tiles then the tail, and readers take positions ``0..sink_lens[b]-1`` of
  the first packed tile (``block_table[b, 0]``) from the exact copies instead of dequantizing them.
  The effective sink length is ``min(sink_lens[b], S)`` when ``num_tiles[b] > 0`` and 0 otherwise:
  larger values are clamped (no device sync), and before tile 0 is full its tokens are in the
  tail, so the copies are ignored rather than attended twice.

:func:`split_lengths` turns context lengths into those counts. Queries and outputs are unrotated;
kernels rotate the query and un-rotate the output when the scheme rotates. The staging tensors
(tail, sink) may be any strided views whose last axis is contiguous.
"""

from __future__ import annotations

import math

import torch
import triton

from kvarn.codec.tiles import layout
from kvarn.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, KernelArgumentError, check_tensor, log8_table, rotation
from kvarn.kernels._decode import decode_kernel, split_reduce_kernel
from kvarn.kernels._prefill import dequant_tiles_kernel, prefill_kernel
from kvarn.kernels._store import store_side_kernel
from kvarn.kernels.configs import KernelConfig, decode_configs, dequant_configs, prefill_configs, store_configs
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
            LIBDEVICE=dev.type == "cuda",
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


# split-K heuristic: below ~2 programs per SM the GPU idles, so split long contexts until it is
# full, never into pieces of fewer than MIN_TILES_PER_SPLIT tiles (the partials cost a reduction)
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
_NOMINAL_SMS = 132  # an H100 SXM; used when no CUDA device is present (interpreter)


def split_lengths(seq_lens: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Context lengths ``[B]`` -> ``(num_tiles, tail_lens, sink_lens)`` ``[B]`` int32 for this layout.

    With ``scheme.sink_tile`` the first ``group_size`` tokens are sink tokens and every full tile
    after them is packed. With ``scheme.sink_tokens = S`` every full tile is packed and
    ``sink_lens`` is ``min(len, S)`` once the first tile is packed, else 0 (the tokens are still in
    the tail). Otherwise ``sink_lens`` is None. The rest is the tail.

    Example:
        >>> lens = torch.tensor([1, 40, 64])
        >>> [x.tolist() for x in split_lengths(lens, Scheme.from_name("kvarn_k4v2_g32_sink2"))]
        [[0, 1, 2], [1, 8, 0], [0, 2, 2]]
    """
    lens = seq_lens.to(torch.int32)
    t = scheme.group_size
    sink = torch.clamp(lens, max=t) if scheme.sink_tile else None
    rest = lens - sink if sink is not None else lens
    tiles = torch.div(rest, t, rounding_mode="floor")
    if scheme.sink_tokens:
        sink = torch.where(tiles > 0, torch.clamp(lens, max=scheme.sink_tokens), 0)
    return tiles.to(torch.int32), (rest - tiles * t).to(torch.int32), None if sink is None else sink.to(torch.int32)


def choose_num_splits(batch: int, num_kv_heads: int, max_tiles: int, device: torch.device) -> int:
    """Split-K factor for decode: 1 when batch x KV heads already fills the GPU or contexts are short."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _NOMINAL_SMS
    programs = batch * num_kv_heads
    if programs >= sms or max_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_lens: torch.Tensor,
    scheme: Scheme,
    *,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_lens: torch.Tensor | None = None,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged, packed context.

    Args:
        query: ``[B, num_q_heads, D]`` fp16/bf16/fp32, unrotated; query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)``.
        cache: ``[num_blocks, num_kv_heads, tile_bytes]`` uint8.
        block_table: ``[B, max_blocks]`` int32; the first ``num_tiles[b]`` entries are read.
        num_tiles: ``[B]`` int32 full tiles per sequence.
        tail_k, tail_v: ``[B, num_kv_heads, group_size, D]`` fp16/bf16/fp32, unrotated, last axis
            contiguous, same strides; ``tail_lens`` ``[B]`` int32 valid tokens (0..group_size).
        scheme: a scheme without per-layer overrides.
        sink_k, sink_v, sink_lens: exact first tokens, shaped like the tail; required when
            ``scheme.sink_len > 0``. The sink tile (``scheme.sink_tile``), attended before the
            packed tiles; or copies of the first ``scheme.sink_tokens`` tokens, used instead of
            positions ``< min(sink_lens[b], sink_tokens)`` of tile ``block_table[b, 0]`` and
            ignored while ``num_tiles[b] == 0`` (see the module docstring).
        sm_scale: softmax scale, default ``1/sqrt(D)``.
        num_splits: split-K factor; default :func:`choose_num_splits` (1 = no split).
        out: optional ``[B, num_q_heads, D]`` output buffer.
        config: launch options; default ``configs.decode_configs(...)[0]``.

    Returns:
        ``[B, num_q_heads, D]`` in ``query``'s dtype (``out`` when given). A sequence with no
        token at all gets zeros.
    """
    if query.dim() != 3:
        raise KernelArgumentError(f"query must be [batch, num_q_heads, head_dim], got {list(query.shape)}")
    bsz, hq, d = query.shape
    _check_scheme(scheme, d)
    dev, t = query.device, scheme.group_size
    check_tensor("query", query, (bsz, hq, d), FLOAT_DTYPES, dev)
    if cache.dim() != 3:
        raise KernelArgumentError(f"cache must be [num_blocks, num_kv_heads, tile_bytes], got {list(cache.shape)}")
    hkv = cache.shape[1]
    if hq % hkv:
        raise KernelArgumentError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    _check_cache(cache, scheme, hkv, d, dev)
    check_tensor("block_table", block_table, (bsz, None), (torch.int32,), dev)
    check_tensor("num_tiles", num_tiles, (bsz,), (torch.int32,), dev)
    _check_staging("tail", tail_k, tail_v, tail_lens, bsz, hkv, t, d, dev)
    _check_sink(scheme, sink_k, sink_v, sink_lens, bsz, hkv, d, dev)
    if sink_k is not None and sink_v is not None and sink_lens is not None:
        sk, sv, sl = sink_k, sink_v, sink_lens
    else:  # the kernel ignores these (HAS_SINK=False); any valid pointers do
        sk, sv, sl = tail_k, tail_v, tail_lens
    has_sink = sink_k is not None
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_tensor("out", out, (bsz, hq, d), FLOAT_DTYPES, dev)
    splits = num_splits if num_splits is not None else choose_num_splits(bsz, hkv, block_table.shape[1], dev)
    if not 1 <= splits <= 1024:
        raise KernelArgumentError(f"num_splits={splits} must be in 1..1024")
    if bsz == 0:
        return out
    group = hq // hkv
    lay = layout(scheme, d)
    cfg = config or decode_configs(scheme, d, group)[0]
    if splits > 1:
        part = torch.empty(bsz * hq, splits, d, dtype=torch.float32, device=dev)
        ml = torch.empty(bsz * hq, splits, 2, dtype=torch.float32, device=dev)
        dst, sob, soh = part, 0, 0
    else:
        part = ml = out  # ml unused without splits
        dst, sob, soh = out, out.stride(0), out.stride(1)
    decode_kernel[(bsz, hkv, splits)](
        query, query.stride(0), query.stride(1),
        cache, cache.stride(0), cache.stride(1),
        block_table, block_table.stride(0), num_tiles,
        tail_k, tail_v, tail_k.stride(0), tail_k.stride(1), tail_k.stride(2), tail_lens,
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), sl,
        rotation(scheme.rotation, d, dev), log8_table(dev),
        dst, ml, sob, soh,
        (sm_scale if sm_scale is not None else d**-0.5) * math.log2(math.e),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), S=splits,
        KB=scheme.key_bits, VB=scheme.value_bits, T=t, D=d,
        LOG8=scheme.scale_dtype == "log8", ROTATE=scheme.rotation != "none", HAS_SINK=has_sink,
        SINK_TOKENS=scheme.sink_tokens,
        KC=lay.key_codes, VC=lay.value_codes, KS=lay.key_scale, KO=lay.key_offset, KF=lay.key_factor,
        VS=lay.value_scale, VO=lay.value_offset, VF=lay.value_factor,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    if splits > 1:
        split_reduce_kernel[(bsz * hq,)](
            part, ml, out, out.stride(0), out.stride(1), hq,
            S=splits, BLOCK_S=triton.next_power_of_2(splits), D=d,
        )  # fmt: skip
    return out


def _check_sink(
    scheme: Scheme,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    sink_lens: torch.Tensor | None,
    bsz: int,
    hkv: int,
    d: int,
    dev: torch.device,
) -> None:
    """The sink arguments: required by a scheme with a sink, all three or none, staging-shaped."""
    if sink_k is None and scheme.sink_len:
        kept = "a sink tile" if scheme.sink_tile else f"its first {scheme.sink_tokens} tokens exactly"
        raise KernelArgumentError(f"scheme {scheme.name} keeps {kept}: pass sink_k, sink_v and sink_lens")
    if (sink_k is None) != (sink_v is None) or (sink_k is None) != (sink_lens is None):
        raise KernelArgumentError("sink_k, sink_v and sink_lens go together")
    if sink_k is not None and sink_v is not None and sink_lens is not None:
        _check_staging("sink", sink_k, sink_v, sink_lens, bsz, hkv, scheme.group_size, d, dev)


def _check_staging(
    name: str,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    bsz: int,
    hkv: int,
    t: int,
    d: int,
    dev: torch.device,
) -> None:
    check_tensor(f"{name}_k", k, (bsz, hkv, t, d), FLOAT_DTYPES, dev)
    check_tensor(f"{name}_v", v, (bsz, hkv, t, d), (k.dtype,), dev)
    check_tensor(f"{name}_lens", lens, (bsz,), (torch.int32,), dev)
    if k.stride() != v.stride():
        raise KernelArgumentError(
            f"{name}_k and {name}_v must have the same strides, got {k.stride()} and {v.stride()}"
        )


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_lens: torch.Tensor,
    scheme: Scheme,
    *,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_lens: torch.Tensor | None = None,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens (prefill or a prefill chunk) over cached context plus themselves.

    The cached context of sequence ``b`` is described exactly as for :func:`decode_attention`
    (sink, ``num_tiles[b]`` packed tiles, ``tail_lens[b]`` tail tokens; all zero for a first
    chunk); the new tokens follow it. Packed tiles are dequantized into a workspace of
    ``query.dtype`` (``[B, Hkv, L, D]``, ``L`` the longest context): correct first, not fused.
    In-tile sink copies (``scheme.sink_tokens``) then overwrite tile 0's first positions there.

    Args:
        query: ``[total_q, num_q_heads, D]`` new tokens of all sequences, packed by sequence.
        key, value: ``[total_q, num_kv_heads, D]`` their keys and values (unrotated).
        cu_seqlens_q: ``[B + 1]`` int32 start offsets of each sequence's tokens in ``query``.
        cache, block_table, num_tiles, tail_k, tail_v, tail_lens, scheme, sink_k, sink_v,
            sink_lens, sm_scale: as in :func:`decode_attention`.
        out: optional ``[total_q, num_q_heads, D]`` output.
        config: launch options of the attention kernel (``configs.prefill_configs``).

    Returns:
        ``[total_q, num_q_heads, D]`` in ``query``'s dtype.
    """
    if query.dim() != 3 or key.dim() != 3:
        raise KernelArgumentError(
            f"query and key must be [tokens, heads, head_dim], got {list(query.shape)}, {list(key.shape)}"
        )
    total, hq, d = query.shape
    _check_scheme(scheme, d)
    dev, t, hkv = query.device, scheme.group_size, key.shape[1]
    if hq % hkv:
        raise KernelArgumentError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    check_tensor("query", query, (total, hq, d), FLOAT_DTYPES, dev)
    check_tensor("key", key, (total, hkv, d), FLOAT_DTYPES, dev)
    check_tensor("value", value, (total, hkv, d), (key.dtype,), dev)
    check_tensor("cu_seqlens_q", cu_seqlens_q, (None,), (torch.int32,), dev)
    bsz = cu_seqlens_q.shape[0] - 1
    if bsz < 0:
        raise KernelArgumentError("cu_seqlens_q must hold at least one entry (0)")
    _check_cache(cache, scheme, hkv, d, dev)
    check_tensor("block_table", block_table, (bsz, None), (torch.int32,), dev)
    check_tensor("num_tiles", num_tiles, (bsz,), (torch.int32,), dev)
    _check_staging("tail", tail_k, tail_v, tail_lens, bsz, hkv, t, d, dev)
    _check_sink(scheme, sink_k, sink_v, sink_lens, bsz, hkv, d, dev)
    if out is None:
        out = torch.empty(total, hq, d, dtype=query.dtype, device=dev)
    check_tensor("out", out, (total, hq, d), FLOAT_DTYPES, dev)
    if bsz == 0 or total == 0:
        return out
    # host-side lengths: prefill is not captured in CUDA graphs, and the workspace needs them
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    sinks = sink_lens.tolist() if sink_lens is not None else [0] * bsz
    tiles, tails = num_tiles.tolist(), tail_lens.tolist()
    if scheme.sink_tokens:  # copies inside tile 0 (clamped, none before it is packed); no tokens ahead of it
        copies = [min(max(s, 0), scheme.sink_tokens) if n else 0 for s, n in zip(sinks, tiles, strict=True)]
        ahead = [0] * bsz
    else:  # a sink tile (or none) sits ahead of the packed tiles
        copies = ahead = sinks
    cached = [s + n * t + r for s, n, r in zip(ahead, tiles, tails, strict=True)]
    ctx = [c + n for c, n in zip(cached, q_lens, strict=True)]
    ws_k = torch.zeros(bsz, hkv, max(max(ctx), 1), d, dtype=query.dtype, device=dev)
    ws_v = torch.zeros_like(ws_k)
    starts = cu_seqlens_q.tolist()
    for b in range(bsz):  # unquantized pieces after the packed tiles: tail, new tokens
        p0 = ahead[b] + tiles[b] * t
        ws_k[b, :, p0 : cached[b]] = tail_k[b, :, : tails[b]]
        ws_v[b, :, p0 : cached[b]] = tail_v[b, :, : tails[b]]
        ws_k[b, :, cached[b] : ctx[b]] = key[starts[b] : starts[b + 1]].transpose(0, 1)
        ws_v[b, :, cached[b] : ctx[b]] = value[starts[b] : starts[b + 1]].transpose(0, 1)
    max_tiles = max(tiles)
    if max_tiles:
        lay = layout(scheme, d)
        first = torch.tensor(ahead, dtype=torch.int32, device=dev)
        dequant_tiles_kernel[(bsz, max_tiles, hkv)](
            cache, cache.stride(0), cache.stride(1), block_table, block_table.stride(0), num_tiles, first,
            rotation(scheme.rotation, d, dev), log8_table(dev),
            ws_k, ws_v, ws_k.stride(0), ws_k.stride(1), ws_k.stride(2),
            KB=scheme.key_bits, VB=scheme.value_bits, T=t, D=d,
            LOG8=scheme.scale_dtype == "log8", ROTATE=scheme.rotation != "none",
            KC=lay.key_codes, VC=lay.value_codes, KS=lay.key_scale, KO=lay.key_offset, KF=lay.key_factor,
            VS=lay.value_scale, VO=lay.value_offset, VF=lay.value_factor,
            **dequant_configs(scheme, d)[0].launch_kwargs(),
        )  # fmt: skip
    # sink rows, after dequantization (same stream): the sink tile ahead of the tiles, or exact copies
    # over tile 0's first tokens
    for b, s0 in enumerate(copies):
        if s0 and sink_k is not None and sink_v is not None:
            ws_k[b, :, :s0], ws_v[b, :, :s0] = sink_k[b, :, :s0], sink_v[b, :, :s0]
    cfg = config or prefill_configs(d)[0]
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=dev)
    prefill_kernel[(triton.cdiv(max(q_lens), cfg.block_m), bsz, hq)](
        query, query.stride(0), query.stride(1), cu_seqlens_q, ctx_t,
        ws_k, ws_v, ws_k.stride(0), ws_k.stride(1), ws_k.stride(2),
        out, out.stride(0), out.stride(1),
        (sm_scale if sm_scale is not None else d**-0.5) * math.log2(math.e),
        G=hq // hkv, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **cfg.launch_kwargs(),
    )  # fmt: skip
    return out
