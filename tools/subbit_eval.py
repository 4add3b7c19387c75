"""Measure issue 36's research codecs in decode mode beside kvarn presets (docs/accuracy.md, "Below 3 bits").

Any name ``kvarn eval`` takes (presets, baselines such as ``vq_k3v2``), a preset's error split
(``k3v2s8_keys_exact``, ``k3v2s8_values_exact``: one side exact) and the calibrated low-rank
keys ``lowrank<B>`` (keys: ``B`` code bits per key vector in a per-layer PCA basis fitted on
``--calib-text``; values: the reference codec's 2-bit side, log8; ``lowrank<B>_vq``: values by
``vq_k3v2``'s 4-dim vector quantization). The harness passes each layer's
index to the research baselines (``state["layer"]``), which ``kvarn eval`` does not.

    OMP_WAIT_POLICY=PASSIVE python tools/subbit_eval.py --schemes fp16,kvarn_k3v2_g128_s8,lowrank200 \
        --tokens 2048 --threads 1 --json subbit2k.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first

from kvarn.baselines.research import ERROR_SPLITS, TILE, KvarnSide, SplitBaseline  # noqa: E402
from kvarn.codec.lowrank import KeyBasis, LowRankKeys, fit_basis  # noqa: E402
from kvarn.codec.vq import VQSide  # noqa: E402
from kvarn.eval.harness import Evaluator  # noqa: E402
from kvarn.eval.task import progress_bar  # noqa: E402
from kvarn.hf import FP16, KVarNCache  # noqa: E402
from kvarn.hf.committers import BaselineCommitter  # noqa: E402
from kvarn.hf.layers import KVarNLayer  # noqa: E402
from kvarn.hf.spec import Spec  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--schemes", required=True, help="comma-separated names; lowrank<B> for calibrated keys")
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
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    text = a.text.read_text(encoding="utf-8") if a.text else None
    ev = LayerEvaluator(a.model, text=text, tokens=a.tokens, chunk=a.chunk, greedy_tokens=0)
    bases: tuple[KeyBasis, ...] | None = None
    rows: list[dict[str, Any]] = []
    for name in a.schemes.split(","):
        spec: Any = ERROR_SPLITS.get(name, name)
        m = re.fullmatch(r"lowrank(\d+)(_vq)?", name)
        if m:
            if bases is None:
                calib = a.calib_text or Path(__file__).resolve().parents[1] / "kvarn" / "data" / "apache-2.0.txt"
                bases = calibrate(ev, calib.read_text(encoding="utf-8"), a.calib_tokens)
            keys = LowRankKeys(bases, int(m.group(1)))
            values = VQSide(2, dim=4) if m.group(2) else KvarnSide(2)
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
