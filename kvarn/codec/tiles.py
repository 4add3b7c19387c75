"""The reference codec: quantize and dequantize whole tiles of keys and values. Pure PyTorch.

This is the oracle every kernel and integration is tested against. It is vectorized over tiles
(``N`` = any number of (block, KV head) pairs); loops run only over normalization iterates.

The packed record of one tile of one KV head (``T = group_size`` tokens, ``D = head_dim``), in
this order, every section contiguous (sizes from :class:`kvarn.schemes.Scheme`)::

    key codes     T*D*kb/8 bytes   [T, D] codes, bit planes packed along D (see codec.pack)
    value codes   T*D*vb/8 bytes   [T, D] codes, same packing
    key params    k_scale[D], k_offset[D], k_factor[T]    per channel scale/zero, per token factor
    value params  v_scale[T], v_offset[T], v_factor[D]    per token scale/zero, per channel factor

Each param is float16 (2 bytes, little-endian) or, with ``scale_dtype=log8``, one byte (scales and
factors: log codes; offsets: a signed zero point), see :mod:`kvarn.codec.params`. Decoding, in the
rotated domain: ``k[t, d] = (kq[t, d] * k_scale[d] + k_offset[d]) * k_factor[t]`` and
``v[t, d] = (vq[t, d] * v_scale[t] + v_offset[t]) * v_factor[d]``; then ``x = x_rot @ R^T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn.codec.normalize import sinkhorn_iterates
from kvarn.codec.pack import pack_codes, unpack_codes
from kvarn.codec.params import load_offset, load_positive, quantize_affine, read_params, store_positive, stored_dtypes
from kvarn.codec.rotation import rotate, unrotate
from kvarn.schemes.scheme import Scheme

_MIN_MAGNITUDE = 2.0**-14  # smallest normal fp16; an all-zero tile still gets finite factors


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the sections of one tile record. All offsets of fp16 sections are even."""

    key_codes: int
    value_codes: int
    key_scale: int
    key_offset: int
    key_factor: int
    value_scale: int
    value_offset: int
    value_factor: int
    total: int


def layout(scheme: Scheme, head_dim: int) -> Layout:
    """Section offsets of a record of ``scheme`` at ``head_dim``; ``total == scheme.tile_bytes(head_dim)``."""
    p, t, d = scheme.param_bytes, scheme.group_size, head_dim
    kc = 0
    vc = kc + scheme.key_code_bytes(d)
    ks = vc + scheme.value_code_bytes(d)
    ko = ks + p * d
    kf = ko + p * d
    vs = kf + p * t
    vo = vs + p * t
    vf = vo + p * t
    total = vf + p * d
    assert total == scheme.tile_bytes(d)
    return Layout(kc, vc, ks, ko, kf, vs, vo, vf, total)


@dataclass(frozen=True)
class EncodedSide:
    """Codes and stored params of keys or of values of N tiles (before serialization)."""

    codes: torch.Tensor  # [N, T, D] uint8
    scale_raw: torch.Tensor  # [N, D] (keys) or [N, T] (values): float16 or uint8
    offset_raw: torch.Tensor  # same shape: float16 or int8
    factor_raw: torch.Tensor  # [N, T] (keys) or [N, D] (values): float16 or uint8


def _check_tiles(x: torch.Tensor, scheme: Scheme, what: str) -> None:
    if x.dim() != 3 or x.shape[1] != scheme.group_size:
        raise ValueError(f"{what} must be [tiles, {scheme.group_size}, head_dim], got {list(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{what} dtype {x.dtype} is not supported; use float16, bfloat16 or float32")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contains inf or NaN; the codec refuses to store a poisoned tile")


def _encode_side(x: torch.Tensor, bits: int, per_channel: bool, scheme: Scheme) -> EncodedSide:
    """Quantize rotated tiles ``x`` ``[N, T, D]`` float32, keeping the best normalization iterate.

    Keys (``per_channel``) quantize each channel across tokens and keep a per-token factor; values
    quantize each token across channels and keep a per-channel factor. Every iterate, including
    iterate 0 (no normalization), is encoded; per tile the one with the least squared error wins,
    so more iterations never make a tile worse.
    """
    quant_dim = 1 if per_channel else 2
    # the factor carries the square root of the tile's magnitude and the scales the rest, so both
    # stay within fp16 range even for rotated values beyond it (a full fp16 row rotates to 8x 65504)
    base = torch.sqrt(x.abs().amax(dim=(1, 2), keepdim=True).clamp_min(_MIN_MAGNITUDE))
    best: EncodedSide | None = None
    best_err = torch.full((x.shape[0],), float("inf"), device=x.device)
    for log_r, log_c in sinkhorn_iterates(x, scheme.norm_iters):
        log_f = log_r if per_channel else log_c
        f_raw, f = store_positive(torch.exp(log_f) * base, scheme.scale_dtype, round_up=False)
        f = f.clamp_min(1e-30)
        codes, s_raw, o_raw, s, o = quantize_affine(x / f, bits, quant_dim, scheme.scale_dtype)
        err = ((codes.float() * s + o) * f - x).square().sum(dim=(1, 2))
        cand = EncodedSide(codes, s_raw.flatten(1), o_raw.flatten(1), f_raw.flatten(1))
        if best is None:
            best, best_err = cand, err
            continue
        better = err < best_err
        best = EncodedSide(
            *(
                torch.where(better.view(-1, *[1] * (a.dim() - 1)), a, b)
                for a, b in zip(
                    (cand.codes, cand.scale_raw, cand.offset_raw, cand.factor_raw),
                    (best.codes, best.scale_raw, best.offset_raw, best.factor_raw),
                    strict=True,
                )
            )
        )
        best_err = torch.minimum(err, best_err)
    assert best is not None
    return best


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def encode_tiles(keys: torch.Tensor, values: torch.Tensor, scheme: Scheme) -> tuple[EncodedSide, EncodedSide]:
    """Rotate and quantize ``[N, T, D]`` key and value tiles; returns the unserialized codes/params."""
    _check_tiles(keys, scheme, "keys")
    _check_tiles(values, scheme, "values")
    if keys.shape != values.shape:
        raise ValueError(f"keys {list(keys.shape)} and values {list(values.shape)} must have the same shape")
    k = _encode_side(rotate(keys, scheme.rotation), scheme.key_bits, True, scheme)
    v = _encode_side(rotate(values, scheme.rotation), scheme.value_bits, False, scheme)
    return k, v


def quantize_tiles(keys: torch.Tensor, values: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Quantize ``[N, T, D]`` keys and values (fp16/bf16/fp32) into ``[N, tile_bytes]`` uint8 records."""
    k, v = encode_tiles(keys, values, scheme)
    record = torch.cat(
        [
            pack_codes(k.codes, scheme.key_bits),
            pack_codes(v.codes, scheme.value_bits),
            *(_as_bytes(t) for t in (k.scale_raw, k.offset_raw, k.factor_raw)),
            *(_as_bytes(t) for t in (v.scale_raw, v.offset_raw, v.factor_raw)),
        ],
        dim=1,
    )
    assert record.shape[1] == scheme.tile_bytes(keys.shape[2])
    return record


@dataclass(frozen=True)
class DecodedTiles:
    """Everything a record holds, decoded to float32, in the rotated domain."""

    key_codes: torch.Tensor  # [N, T, D] uint8
    key_scale: torch.Tensor  # [N, D]
    key_offset: torch.Tensor  # [N, D]
    key_factor: torch.Tensor  # [N, T]
    value_codes: torch.Tensor  # [N, T, D] uint8
    value_scale: torch.Tensor  # [N, T]
    value_offset: torch.Tensor  # [N, T]
    value_factor: torch.Tensor  # [N, D]

    def keys(self) -> torch.Tensor:
        """Rotated keys ``[N, T, D]`` float32."""
        k = self.key_codes.float() * self.key_scale[:, None, :] + self.key_offset[:, None, :]
        return k * self.key_factor[:, :, None]

    def values(self) -> torch.Tensor:
        """Rotated values ``[N, T, D]`` float32."""
        v = self.value_codes.float() * self.value_scale[:, :, None] + self.value_offset[:, :, None]
        return v * self.value_factor[:, None, :]


def decode_records(records: torch.Tensor, scheme: Scheme, head_dim: int) -> DecodedTiles:
    """Parse ``[N, tile_bytes]`` uint8 records into codes and float32 params."""
    lay = layout(scheme, head_dim)
    if records.dim() != 2 or records.shape[1] != lay.total or records.dtype != torch.uint8:
        raise ValueError(
            f"records must be [tiles, {lay.total}] uint8 for {scheme.name} at head_dim {head_dim}, "
            f"got {list(records.shape)} {records.dtype}"
        )
    t, d = scheme.group_size, head_dim
    raw_dtype, off_dtype = stored_dtypes(scheme.scale_dtype)
    ks = load_positive(read_params(records, lay.key_scale, d, raw_dtype), scheme.scale_dtype)
    vs = load_positive(read_params(records, lay.value_scale, t, raw_dtype), scheme.scale_dtype)
    return DecodedTiles(
        key_codes=unpack_codes(records[:, lay.key_codes : lay.value_codes], scheme.key_bits, t, d),
        key_scale=ks,
        key_offset=load_offset(read_params(records, lay.key_offset, d, off_dtype), ks, scheme.scale_dtype),
        key_factor=load_positive(read_params(records, lay.key_factor, t, raw_dtype), scheme.scale_dtype),
        value_codes=unpack_codes(records[:, lay.value_codes : lay.key_scale], scheme.value_bits, t, d),
        value_scale=vs,
        value_offset=load_offset(read_params(records, lay.value_offset, t, off_dtype), vs, scheme.scale_dtype),
        value_factor=load_positive(read_params(records, lay.value_factor, d, raw_dtype), scheme.scale_dtype),
    )


def dequantize_tiles(
    records: torch.Tensor,
    scheme: Scheme,
    head_dim: int,
    *,
    rotated: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`quantize_tiles`: ``[N, tile_bytes]`` uint8 -> keys, values ``[N, T, D]``.

    With ``rotated=True`` the result stays in the rotated domain (rotate queries with
    :func:`kvarn.codec.rotate` and un-rotate the attention output instead).
    """
    dec = decode_records(records, scheme, head_dim)
    k, v = dec.keys(), dec.values()
    if not rotated:
        k, v = unrotate(k, scheme.rotation), unrotate(v, scheme.rotation)
    return k.to(dtype), v.to(dtype)
