"""The reference codec for MLA (DeepSeek-style latent attention) tiles. Pure PyTorch.

An MLA layer caches one row per token: the compressed latent ``c`` (``kv_lora_rank``, 512 in
DeepSeek V2/V3) that serves as both key (scored against the query absorbed into latent space)
and value, and the RoPE key part ``k_pe`` (64). As KVarN does, the latent is quantized and the
RoPE part kept 16-bit. The latent is cut into chunks of :data:`LATENT_CHUNK` channels, and each
chunk of a tile is encoded exactly as the key side of a standard tile (rotation within the chunk,
normalization, per-channel asymmetric round-to-nearest at ``scheme.key_bits``, the best normalization
iterate kept); ``scheme.value_bits`` does not apply (there are no separate values).

Record of one tile (``T = group_size`` tokens, ``C = kv_lora_rank / LATENT_CHUNK`` chunks,
``R`` RoPE dims), every section contiguous::

    latent codes   C*T*128*kb/8 bytes   chunk-major, each [T, 128] packed as key codes (codec.pack)
    latent params  scale[C*128], offset[C*128], factor[C*T]   (float16, or one byte with log8)
    rope           T*R 16-bit (the model's bfloat16, else float16), token-major
"""

from __future__ import annotations

import torch

from kvarn.codec.pack import pack_codes, unpack_codes
from kvarn.codec.params import load_offset, load_positive, read_params, stored_dtypes
from kvarn.codec.rotation import rotate, unrotate
from kvarn.codec.tiles import _as_bytes, _check_tiles, _encode_side
from kvarn.schemes.scheme import Scheme

LATENT_CHUNK = 128  # latent channels per encoded chunk (one rotation block)


def rope_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit type RoPE dims are stored in: the model's bfloat16, else float16."""
    return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float16


def _chunks(latent_dim: int) -> int:
    if latent_dim <= 0 or latent_dim % LATENT_CHUNK:
        raise ValueError(f"MLA latent width {latent_dim} must be a positive multiple of {LATENT_CHUNK}")
    return latent_dim // LATENT_CHUNK


def latent_tile_bytes(scheme: Scheme, latent_dim: int, rope_dim: int) -> int:
    """Bytes of one MLA tile record (see the module docstring)."""
    c, t, p = _chunks(latent_dim), scheme.group_size, scheme.param_bytes
    return c * (t * LATENT_CHUNK * scheme.key_bits // 8) + p * c * (2 * LATENT_CHUNK + t) + 2 * t * rope_dim


def quantize_latent(latent: torch.Tensor, rope: torch.Tensor, scheme: Scheme, rope_type: torch.dtype) -> torch.Tensor:
    """``[N, T, L]`` latent and ``[N, T, R]`` RoPE tiles -> ``[N, latent_tile_bytes]`` uint8 records."""
    _check_tiles(latent, scheme, "MLA latent")
    n, t, width = latent.shape
    c = _chunks(width)
    if rope.shape[:2] != (n, t):
        raise ValueError(f"MLA rope {list(rope.shape)} must be [{n}, {t}, rope_dim]")
    chunks = latent.reshape(n, t, c, LATENT_CHUNK).transpose(1, 2).reshape(n * c, t, LATENT_CHUNK)
    side = _encode_side(rotate(chunks, scheme.rotation), scheme.key_bits, True, scheme)
    record = torch.cat(
        [
            pack_codes(side.codes, scheme.key_bits).reshape(n, -1),
            *(_as_bytes(x.reshape(n, -1)) for x in (side.scale_raw, side.offset_raw, side.factor_raw)),
            _as_bytes(rope.to(rope_type).reshape(n, -1)),
        ],
        dim=1,
    )
    assert record.shape[1] == latent_tile_bytes(scheme, width, rope.shape[2])
    return record


def dequantize_latent(
    records: torch.Tensor, scheme: Scheme, latent_dim: int, rope_dim: int, rope_type: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_latent`: ``[N, bytes]`` uint8 -> ``[N, T, L + R]`` float32 rows."""
    total = latent_tile_bytes(scheme, latent_dim, rope_dim)
    if records.dim() != 2 or records.shape[1] != total or records.dtype != torch.uint8:
        raise ValueError(
            f"MLA records must be [tiles, {total}] uint8 for {scheme.name} at latent {latent_dim} + rope "
            f"{rope_dim}, got {list(records.shape)} {records.dtype}"
        )
    n, c, t, p = records.shape[0], _chunks(latent_dim), scheme.group_size, scheme.param_bytes
    code_bytes = t * LATENT_CHUNK * scheme.key_bits // 8
    at = c * code_bytes
    codes = unpack_codes(records[:, :at].reshape(n * c, code_bytes), scheme.key_bits, t, LATENT_CHUNK)
    raw, off = stored_dtypes(scheme.scale_dtype)

    def sect(count: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal at
        x = read_params(records, at, count, dtype).reshape(n * c, -1)
        at += count * p
        return x

    scale = load_positive(sect(c * LATENT_CHUNK, raw), scheme.scale_dtype)
    offset = load_offset(sect(c * LATENT_CHUNK, off), scale, scheme.scale_dtype)
    factor = load_positive(sect(c * t, raw), scheme.scale_dtype)
    x = (codes.float() * scale[:, None, :] + offset[:, None, :]) * factor[:, :, None]
    latent = unrotate(x, scheme.rotation).reshape(n, c, t, LATENT_CHUNK).transpose(1, 2).reshape(n, t, latent_dim)
    rope = records[:, at:].contiguous().view(rope_type).reshape(n, t, rope_dim).float()
    return torch.cat([latent, rope], dim=2)
