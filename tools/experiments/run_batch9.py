"""Batch 9 (issue 12, deliver 3): choose the keys' normalization iterate by a weighted error.

Batch 8: clipping key ranges (less MSE) made KL worse: the largest keys matter most. Here each tile
still keeps one of its normalization iterates (same bytes, same decoder), but the keys' iterate is
the one with the least error weighted by ``|k|`` or ``k^2`` (large entries count more); values
unchanged. One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch9 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

import sys

import torch

from tools.experiments.decode_eval import DecodeEval, RoundTrip
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
        runs.append((f"{base} keys iterate by |k|-weighted error", variant_roundtrip(base, k_weight=torch.abs)))
        runs.append((f"{base} keys iterate by k^2-weighted error", variant_roundtrip(base, k_weight=torch.square)))
    for label, rt in runs:
        print(label, ev.evaluate(rt, sink_tokens=1), flush=True)
