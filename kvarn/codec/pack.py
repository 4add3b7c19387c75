"""Bit packing of integer codes into bytes: the layout of the code sections of a tile record.

A ``b``-bit code is split into power-of-two *planes*, widest first: 8 -> [8], 4 -> [4],
3 -> [2, 1] (low 2 bits, then the high bit), 2 -> [2]. Each plane is packed along the last
(channel) axis: byte ``i`` of a ``w``-bit plane holds channels ``i*(8/w) .. i*(8/w)+8/w-1``,
channel ``j`` of the group at bits ``j*w .. j*w+w-1`` (little-endian). Planes follow each other.
This keeps every plane a power-of-two width, so a kernel unpacks with a shift and a mask.
"""

from __future__ import annotations

import torch

_PLANES: dict[int, tuple[int, ...]] = {2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}


def planes(bits: int) -> tuple[int, ...]:
    """Plane widths of a ``bits``-bit code, low bits first."""
    try:
        return _PLANES[bits]
    except KeyError:
        raise ValueError(f"bits={bits} is not packable; allowed: {', '.join(map(str, _PLANES))}") from None


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[N, T, D]`` uint8 codes (each < 2**bits) into ``[N, T*D*bits/8]`` uint8."""
    n, t, d = codes.shape
    out = []
    shift = 0
    for w in planes(bits):
        per = 8 // w
        plane = ((codes.to(torch.int32) >> shift) & ((1 << w) - 1)).reshape(n, t, d // per, per)
        weights = torch.tensor([1 << (j * w) for j in range(per)], dtype=torch.int32, device=codes.device)
        out.append((plane * weights).sum(-1).to(torch.uint8).reshape(n, -1))
        shift += w
    return torch.cat(out, dim=1)


def unpack_codes(packed: torch.Tensor, bits: int, tokens: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[N, T*D*bits/8]`` uint8 -> ``[N, T, D]`` uint8."""
    n = packed.shape[0]
    if len(planes(bits)) == 1:  # one plane (2, 4, 8 bits): shift and mask in uint8
        per = 8 // bits
        if per == 1:
            return packed[:, : tokens * head_dim].reshape(n, tokens, head_dim).clone()
        shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
        plane = packed[:, : tokens * head_dim // per].reshape(n, -1, 1)
        return ((plane >> shifts) & ((1 << bits) - 1)).reshape(n, tokens, head_dim)
    codes = torch.zeros(n, tokens, head_dim, dtype=torch.int32, device=packed.device)
    offset = 0
    shift = 0
    for w in planes(bits):
        per = 8 // w
        size = tokens * head_dim // per
        plane = packed[:, offset : offset + size].to(torch.int32).reshape(n, tokens, head_dim // per, 1)
        shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * w
        vals = (plane >> shifts) & ((1 << w) - 1)
        codes |= vals.reshape(n, tokens, head_dim) << shift
        offset += size
        shift += w
    return codes.to(torch.uint8)
