"""Vectorized PyTorch attention over packed tiles: the portable CPU path behind :mod:`kvarn.kernels.cpu.ops`.

Decode attends the records directly, batched over requests, KV heads and tiles, the way the GPU
kernel does: with ``kq, vq`` the codes of a tile in the rotated domain,
``score = kf * ((q_r * ks) @ kq^T + q_r @ ko)`` and ``out_r += vf * ((p * vs) @ vq + p @ vo)``;
the exact rows (sink copies or sink tile, tail) are attended with the unrotated query and the
rotated accumulator is un-rotated once at the end. Only the tiles that are read are unpacked (codes
as float32, parameters decoded by the reference :func:`~kvarn.codec.tiles.decode_records`).

Prefill dequantizes the tiles it reads into a per-request workspace (as the Triton prefill does)
and runs one masked ``scaled_dot_product_attention`` for all requests, padded to the longest.
Both read the lengths on the host (``.max()``), which on CPU is no device synchronisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvarn.codec.rotation import rotation_matrix
from kvarn.codec.tiles import decode_records, dequantize_tiles
from kvarn.kernels.api import PagedContext

PREFILL_GROUPS = 4  # SDPA calls per prefill, sequences grouped by context length


def exact_rows(p: PagedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unquantized rows each sequence attends: sink rows then tail rows, unrotated float32.

    Returns ``(k [B, H, R, D], v [B, H, R, D], valid [B, R] bool)``; ``R = S + T`` (sink capacity
    plus group size). Sink rows count only up to :meth:`PagedContext.sink_count`.
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
        ks.append(rows_k.index_select(0, idx).float())
        vs.append(rows_v.index_select(0, idx).float())
        valid.append(torch.arange(rows_k.shape[2])[None, :] < count.long()[:, None])
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


def prefill(
    p: PagedContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor
) -> torch.Tensor:
    """Causal prefill attention -> ``[N, Hq, D]`` float32 (see :func:`kvarn.kernels.cpu.ops.prefill_attention`).

    Every key a request sees is gathered by index from one source table of rows ``[*, H, D]``
    (dequantized tiles, sink rows, tail rows, new keys, a zero row for padding), so there is no
    loop over requests.
    """
    total, hq, d = query.shape
    h, t = key.shape[1], p.scheme.group_size
    block_table, num_tiles = p.block_table, p.num_tiles
    bsz = cu_seqlens_q.shape[0] - 1
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    n = int(num_tiles.max())
    # segments of one request read the same tiles: dequantize each block once
    ids = torch.where(torch.arange(n)[None, :] < num_tiles.long()[:, None], block_table[:, :n].long(), 0)
    blocks, which = torch.unique(ids, return_inverse=True)  # which: [B, n] index into blocks
    ek, ev, _ = exact_rows(p)  # [B, H, R, D]; sink rows first (capacity S), then the tail
    r = ek.shape[2]
    s_cap = r - t
    sink = p.sink_count() if s_cap else torch.zeros(bsz, dtype=torch.long)
    ahead = sink if p.scheme.sink_tile else torch.zeros_like(sink)
    tiles_end = ahead + num_tiles.long() * t
    cached = tiles_end + p.tail_lens.long()
    ctx = cached + q_lens
    width = int(ctx.max())
    src_k = [ek.transpose(1, 2).reshape(bsz * r, h, d), key.float()]
    src_v = [ev.transpose(1, 2).reshape(bsz * r, h, d), value.float()]
    if n:
        u = blocks.shape[0]
        dk, dv = dequantize_tiles(p.cache[blocks].reshape(u * h, -1), p.scheme, d)  # [U*H, T, D]
        src_k.append(dk.view(u, h, t, d).transpose(1, 2).reshape(u * t, h, d))
        src_v.append(dv.view(u, h, t, d).transpose(1, 2).reshape(u * t, h, d))
    zero_row = torch.zeros(1, h, d)
    src_k.append(zero_row)
    src_v.append(zero_row)
    rows_base, new_base, tile_base = 0, bsz * r, bsz * r + total
    zero = sum(x.shape[0] for x in src_k) - 1
    b = torch.arange(bsz)[:, None]
    pos = torch.arange(width)[None, :]
    idx = torch.full((bsz, width), zero, dtype=torch.long)
    in_tiles = (pos >= ahead[:, None]) & (pos < tiles_end[:, None])
    j = (pos - ahead[:, None]).clamp_min(0)
    tile = which.gather(1, (j // t).clamp(max=max(n - 1, 0))) if n else torch.zeros_like(j)
    idx = torch.where(in_tiles, tile_base + tile * t + j % t, idx)
    idx = torch.where(pos < sink[:, None], rows_base + b * r + pos, idx)  # sink tile, or copies over tile 0
    in_tail = (pos >= tiles_end[:, None]) & (pos < cached[:, None])
    idx = torch.where(in_tail, rows_base + b * r + s_cap + (pos - tiles_end[:, None]), idx)
    in_new = (pos >= cached[:, None]) & (pos < ctx[:, None])
    idx = torch.where(in_new, new_base + cu[:-1, None] + (pos - cached[:, None]), idx)
    all_k, all_v, q_all = torch.cat(src_k), torch.cat(src_v), query.float()
    out = torch.empty(total, hq, d)
    # sequences padded to the longest of their group: vLLM's segments of one chunk range from no
    # context to all of it, so a few groups of similar lengths halve the padded work
    order = torch.argsort(ctx)
    for grp in order.tensor_split(min(PREFILL_GROUPS, bsz)):
        w = int(ctx[grp].max())
        k_ws = all_k[idx[grp, :w]].transpose(1, 2)  # [b, H, w, D]
        v_ws = all_v[idx[grp, :w]].transpose(1, 2)
        lq = int(q_lens[grp].max())
        if lq == 0:
            continue
        jq = torch.arange(lq)[None, :]
        q_ok = jq < q_lens[grp, None]  # [b, Lq]
        q_idx = torch.where(q_ok, cu[grp, None] + jq, 0)
        q_pad = q_all[q_idx].transpose(1, 2)  # [b, Hq, Lq, D]
        allowed = pos[:, None, :w] <= (cached[grp, None, None] + jq[:, :, None])  # [b, Lq, w], causal
        o = F.scaled_dot_product_attention(
            q_pad, k_ws, v_ws, attn_mask=allowed[:, None], scale=p.sm_scale(d), enable_gqa=hq != h
        )  # [b, Hq, Lq, D]
        out[q_idx[q_ok]] = o.transpose(1, 2)[q_ok]
    return out
