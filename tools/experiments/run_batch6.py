"""Batch 6 (issue 12, deliver 3): same-bytes variants aimed at the keys, which batch 5 found carry most
of k4v4's error (keys exact: KL 0.0032 -> 0.0004; values exact: -> 0.0026).

Rows: the built-in layout with random-sign Hadamard (``_rot-rh``), 16 normalization iterations
(``_it16``), both, and the reference encoder with a least-squares refit of the keys' scale and zero
point (``variants.py``, ``k_refit="affine"``). One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch6 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

import sys

import torch

from tools.experiments.decode_eval import DecodeEval, RoundTrip, scheme_roundtrip
from tools.experiments.variants import variant_roundtrip

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
    ev = DecodeEval()
    runs: list[tuple[str, RoundTrip]] = []
    for layout in ("k4v4", "k4v2"):
        if which not in (layout, "all"):
            continue
        base = f"kvarn_{layout}_g128"
        for suffix in ("", "_rot-rh", "_it16", "_rot-rh_it16"):
            runs.append((base + suffix, scheme_roundtrip(base + suffix)))
        runs.append((f"{base} keys refit affine", variant_roundtrip(base, k_refit="affine")))
    for label, rt in runs:
        print(label, ev.evaluate(rt, sink_tokens=1), flush=True)
