"""The pure-PyTorch reference codec: rotation, normalization, round-to-nearest, packing."""

from kvarn.codec.normalize import sinkhorn_iterates, std_spread
from kvarn.codec.pack import pack_codes, planes, unpack_codes
from kvarn.codec.rotation import rotate, rotation_matrix, unrotate
from kvarn.codec.tiles import (
    DecodedTiles,
    Layout,
    decode_records,
    dequantize_tiles,
    encode_tiles,
    layout,
    quantize_tiles,
)

__all__ = [
    "DecodedTiles",
    "Layout",
    "decode_records",
    "dequantize_tiles",
    "encode_tiles",
    "layout",
    "pack_codes",
    "planes",
    "quantize_tiles",
    "rotate",
    "rotation_matrix",
    "sinkhorn_iterates",
    "std_spread",
    "unpack_codes",
    "unrotate",
]
