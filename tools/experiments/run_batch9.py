"""Batch 9 (issue 12, deliver 3): choose the keys' normalization iterate by a weighted error.

Batch 8: clipping key ranges (less MSE) made KL worse: the largest keys matter most. Here each tile
still keeps one of its normalization iterates (same bytes, same decoder), but the keys' iterate is
the one with the least error weighted by ``|k|`` or ``k^2`` (large entries count more); values
unchanged. One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch9 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

import torch

from tools.experiments.decode_eval import Rows, layouts, run_rows
from tools.experiments.variants import variant_roundtrip


def rows(which: str) -> Rows:
    runs: Rows = []
    for base in layouts(which):
        runs.append((f"{base} keys iterate by |k|-weighted error", variant_roundtrip(base, k_weight=torch.abs)))
        runs.append((f"{base} keys iterate by k^2-weighted error", variant_roundtrip(base, k_weight=torch.square)))
    return runs


if __name__ == "__main__":
    run_rows(rows)
