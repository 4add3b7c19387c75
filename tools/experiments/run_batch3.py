"""Batch 3: keep only the sink token (token 0) exact instead of the whole first tile."""

from __future__ import annotations

import sys

from tools.experiments.decode_eval import DecodeEval, scheme_roundtrip
from tools.experiments.variants import variant_roundtrip

if __name__ == "__main__":
    ev = DecodeEval()
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    if which in ("ref", "both"):
        print(
            "reference codec, sink_tokens=1    ",
            ev.evaluate(scheme_roundtrip("kvarn_k4v2_g128"), sink_tokens=1),
            flush=True,
        )
    if which in ("refit", "both"):
        rt = variant_roundtrip("kvarn_k4v2_g128", k_refit="affine")
        print("k refit affine, sink_tokens=1     ", ev.evaluate(rt, sink_tokens=1), flush=True)
