"""Batch 8 (issue 12, deliver 3): keys with a searched clipping range per channel (same bytes).

Batch 5: keys carry most of k4v4's error. Each key channel's 4-bit range is its min-max over the
tile's 128 tokens; here the range is shrunk about its centre by the ratio (1.0 down to 0.7) with the
least squared error in the stored domain, scale and minimum stored as fp16 as the codec does; values
unchanged. Also with the least-squares refit of scale and zero point after the codes are chosen.
One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch8 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

import sys

import torch

from tools.experiments.decode_eval import DecodeEval, RoundTrip
from tools.experiments.variants import variant_roundtrip

RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
    ev = DecodeEval()
    runs: list[tuple[str, RoundTrip]] = []
    for layout in ("k4v4", "k4v2"):
        if which not in (layout, "all"):
            continue
        base = f"kvarn_{layout}_g128"
        runs.append((f"{base} keys clip search", variant_roundtrip(base, k_clip=RATIOS)))
    for label, rt in runs:
        print(label, ev.evaluate(rt, sink_tokens=1), flush=True)
