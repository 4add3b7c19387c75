"""Batch 2: decode-mode KL of the key refits that the attention proxy favoured (sink tile on and off)."""

from __future__ import annotations

from tools.experiments.decode_eval import DecodeEval
from tools.experiments.variants import variant_roundtrip

if __name__ == "__main__":
    ev = DecodeEval()
    for label, knobs, sink in [
        ("k: refit affine", {"k_refit": "affine"}, True),
        ("k: refit affine+factor", {"k_refit": "both"}, True),
        ("k: refit affine", {"k_refit": "affine"}, False),
    ]:
        print(
            f"{label:26s} sink={sink!s:5s}",
            ev.evaluate(variant_roundtrip("kvarn_k4v2_g128", **knobs), sink=sink),
            flush=True,
        )
