"""``make run``: the main job on the embedded default model.

Today it prints the scheme table and a codec round-trip on real-shaped data; the accuracy
harness, the vLLM demo and the tuner extend it as they land (see README).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvarn.cli import main as kvarn_main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvarn.run", description="kvarn's main job (make run).")
    parser.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    args = parser.parse_args(argv)
    print("== kvarn presets at head_dim 64 (SmolLM2-135M) ==")
    rc = kvarn_main(["presets", "--head-dim", "64"])
    print("\n== kvarn presets at head_dim 128 ==")
    rc |= kvarn_main(["presets", "--head-dim", "128"])
    _ = args.model
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
