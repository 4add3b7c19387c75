"""The torch path: decode attention over packed tiles in vectorized PyTorch, the portable CPU path
behind :mod:`kvarn.kernels.cpu.ops` (``impl="torch"``; taken where the native kernel does not build
or does not take the tensors).

Decode attends the records directly, batched over requests, KV heads and tiles, the way the GPU
kernel does: with ``kq, vq`` the codes of a tile in the rotated domain,
``score = kf * ((q_r * ks) @ kq^T + q_r @ ko)`` and ``out_r += vf * ((p * vs) @ vq + p @ vo)``;
the exact rows (sink copies or sink tile, tail) are attended with the unrotated query and the
rotated accumulator is un-rotated once at the end. Only the tiles that are read are unpacked (codes
as float32, parameters decoded by the reference :func:`~kvarn.codec.tiles.decode_records`).

Prefill is :mod:`kvarn.kernels.cpu.prefill`. Decode reads the lengths on the host (``.max()``),
which on CPU is no device synchronisation.
"""

from __future__ import annotations

import torch

from kvarn.codec.rotation import rotation_matrix
from kvarn.codec.tiles import decode_records
from kvarn.kernels.api import PagedContext


def exact_rows(p: PagedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unquantized rows each sequence attends: sink rows then tail rows, unrotated float32.

    Returns ``(k [B, H, R, D], v [B, H, R, D], valid [B, R] bool)``; ``R = S + T`` (sink capacity
    plus group size). Sink rows count only up to :meth:`PagedContext.sink_count`; rows that do not
    count are zeros, whatever their slot holds.
    """
    bsz = p.num_tiles.shape[0]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    valid: list[torch.Tensor] = []
    for rows_k, rows_v, slot, count in (
        (p.sink_k, p.sink_v, p.sink_slot, p.sink_count()),
        (p.tail_k, p.tail_v, p.tail_slot, p.tail_lens),
    ):
        if rows_k is None or rows_v is None or count is None:
            continue
        idx = slot.long() if slot is not None else torch.arange(bsz)
        ok = torch.arange(rows_k.shape[2])[None, :] < count.long()[:, None]  # [B, rows]
        keep = ok[:, None, :, None]  # rows past the count may hold any bytes, NaN included
        ks.append(rows_k.index_select(0, idx).float().where(keep, 0.0))
        vs.append(rows_v.index_select(0, idx).float().where(keep, 0.0))
        valid.append(ok)
    return torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(valid, 1)


def _read_tiles(p: PagedContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Records of the tiles read, ``[B, n, H, tile_bytes]`` uint8 (n = longest), and ``[B, n]`` bool."""
    block_table, num_tiles = p.block_table, p.num_tiles
    n = int(num_tiles.max()) if num_tiles.numel() else 0
    ok = torch.arange(n)[None, :] < num_tiles.long()[:, None]
    ids = torch.where(ok, block_table[:, :n].long(), 0)
    return p.cache[ids], ok


def decode(p: PagedContext, query: torch.Tensor) -> torch.Tensor:
    """Decode attention, ``query`` ``[B, Hq, D]`` -> ``[B, Hq, D]`` float32 (see :func:`kvarn.kernels.cpu.ops.decode_attention`)."""
    bsz, hq, d = query.shape
    h = p.cache.shape[1]
    g, t = hq // h, p.scheme.group_size
    q = query.float().reshape(bsz, h, g, d) * p.sm_scale(d)  # query may be a strided view (vLLM qkv)
    ek, ev, ok_rows = exact_rows(p)
    s_rows = (q @ ek.transpose(-1, -2)).masked_fill(~ok_rows[:, None, None, :], float("-inf"))  # [B, H, G, R]
    rec, ok_tiles = _read_tiles(p)
    n = rec.shape[1]
    if n:
        dec = decode_records(rec.reshape(-1, rec.shape[-1]), p.scheme, d)

        def per_tile(x: torch.Tensor) -> torch.Tensor:  # [B*n*H, X] -> [B, n, H, 1, X] to broadcast over G
            return x.view(bsz, n, h, 1, -1)

        rot = rotation_matrix(p.scheme.rotation, d)
        qr = (q @ rot)[:, None]  # [B, 1, H, G, D]
        kq = dec.key_codes.float().view(bsz, n, h, t, d)
        s = (qr * per_tile(dec.key_scale)) @ kq.transpose(-1, -2)  # [B, n, H, G, T]
        s = (s + (qr * per_tile(dec.key_offset)).sum(-1, keepdim=True)) * per_tile(dec.key_factor)
        masked = ~ok_tiles[:, :, None, None, None].expand(bsz, n, 1, 1, t)
        if p.scheme.sink_tokens:  # tile 0's first tokens are attended from their exact copies
            first = (torch.arange(n)[:, None] == 0) & (torch.arange(t)[None, :] < p.sink_count()[:, None, None])
            masked = masked | first[:, :, None, None, :]
        s = s.masked_fill(masked, float("-inf"))
        s_all = torch.cat([s.permute(0, 2, 3, 1, 4).reshape(bsz, h, g, n * t), s_rows], -1)
    else:
        s_all = s_rows
    m = s_all.amax(-1, keepdim=True)
    e = torch.exp(s_all - torch.where(m == float("-inf"), 0.0, m))
    e = e / e.sum(-1, keepdim=True).clamp_min(1e-30)  # a sequence with no token gets zeros
    out = e[..., n * t :] @ ev  # [B, H, G, D]
    if n:
        pt = e[..., : n * t].reshape(bsz, h, g, n, t).permute(0, 3, 1, 2, 4)  # [B, n, H, G, T]
        vq = dec.value_codes.float().view(bsz, n, h, t, d)
        o = (pt * per_tile(dec.value_scale)) @ vq + (pt * per_tile(dec.value_offset)).sum(-1, keepdim=True)
        o = (o * per_tile(dec.value_factor)).masked_fill(~ok_tiles[:, :, None, None, None], 0.0)
        o_rot = o.sum(1)  # [B, H, G, D]; unread tiles may hold any bytes, inf and NaN included
        out = out + o_rot @ rot.T
    return out.reshape(bsz, hq, d)
