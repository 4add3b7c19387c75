"""Batch 8 (issue 12, deliver 3): keys with a searched clipping range per channel (same bytes).

Batch 5: keys carry most of k4v4's error. Each key channel's 4-bit range is its min-max over the
tile's 128 tokens; here the range is shrunk about its centre by the ratio (1.0 down to 0.7) with the
least squared error in the stored domain, scale and minimum stored as fp16 as the codec does; values
unchanged. Also with the least-squares refit of scale and zero point after the codes are chosen.
One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch8 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

from tools.experiments.decode_eval import Rows, layouts, run_rows
from tools.experiments.variants import variant_roundtrip

RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def rows(which: str) -> Rows:
    return [(f"{base} keys clip search", variant_roundtrip(base, k_clip=RATIOS)) for base in layouts(which)]


if __name__ == "__main__":
    run_rows(rows)
