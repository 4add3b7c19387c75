"""The measurement behind docs/models.md: ``kvarn eval``'s harness on a random-weight Gemma-3-like model.

No sliding-window model with trained weights is available offline (only SmolLM2, a Llama), so this
measures a model built from a config with random weights: 6 layers (5 sliding-window with window
512, then 1 full-attention), hidden 256, 4 query heads over 1 KV head, head_dim 256. Its accuracy
figures say little about a trained model; they show that the path runs and what each layer type
holds. Each scheme is measured with sliding layers exact (default) and quantized::

    python tools/measure_gemma_like.py [--tokens 2048] [--schemes fp16,kvarn_k4v2_g128,...]

Prints a Markdown table: bits per element overall and per layer type after the text (what the
cache holds), and KL(fp16 || scheme), top-1 and greedy agreement against fp16.

``--formula`` instead prints bits per element computed (not measured) by
:meth:`kvarn.hf.CacheGeometry.bits_per_element` for the layer layouts of Gemma 3 1B and 4B
(configs written here from their published values; no weights), at several contexts.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvarn.eval.harness import Evaluator
from kvarn.hf import KVarNCache
from kvarn.testing.builders import build, gemma3_config, save

SCHEMES = "fp16,kvarn_k4v2_g128,kvarn_k4v4_g128,kivi2,kivi4,turboquant3,turboquant4"


@torch.inference_mode()
def by_type(ev: Evaluator, name: str, quantize_sliding: bool) -> dict[str, dict[str, float]]:
    """Feed the evaluator's tokens through a fresh cache as the harness does; bits per layer type."""
    cache = KVarNCache(name, ev.model.config, quantize_sliding=quantize_sliding)
    for start in range(0, ev.tokens, ev.chunk):
        ev.model(input_ids=ev.ids[:, start : start + ev.chunk], past_key_values=cache, use_cache=True)
    return cache.by_layer_type()


# (name, layers, sliding window, head_dim): Gemma 3's published text configs; five sliding layers per full one
SHAPES = (("Gemma 3 1B", 26, 512, 256), ("Gemma 3 4B", 34, 1024, 256))


def formula(schemes: list[str], contexts: tuple[int, ...] = (4096, 32768, 131072)) -> None:
    """Computed bits per element of the mix (sliding layers weigh their window), per context."""
    from transformers import Gemma3TextConfig

    from kvarn.hf import cache_geometry, resolve_spec

    print("| layout | scheme | sliding layers | " + " | ".join(f"{c // 1024}K" for c in contexts) + " |")
    print("|---|---|---|" + "---:|" * len(contexts))
    for label, layers, window, head_dim in SHAPES:
        g = cache_geometry(Gemma3TextConfig(num_hidden_layers=layers, sliding_window=window, head_dim=head_dim))
        for name in schemes:
            for q in (False, True):
                cells = []
                for c in contexts:
                    bits = g.bits_per_element(resolve_spec(name), c, quantize_sliding=q)
                    cells.append(f"{bits:.2f} ({16 / bits:.2f}x)")
                mode = "quantized" if q else "16-bit"
                print(
                    f"| {label} ({g.count('full_attention')} full, window {window}) | {name} | {mode} | "
                    + " | ".join(cells)
                    + " |"
                )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--schemes", default=SCHEMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formula", action="store_true", help="computed bits for Gemma 3 layouts instead")
    a = p.parse_args(argv)
    if a.formula:
        formula([n for n in a.schemes.split(",") if n.startswith("kvarn")])
        return 0
    torch.set_num_threads(1)  # shared 2-core machines: one thread is also the fastest for the codec here
    names = [n for n in a.schemes.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save(build(gemma3_config(hidden=256, layers=6, window=512, heads=4), a.seed), Path(tmp))
        print(f"random Gemma-3-like model (seed {a.seed}), {a.tokens} tokens of GPL-3, chunk {a.chunk}, decode mode\n")
        print("| scheme | sliding layers | bits/elem all | full layers | sliding layers | KL | top-1 | greedy |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for quantize_sliding in (False, True):
            ev = Evaluator(str(folder), tokens=a.tokens, chunk=a.chunk, greedy_tokens=a.greedy_tokens,
                           quantize_sliding=quantize_sliding)  # fmt: skip
            for name in names:
                if quantize_sliding and name == "fp16":
                    continue
                r: Any = ev.evaluate(name, progress=False)
                t = by_type(ev, name, quantize_sliding)
                mode = "quantized" if quantize_sliding else "16-bit"
                print(
                    f"| {name} | {mode} | {t['all']['bits_per_element']:.3f} | {t['full_attention']['bits_per_element']:.3f} "
                    f"| {t['sliding_attention']['bits_per_element']:.3f} | {r.kl:.2e} | {r.top1_agreement:.3f} "
                    f"| {r.greedy_agreement_tokens} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
