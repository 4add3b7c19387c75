"""Batch 7 (issue 12, deliver 3): keys without rotation, values rotated (same bytes).

Keys are quantized per channel across a tile's tokens, like KIVI, whose reason for it is that key
outliers sit in fixed channels; a Hadamard rotation mixes every channel into every other, so each
rotated channel's range holds all of them. Keys and values are encoded independently by the codec,
so "keys of ``_rot-none``, values of the built-in" is exactly what a scheme with a rotation per side
would store. One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch7 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

from tools.experiments.decode_eval import RoundTrip, Rows, layouts, run_rows, scheme_roundtrip


def mixed(key_scheme: str, value_scheme: str) -> RoundTrip:
    rk, rv = scheme_roundtrip(key_scheme), scheme_roundtrip(value_scheme)
    return lambda k, v: (rk(k, v)[0], rv(k, v)[1])


def rows(which: str) -> Rows:
    runs: Rows = []
    for base in layouts(which):
        runs.append((f"{base}: keys _rot-none, values hadamard", mixed(base + "_rot-none", base)))
        runs.append((f"{base}_rot-none (both sides)", scheme_roundtrip(base + "_rot-none")))
    return runs


if __name__ == "__main__":
    run_rows(rows)
