"""Measure issue 36's research codecs in decode mode beside kvarn presets (docs/accuracy.md, "Below 3 bits").

Any name ``kvarn eval`` takes, the research baselines (``kvarn.research.baselines.RESEARCH``, such
as ``vq_k3v2``), a preset's error split
(``k3v2s8_keys_exact``, ``k3v2s8_values_exact``: one side exact) and the calibrated low-rank
keys ``lowrank<B>`` (keys: ``B`` code bits per key vector in a per-layer PCA basis fitted on
``--calib-text``; values: the reference codec's 2-bit side, log8; ``lowrank<B>_vq``: values by
``vq_k3v2``'s 4-dim vector quantization; ``lowrank<B>_vexact``: values exact), and the
reference codec's sides in a metric (``metric_k<K>[w]v<V>[w]``; ``w``: keys weighted by the
calibrated queries, values by the output projection, :mod:`kvarn.research.metric`). The harness passes each layer's
index to the research baselines (``state["layer"]``), which ``kvarn eval`` does not.

    OMP_WAIT_POLICY=PASSIVE python tools/subbit_eval.py --schemes fp16,kvarn_k3v2_g128_s8,lowrank200 \
        --tokens 2048 --threads 1 --json subbit2k.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from transformers.models.llama import modeling_llama

from kvarn.eval.harness import Evaluator
from kvarn.eval.task import progress_bar
from kvarn.hf import FP16, KVarNCache
from kvarn.hf.committers import BaselineCommitter
from kvarn.hf.layers import KVarNLayer
from kvarn.hf.spec import Spec
from kvarn.research.baselines import ERROR_SPLITS, RESEARCH, TILE, ExactSide, KvarnSide, MetricSide, SplitBaseline
from kvarn.research.lowrank import KeyBasis, LowRankKeys, fit_basis
from kvarn.research.metric import LayerMetric, sqrt_metric
from kvarn.research.vq import VQSide


class LayerEvaluator(Evaluator):
    """An :class:`Evaluator` whose baseline committers know their attention layer's index."""

    def new_cache(self, spec: Spec) -> KVarNCache:
        cache = super().new_cache(spec)
        layers = [layer for layer in cache.layers if isinstance(layer, KVarNLayer)]
        for j, layer in enumerate(layers):
            if isinstance(layer.committer, BaselineCommitter):
                layer.committer.state["layer"] = j
        return cache


def calibrate(ev: Evaluator, text: str, tokens: int) -> tuple[KeyBasis, ...]:
    """Per-layer key bases from the fp16 cache after ``tokens`` tokens of ``text``."""
    ids = ev.tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    cache = KVarNCache(FP16, ev.model.config)
    with progress_bar("calibration", math.ceil(ids.shape[1] / ev.chunk), True) as bar:
        for _ in ev.feed(cache, ids, bar, last_only=True):
            pass
    layers = [layer for layer in cache.layers if isinstance(layer, KVarNLayer)]
    return tuple(fit_basis(layer.tail_k[0].float(), TILE) for layer in layers)


def value_metrics(ev: Evaluator) -> tuple[LayerMetric, ...]:
    """Per layer, ``sqrt(sum_h W_o,h^T W_o,h)`` over the query heads ``h`` of each KV head (weights only)."""
    cfg = ev.model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = []
    for layer in ev.model.model.layers:
        w = layer.self_attn.o_proj.weight.detach().float().reshape(-1, heads, ev.head_dim)  # [hidden, heads, D]
        g = torch.einsum("ohd,ohe->hde", w, w).reshape(kv, heads // kv, ev.head_dim, ev.head_dim).sum(dim=1)
        out.append(sqrt_metric(g))
    return tuple(out)


def key_metrics(ev: Evaluator, text: str, tokens: int) -> tuple[LayerMetric, ...]:
    """Per layer, ``sqrt(E[q q^T])`` of the rotated queries of each KV head's query heads on ``text``."""
    cfg = ev.model.config
    heads, kv, n_layers = cfg.num_attention_heads, cfg.num_key_value_heads, ev.num_layers
    grams = torch.zeros(n_layers, kv, ev.head_dim, ev.head_dim, dtype=torch.float64)
    calls = [0]
    original = modeling_llama.apply_rotary_pos_emb

    def capture(q: torch.Tensor, k: torch.Tensor, *args: Any, **kw: Any) -> Any:
        qe, ke = original(q, k, *args, **kw)
        x = qe[0].double().reshape(kv, heads // kv, -1, ev.head_dim).flatten(1, 2)  # [kv, group*T, D]
        grams[calls[0] % n_layers] += x.transpose(1, 2) @ x
        calls[0] += 1
        return qe, ke

    ids = ev.tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    modeling_llama.apply_rotary_pos_emb = capture
    try:
        with progress_bar("query calibration", math.ceil(ids.shape[1] / ev.chunk), True) as bar:
            for _ in ev.feed(KVarNCache(FP16, cfg), ids, bar, last_only=True):
                pass
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    return tuple(sqrt_metric(g) for g in grams)


def side_errors(ev: Evaluator, text: str, tokens: int) -> dict[str, float]:
    """Relative squared error (sum over every tile of every layer) of each side codec on ``text``'s tiles."""
    cache = KVarNCache(FP16, ev.model.config)
    ids = ev.tokenizer(text, return_tensors="pt").input_ids[:, : tokens // TILE * TILE]
    with progress_bar("tiles", math.ceil(ids.shape[1] / ev.chunk), True) as bar:
        for _ in ev.feed(cache, ids, bar, last_only=True):
            pass
    sides: dict[str, tuple[bool, Any]] = {
        "reference 3-bit keys": (True, KvarnSide(3, per_channel=True)),
        "VQ 3-bit keys (2-dim)": (True, VQSide(3, per_channel=True, dim=2)),
        "reference 2-bit values": (False, KvarnSide(2)),
        "VQ 2-bit values (4-dim)": (False, VQSide(2, dim=4)),
        "VQ 2-bit values, unbiased": (False, VQSide(2, dim=4, unbiased=True)),
    }
    err = dict.fromkeys(sides, 0.0)
    power = dict.fromkeys(sides, 0.0)
    for layer in (x for x in cache.layers if isinstance(x, KVarNLayer)):
        for name, (keys, side) in sides.items():
            x = (layer.tail_k if keys else layer.tail_v).float()
            for i in range(0, x.shape[2], TILE):
                tile = x[:, :, i : i + TILE]
                err[name] += float((side.roundtrip(tile) - tile).square().sum())
                power[name] += float(tile.square().sum())
    return {name: err[name] / power[name] for name in sides}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--schemes", default="", help="comma-separated names; lowrank<B> for calibrated keys")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--text", type=Path, help="evaluation text (default: the bundled GPL-3 + Apache-2.0)")
    p.add_argument(
        "--calib-text",
        type=Path,
        help="calibration text for lowrank<B> (default: the bundled Apache-2.0, not in the first 7,658 tokens)",
    )
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--side-errors", action="store_true", help="print each side codec's squared error on the calibration tiles"
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    text = a.text.read_text(encoding="utf-8") if a.text else None
    ev = LayerEvaluator(a.model, text=text, tokens=a.tokens, chunk=a.chunk, greedy_tokens=0)
    calib = a.calib_text or Path(__file__).resolve().parents[1] / "kvarn" / "data" / "apache-2.0.txt"
    if a.side_errors:
        for name, rel in side_errors(ev, calib.read_text(encoding="utf-8"), a.calib_tokens).items():
            print(f"| {name} | {rel:.4f} |")
    bases: tuple[KeyBasis, ...] | None = None
    kmet: tuple[LayerMetric, ...] | None = None
    vmet: tuple[LayerMetric, ...] | None = None
    rows: list[dict[str, Any]] = []
    for name in filter(None, a.schemes.split(",")):
        spec: Any = {**RESEARCH, **ERROR_SPLITS}.get(name, name)
        w = re.fullmatch(r"metric_k(\d)(w?)v(\d)(w?)", name)
        if w:
            if w.group(2) and kmet is None:
                kmet = key_metrics(ev, calib.read_text(encoding="utf-8"), a.calib_tokens)
            if w.group(4) and vmet is None:
                vmet = value_metrics(ev)
            ks: Any = KvarnSide(int(w.group(1)), per_channel=True)
            vs: Any = KvarnSide(int(w.group(3)))
            ks = MetricSide(ks, kmet) if w.group(2) and kmet else ks
            vs = MetricSide(vs, vmet) if w.group(4) and vmet else vs
            spec = SplitBaseline(name, commit_tokens=TILE, window=0, keys=ks, values=vs)
        m = re.fullmatch(r"lowrank(\d+)(_vq|_vexact)?", name)
        if m:
            if bases is None:
                bases = calibrate(ev, calib.read_text(encoding="utf-8"), a.calib_tokens)
            keys = LowRankKeys(bases, int(m.group(1)))
            values = {"_vq": VQSide(2, dim=4), "_vexact": ExactSide()}.get(m.group(2) or "", KvarnSide(2))
            spec = SplitBaseline(name, commit_tokens=TILE, window=0, keys=keys, values=values)
        r = ev.evaluate(spec, greedy=False)
        # the exact first token's 16-bit copy, spread over the context as the presets count it
        bits = r.bits_per_element + (0.0 if name == FP16 or name.startswith("kvarn_") else 16.0 / r.tokens)
        row = {**r.to_dict(), "bits_per_element": bits}
        rows.append(row)
        ci = r.kl_ci or [float("nan")] * 2
        print(
            f"| {name} | {bits:.3f} | {r.delta_ppl_pct:+.2f} | {r.kl:.4f} [{ci[0]:.4f}, {ci[1]:.4f}] | {r.top1_agreement:.3f} |"
        )
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
