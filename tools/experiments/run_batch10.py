"""Batch 10 (issue 12, deliver 3): two more same-bytes level layouts.

Companded levels keep each slice's extremes exact (min-max, fp16, as the reference) and move the
inner levels towards the middle (``compand`` exponent ``p``; on N(0, 1) slices of 64 at 2 bits,
``p = 1.1`` has 9% less MSE than uniform levels and no shrinkage, E[v v_hat] / E[v^2] = 0.995; 4-bit
slices of 128 at ``p = 1.2``: 10% less MSE). Grouped values quantize each token in two groups of 32
channels with a log8 scale and a byte zero point each (the bytes of today's fp16 scale and minimum
at head_dim 64; 14% less MSE on N(0, 1)). One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch10 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

from tools.experiments.decode_eval import Rows, layouts, run_rows, scheme_roundtrip
from tools.experiments.variants import variant_roundtrip


def rows(which: str) -> Rows:
    runs: Rows = []
    for base in layouts(which):
        runs.append((base, scheme_roundtrip(base)))
        if base.startswith("kvarn_k4v2"):
            runs.append((f"{base} values companded p=1.1", variant_roundtrip(base, v_compand=1.1)))
            runs.append((f"{base} values in 2 groups of 32, log8", variant_roundtrip(base, v_group=32)))
        runs.append((f"{base} keys companded p=1.2", variant_roundtrip(base, k_compand=1.2)))
    return runs


if __name__ == "__main__":
    run_rows(rows)
