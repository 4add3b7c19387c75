"""Batch 4 (issue 12, deliver 3): 2-bit values on Lloyd-Max Gaussian levels, same bytes, one exact token.

Values are rotated (Hadamard) and normalized before rounding, so each token's slice is close to
Gaussian; min-max affine rounding spends its 4 levels on the extremes. ``gauss_unbiased`` keeps the
codes of the MSE-optimal Gaussian codebook but rescales the levels so the round trip does not shrink
values (E[v * v_hat] = E[v^2]); ``gauss`` is the plain (shrinking) codebook. Keys unchanged.
Run: ``.venv/bin/python -m tools.experiments.run_batch4 [unbiased|gauss|ref|all]``.
"""

from __future__ import annotations

import sys

from tools.experiments.decode_eval import DecodeEval, scheme_roundtrip
from tools.experiments.variants import variant_roundtrip

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    ev = DecodeEval()
    if which in ("unbiased", "all"):
        rt = variant_roundtrip("kvarn_k4v2_g128", v_levels="gauss_unbiased")
        print("v gauss levels, unbiased, sink_tokens=1", ev.evaluate(rt, sink_tokens=1), flush=True)
    if which in ("gauss", "all"):
        rt = variant_roundtrip("kvarn_k4v2_g128", v_levels="gauss")
        print("v gauss levels (shrinking), sink_tokens=1", ev.evaluate(rt, sink_tokens=1), flush=True)
    if which in ("ref", "all"):
        print(
            "reference codec, sink_tokens=1",
            ev.evaluate(scheme_roundtrip("kvarn_k4v2_g128"), sink_tokens=1),
            flush=True,
        )
