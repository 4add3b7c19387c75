"""A fast proxy for decode-mode accuracy: attention-output error on captured real Q/K/V.

Captures post-RoPE queries, keys and values of every layer of SmolLM2-135M on the first 2048
tokens of GPL-3 (one fp32 forward pass, cached under ``$KVARN_EXP_CACHE`` or the working folder's
``.exp-cache``), then for a codec round trip computes, per layer, the attention output as decode
mode sees it (queries of chunk c read quantized tiles < c and the exact tiles of their own chunk)
and its relative squared error vs exact attention. Ignores error propagation through layers, so
use it to screen variants, then confirm with :mod:`tools.experiments.decode_eval`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

RoundTrip = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
TILE = 128
TEXT = Path(__file__).resolve().parents[2] / "kvarn" / "data" / "gpl-3.txt"


def _cache_file(tokens: int) -> Path:
    root = Path(os.environ.get("KVARN_EXP_CACHE", ".exp-cache"))
    root.mkdir(parents=True, exist_ok=True)
    return root / f"qkv_smollm2_gpl3_{tokens}.pt"


@torch.inference_mode()
def capture(tokens: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q [Hq, T, D], k [Hkv, T, D], v [Hkv, T, D])`` float32 of the unquantized model."""
    path = _cache_file(tokens)
    if path.is_file():
        return torch.load(path)  # type: ignore[no-any-return]
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvarn.models import load_model

    store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def grab(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        store[module.layer_idx] = (query[0].clone(), key[0].clone(), value[0].clone())
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("kvarn_capture", grab)
    model, tok = load_model("smollm2-135m")
    model.config._attn_implementation = "kvarn_capture"
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids[:, :tokens]
    model(input_ids=ids)
    out = [store[i] for i in range(len(store))]
    torch.save(out, path)
    return out


QUERY_STRIDE = 8  # every 8th query past the first tile: 8x cheaper, same ranking in our checks


def layer_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor) -> float:
    """Relative squared error of decode-mode attention output for queries past the first tile."""
    hq, t, d = q.shape
    rep = hq // k.shape[0]
    k, v, kq, vq = (x.repeat_interleave(rep, 0) for x in (k, v, kq, vq))
    qpos = torch.arange(TILE + QUERY_STRIDE - 1, t, QUERY_STRIDE)
    q = q[:, qpos]
    pos = torch.arange(t)
    causal = pos[None, :] <= qpos[:, None]
    use_q = (pos[None, :] // TILE) < (qpos[:, None] // TILE)  # key tile finished before the query's chunk
    s_exact = q @ k.transpose(1, 2) / d**0.5
    s_quant = q @ kq.transpose(1, 2) / d**0.5
    s = torch.where(use_q, s_quant, s_exact).masked_fill(~causal, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o_hat = (p * use_q) @ vq + (p * ~use_q) @ v
    o = torch.softmax(s_exact.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return float((o_hat - o).square().sum() / o.square().sum())


def proxy(rt: RoundTrip, sink: bool = False, tokens: int = 2048) -> tuple[float, list[float]]:
    """Mean over layers of the relative attention-output error; also the per-layer list."""
    errs = []
    for q, k, v in capture(tokens):
        h, t, d = k.shape
        kq, vq = rt(k.reshape(-1, TILE, d), v.reshape(-1, TILE, d))
        kq, vq = kq.reshape(h, t, d), vq.reshape(h, t, d)
        if sink:
            kq[:, :TILE], vq[:, :TILE] = k[:, :TILE], v[:, :TILE]
        errs.append(layer_error(q, k, v, kq, vq))
    return sum(errs) / len(errs), errs


if __name__ == "__main__":
    from tools.experiments.decode_eval import scheme_roundtrip

    for name in ("kvarn_k4v2_g128", "kvarn_k4v2_g128_it0", "kvarn_k4v2_g128_rot-none_it0"):
        for sink in (False, True):
            m, _ = proxy(scheme_roundtrip(name), sink)
            print(f"{name:32s} sink={sink!s:5s} attn-err {m:.5f}", flush=True)
