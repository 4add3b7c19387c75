"""Batch 6 (issue 12, deliver 3): same-bytes variants aimed at the keys, which batch 5 found carry most
of k4v4's error (keys exact: KL 0.0032 -> 0.0004; values exact: -> 0.0026).

Rows: the built-in layout with random-sign Hadamard (``_rot-rh``), 16 normalization iterations
(``_it16``), both, and the reference encoder with a least-squares refit of the keys' scale and zero
point (``variants.py``, ``k_refit="affine"``). One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch6 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

from tools.experiments.decode_eval import Rows, layouts, run_rows, scheme_roundtrip
from tools.experiments.variants import variant_roundtrip


def rows(which: str) -> Rows:
    runs: Rows = []
    for base in layouts(which):
        runs += [
            (base + suffix, scheme_roundtrip(base + suffix)) for suffix in ("", "_rot-rh", "_it16", "_rot-rh_it16")
        ]
        runs.append((f"{base} keys refit affine", variant_roundtrip(base, k_refit="affine")))
    return runs


if __name__ == "__main__":
    run_rows(rows)
