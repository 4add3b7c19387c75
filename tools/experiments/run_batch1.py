"""Batch 1: where does kvarn_k4v2_g128's decode-mode KL come from? (sink tile, normalization)."""

from __future__ import annotations

from tools.experiments.decode_eval import DecodeEval, scheme_roundtrip

if __name__ == "__main__":
    ev = DecodeEval()
    for name, sink in [
        ("kvarn_k4v2_g128", True),
        ("kvarn_k4v2_g128_it0", False),
        ("kvarn_k4v2_g128_it0", True),
        ("kvarn_k4v2_g128_rot-none_it0", False),
    ]:
        print(f"{name:32s} sink={sink!s:5s}", ev.evaluate(scheme_roundtrip(name), sink=sink), flush=True)
