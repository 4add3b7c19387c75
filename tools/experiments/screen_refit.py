"""Screen least-squares refits of the stored parameters with the attention-output proxy (sink tile on)."""

from __future__ import annotations

from tools.experiments.attn_proxy import proxy
from tools.experiments.variants import variant_roundtrip

VARIANTS: list[tuple[str, dict[str, object]]] = [
    ("reference", {}),
    ("v: refit factor", {"v_refit": "factor"}),
    ("v: refit factor, bias-weighted", {"v_refit": "factor", "v_bias_weight": 1.0}),
    ("v: refit affine", {"v_refit": "affine"}),
    ("k: refit factor", {"k_refit": "factor"}),
    ("k: refit affine", {"k_refit": "affine"}),
    ("k+v: refit both", {"refit": "both"}),
]

if __name__ == "__main__":
    for label, knobs in VARIANTS:
        m, _ = proxy(variant_roundtrip("kvarn_k4v2_g128", **knobs), sink=True)
        print(f"{label:34s} attn-err {m:.5f}", flush=True)
