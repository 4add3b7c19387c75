"""The vectorized PyTorch path of the kvarn backend (CPU, and CUDA until kernels are wired).

One call per layer and step. Attention runs in the rotated domain: context tiles are decoded
with the reference codec (``dequantize_tiles(rotated=True)``, all tiles of the step in one call),
staged and new tokens are rotated, the query is rotated, and the output is un-rotated. Attention
reads the cache as it was before this step: full context tiles from their packed pages, the staged
part of a partial context tile from its staging slot, this step's own tokens unquantized (as a
prefill chunk has them). Afterwards this step's tokens are committed: every tile that became full is
quantized into its page (``quantize_tiles``, one call for the layer), the rest goes to staging.

Schemes with ``sink_tokens``: the first tokens of each sequence are also written, exactly, into its
sink slot (:mod:`kvarn.vllm.sinks`), and attention over a packed tile 0 uses those copies (rotated
like staged tokens) in place of the decoded positions ``0..sink_read-1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvarn.codec import dequantize_tiles, quantize_tiles, rotate, unrotate
from kvarn.schemes import Scheme
from kvarn.vllm.staging import RequestPlan


def _decode_context(
    cache: torch.Tensor, plans: list[RequestPlan], scheme: Scheme, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotated keys and values of every full context tile of the step: ``[M, H, T, D]`` float32 each."""
    ids = [b for p in plans for b in p.ctx_blocks]
    if not ids:
        return None
    nbytes = scheme.tile_bytes(head_dim)
    idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
    rec = cache[idx, :, 0, :nbytes]  # [M, H, tile_bytes] uint8
    m, h = rec.shape[0], rec.shape[1]
    k, v = dequantize_tiles(rec.reshape(m * h, nbytes), scheme, head_dim, rotated=True)
    t = scheme.group_size
    return k.view(m, h, t, head_dim), v.view(m, h, t, head_dim)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    plans: list[RequestPlan],
    scheme: Scheme,
    scale: float,
    output: torch.Tensor,
    *,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention of this step's queries over cached context plus their own tokens.

    Args:
        query: ``[N, Hq, D]`` new queries (model dtype); key, value: ``[N, H, D]`` new keys/values.
        cache: ``[num_blocks, H, 1, page_bytes]`` uint8, packed tile records of this layer.
        stage_k, stage_v: ``[num_slots, H, T, D]`` staged tokens of partial tiles (model dtype).
        plans: one :class:`RequestPlan` per request (from the metadata builder).
        scale: softmax scale.
        output: ``[N, Hq, D]``, written in place for the tokens of ``plans``.
        sink: ``([num_sink_slots, H, S, D], same)`` exact first tokens (model dtype, unrotated) of
            each sequence, for schemes with ``sink_tokens = S``; read where a plan's ``sink_read`` > 0.
    """
    rot, t = scheme.rotation, scheme.group_size
    n_kv, d = key.shape[1], key.shape[2]
    group = query.shape[1] // n_kv
    ctx = _decode_context(cache, plans, scheme, d)
    off = 0
    for p in plans:
        if p.q_len == 0:
            continue
        sl = slice(p.q_start, p.q_start + p.q_len)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        if p.ctx_blocks:
            assert ctx is not None
            n = len(p.ctx_blocks)
            if p.sink_read:  # tile 0's first tokens: the exact copies instead of their decoded values
                assert sink is not None, "a plan reads sink tokens but no sink slots were given"
                # in place: rows off.. of ctx are this request's own decoded tiles
                ctx[0][off, :, : p.sink_read] = rotate(sink[0][p.sink_slot, :, : p.sink_read], rot)
                ctx[1][off, :, : p.sink_read] = rotate(sink[1][p.sink_slot, :, : p.sink_read], rot)
            ks.append(ctx[0][off : off + n].permute(1, 0, 2, 3).reshape(n_kv, n * t, d))
            vs.append(ctx[1][off : off + n].permute(1, 0, 2, 3).reshape(n_kv, n * t, d))
            off += n
        if p.staged_read:
            ks.append(rotate(stage_k[p.read_slot, :, : p.staged_read], rot))
            vs.append(rotate(stage_v[p.read_slot, :, : p.staged_read], rot))
        ks.append(rotate(key[sl].transpose(0, 1), rot))
        vs.append(rotate(value[sl].transpose(0, 1), rot))
        k = torch.cat(ks, dim=1).repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = torch.cat(vs, dim=1).repeat_interleave(group, dim=0)
        q = rotate(query[sl].transpose(0, 1), rot)  # [Hq, n, D]
        n_ctx = k.shape[1] - p.q_len
        if p.q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        elif n_ctx == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = torch.ones(p.q_len, k.shape[1], dtype=torch.bool, device=q.device)
            mask[:, n_ctx:] = torch.ones(p.q_len, p.q_len, dtype=torch.bool, device=q.device).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        output[sl] = unrotate(o, rot).transpose(0, 1).to(output.dtype)


def stage_and_collect(
    key: torch.Tensor,
    value: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    plans: list[RequestPlan],
    group_size: int,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """Write each request's remainder into its staging slot; return the tiles that became full.

    With ``sink`` (``[num_sink_slots, H, S, D]`` keys and values), also copy each plan's
    ``sink_write`` first tokens into its sink slot.

    Returns:
        ``([F, H, T, D], [F, H, T, D], block ids [F])`` unrotated keys/values of full tiles, or None.
    """
    t = group_size
    tiles_k: list[torch.Tensor] = []
    tiles_v: list[torch.Tensor] = []
    blocks: list[int] = []
    for p in plans:
        if p.dummy or p.q_len == 0:
            continue
        sl = slice(p.q_start, p.q_start + p.q_len)
        tk, tv = key[sl].transpose(0, 1), value[sl].transpose(0, 1)  # [H, n, D]
        if p.sink_write:
            assert sink is not None, "a plan writes sink tokens but no sink slots were given"
            pos = len(p.ctx_blocks) * t + p.staged_read  # tokens before this step's
            sink[0][p.sink_slot, :, pos : pos + p.sink_write] = tk[:, : p.sink_write]
            sink[1][p.sink_slot, :, pos : pos + p.sink_write] = tv[:, : p.sink_write]
        if p.staged_read:
            tk = torch.cat([stage_k[p.read_slot, :, : p.staged_read], tk], dim=1)
            tv = torch.cat([stage_v[p.read_slot, :, : p.staged_read], tv], dim=1)
        for j, b in enumerate(p.commit_blocks):
            tiles_k.append(tk[:, j * t : (j + 1) * t])
            tiles_v.append(tv[:, j * t : (j + 1) * t])
            blocks.append(b)
        if p.rem_tokens:
            f = len(p.commit_blocks) * t
            stage_k[p.rem_slot, :, : p.rem_tokens] = tk[:, f:]
            stage_v[p.rem_slot, :, : p.rem_tokens] = tv[:, f:]
    if not blocks:
        return None
    return torch.stack(tiles_k), torch.stack(tiles_v), blocks


def commit(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    plans: list[RequestPlan],
    scheme: Scheme,
    *,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store this step's keys/values: quantize tiles that became full, stage the remainder, copy
    the first tokens into sink slots.

    Shapes as in :func:`attend`. Raises ``ValueError`` (from the codec) on inf/NaN keys or values.
    """
    full = stage_and_collect(key, value, stage_k, stage_v, plans, scheme.group_size, sink)
    if full is None:
        return
    k, v, blocks = full
    f, h, t, d = k.shape
    rec = quantize_tiles(k.reshape(f * h, t, d), v.reshape(f * h, t, d), scheme)  # [F * H, tile_bytes]
    idx = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    cache[idx, :, 0, : rec.shape[1]] = rec.view(f, h, -1)
