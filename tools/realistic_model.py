"""A model with realistic compute per KV element: Llama-3.2-1B's per-layer shapes, random weights.

Builds the folder of :mod:`kvarn.llama1b_shapes` once (its docstring says what and why), prints it and
the model's layer FLOPs per KV element against SmolLM2-135M's::

    python tools/realistic_model.py [--layers 4]    # prints the folder
"""

from __future__ import annotations

import argparse

from kvarn.llama1b_shapes import LLAMA_3_2_1B, SMOLLM2, flops_per_kv_element
from kvarn.models import model_folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4; Llama-3.2-1B has 16)")
    a = p.parse_args(argv)
    print(model_folder("llama1b-shapes", a.layers))
    ratio = flops_per_kv_element(LLAMA_3_2_1B) / flops_per_kv_element(SMOLLM2)
    print(
        f"layer FLOPs per KV element: {flops_per_kv_element(LLAMA_3_2_1B):,.0f} "
        f"(SmolLM2-135M: {flops_per_kv_element(SMOLLM2):,.0f}; {ratio:.1f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
