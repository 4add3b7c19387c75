"""Batch 5 (issue 12, deliver 3): where the error of k4v2 / k4v4 sits, and error diffusion of values.

Attribution: each layout with one side exact (the other through the reference codec). Error
diffusion (``variants.py``, knob ``diffuse``): each token's value row is rounded with the previous
token's rounding error added, so the errors of consecutive tokens telescope in attention's weighted
sum; same bytes and same decoder as the reference. All rows keep one exact first token (the default).
Run: ``.venv/bin/python -m tools.experiments.run_batch5 [attr|diffuse|all]``.
"""

from __future__ import annotations

from tools.experiments.decode_eval import RoundTrip, Rows, run_rows, scheme_roundtrip
from tools.experiments.variants import variant_roundtrip


def keys_exact(rt: RoundTrip) -> RoundTrip:
    return lambda k, v: (k, rt(k, v)[1])


def values_exact(rt: RoundTrip) -> RoundTrip:
    return lambda k, v: (rt(k, v)[0], v)


def rows(which: str) -> Rows:
    runs: Rows = []
    if which in ("diffuse", "all"):
        runs.append(("kvarn_k4v2_g128 reference", scheme_roundtrip("kvarn_k4v2_g128")))
        for d in (0.5, 1.0):
            runs.append((f"kvarn_k4v2_g128 values diffuse={d}", variant_roundtrip("kvarn_k4v2_g128", v_diffuse=d)))
    if which in ("attr", "all"):
        for name in ("kvarn_k4v2_g128", "kvarn_k4v4_g128"):
            ref = scheme_roundtrip(name)
            runs += [(f"{name} reference", ref), (f"{name} keys exact", keys_exact(ref))]
            runs += [(f"{name} values exact", values_exact(ref))]
    return runs


if __name__ == "__main__":
    run_rows(rows)
