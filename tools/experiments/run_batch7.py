"""Batch 7 (issue 12, deliver 3): keys without rotation, values rotated (same bytes).

Keys are quantized per channel across a tile's tokens, like KIVI, whose reason for it is that key
outliers sit in fixed channels; a Hadamard rotation mixes every channel into every other, so each
rotated channel's range holds all of them. Keys and values are encoded independently by the codec,
so "keys of ``_rot-none``, values of the built-in" is exactly what a scheme with a rotation per side
would store. One exact first token (the default) everywhere.
Run: ``.venv/bin/python -m tools.experiments.run_batch7 [k4v4|k4v2|all] [threads]``.
"""

from __future__ import annotations

import sys

import torch

from tools.experiments.decode_eval import DecodeEval, RoundTrip, scheme_roundtrip


def mixed(key_scheme: str, value_scheme: str) -> RoundTrip:
    rk, rv = scheme_roundtrip(key_scheme), scheme_roundtrip(value_scheme)
    return lambda k, v: (rk(k, v)[0], rv(k, v)[1])


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
    ev = DecodeEval()
    runs: list[tuple[str, RoundTrip]] = []
    for layout in ("k4v4", "k4v2"):
        if which not in (layout, "all"):
            continue
        base = f"kvarn_{layout}_g128"
        runs.append((f"{base}: keys _rot-none, values hadamard", mixed(base + "_rot-none", base)))
        runs.append((f"{base}_rot-none (both sides)", scheme_roundtrip(base + "_rot-none")))
    for label, rt in runs:
        print(label, ev.evaluate(rt, sink_tokens=1), flush=True)
