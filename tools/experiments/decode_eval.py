"""A minimal decode-mode evaluator for codec experiments (until kvarn.eval.harness lands).

The text is fed through the model in chunks of 128 tokens (= one tile); after each chunk every
newly filled 128-token tile of every layer's cache is replaced by its quantize -> dequantize round
trip, so later chunks read quantized tiles while the tile being filled stays exact (decode mode).
Metrics against the unquantized model on the same tokens: perplexity, its change in percent, mean
KL(fp32 || quantized) over next-token distributions, and top-1 agreement.

Run: ``.venv/bin/python -m tools.experiments.decode_eval`` (reference and kvarn_k4v2_g128).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from kvarn.models import load_model

RoundTrip = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
TILE = 128
TEXT = Path(__file__).resolve().parents[2] / "kvarn" / "data" / "gpl-3.txt"


@dataclass
class Result:
    ppl: float
    delta_ppl_pct: float
    kl: float
    top1: float
    seconds: float

    def __str__(self) -> str:
        return f"ppl {self.ppl:.4f} ({self.delta_ppl_pct:+.3f}%)  KL {self.kl:.5f}  top1 {self.top1:.4f}  [{self.seconds:.0f}s]"


class DecodeEval:
    """Loads SmolLM2-135M once, tokenizes ``tokens`` tokens of GPL-3, keeps the fp32 reference."""

    def __init__(self, tokens: int = 2048, chunk: int = TILE, model: str = "smollm2-135m") -> None:
        torch.manual_seed(0)
        self.model, tok = load_model(model)
        ids = tok(TEXT.read_text(), return_tensors="pt").input_ids[:, :tokens]
        if ids.shape[1] < tokens:
            raise ValueError(f"text has {ids.shape[1]} tokens, fewer than {tokens}")
        self.ids, self.chunk = ids, chunk
        self.ref_logp: list[torch.Tensor] = []
        self.ref_nll = float("nan")
        self._run(None, sink=False, reference=True)

    @torch.inference_mode()
    def _run(self, roundtrip: RoundTrip | None, sink: bool, reference: bool = False, sink_tokens: int = 0) -> Result:
        t0 = time.time()
        cache = DynamicCache()
        n = self.ids.shape[1]
        done, nll, kl, agree, count = 0, 0.0, 0.0, 0, 0
        for i, s in enumerate(range(0, n, self.chunk)):
            x = self.ids[:, s : s + self.chunk]
            logits = self.model(input_ids=x, past_key_values=cache, use_cache=True).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            tgt = self.ids[0, s + 1 : s + self.chunk + 1]
            m = tgt.shape[0]  # the last chunk has one position without a target
            nll += float(-logp[torch.arange(m), tgt].sum())
            if reference:
                self.ref_logp.append(logp[:m].clone())
            else:
                ref = self.ref_logp[i]
                kl += float((ref.exp() * (ref - logp[:m])).sum())
                agree += int((ref.argmax(-1) == logp[:m].argmax(-1)).sum())
            count += m
            if roundtrip is None:
                continue
            while done + TILE <= s + x.shape[1]:
                if not (sink and done == 0):
                    for layer in cache.layers:
                        k = layer.keys[0, :, done : done + TILE].float()  # [kv_heads, TILE, head_dim]
                        v = layer.values[0, :, done : done + TILE].float()
                        n0 = sink_tokens if done == 0 else 0
                        if n0:  # keep the first tokens exact and out of the tile's ranges
                            k_in, v_in = k.clone(), v.clone()
                            k_in[:, :n0], v_in[:, :n0] = k[:, n0 : n0 + 1], v[:, n0 : n0 + 1]
                            kq, vq = roundtrip(k_in, v_in)
                            kq[:, :n0], vq[:, :n0] = k[:, :n0], v[:, :n0]
                        else:
                            kq, vq = roundtrip(k, v)
                        layer.keys[0, :, done : done + TILE] = kq.to(layer.keys.dtype)
                        layer.values[0, :, done : done + TILE] = vq.to(layer.values.dtype)
                done += TILE
        mean_nll = nll / count
        if reference:
            self.ref_nll = mean_nll
        ppl = math.exp(mean_nll)
        return Result(ppl, 100 * (ppl / math.exp(self.ref_nll) - 1), kl / count, agree / count, time.time() - t0)

    def evaluate(self, roundtrip: RoundTrip, sink: bool = False, sink_tokens: int = 0) -> Result:
        """Decode-mode metrics of ``roundtrip`` (``[H, 128, D]`` float32 keys, values -> same).

        ``sink``: the whole first tile stays exact. ``sink_tokens``: only the first ``n`` tokens stay
        exact (stored apart, replaced by token ``n`` when the first tile is quantized).
        """
        return self._run(roundtrip, sink, sink_tokens=sink_tokens)


def scheme_roundtrip(name: str) -> RoundTrip:
    """The reference codec's round trip of a kvarn scheme (or preset) name."""
    from kvarn.codec import dequantize_tiles, quantize_tiles
    from kvarn.schemes import get_scheme

    scheme = get_scheme(name)

    def rt(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_tiles(quantize_tiles(k, v, scheme), scheme, k.shape[-1])

    return rt


if __name__ == "__main__":
    ev = DecodeEval()
    print(f"reference ppl {math.exp(ev.ref_nll):.4f}")
    for name in ("kvarn_k4v2_g128",):
        print(name, ev.evaluate(scheme_roundtrip(name)), flush=True)


Rows = list[tuple[str, RoundTrip]]


def layouts(which: str) -> list[str]:
    """Base names of the layouts a batch's ``which`` argument selects: ``k4v4``, ``k4v2`` or ``all``."""
    return [f"kvarn_{lay}_g128" for lay in ("k4v4", "k4v2") if which in (lay, "all")]


def run_rows(rows: Callable[[str], Rows]) -> None:
    """Command line of a batch script: ``[which] [threads]``; prints each row's decode-mode metrics
    with one exact first token (the default)."""
    import sys

    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
    ev = DecodeEval()
    for label, rt in rows(which):
        print(label, ev.evaluate(rt, sink_tokens=1), flush=True)
