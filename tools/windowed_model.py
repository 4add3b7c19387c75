"""The embedded SmolLM2 with Gemma-3-style sliding-window layers imposed, for accuracy checks.

No model trained with sliding-window layers is available offline (only SmolLM2, a Llama). This
writes SmolLM2's trained weights as a ``MinistralForCausalLM`` folder (the same tensors as Llama:
no biases, tied embeddings) whose config makes ``--every - 1`` of every ``--every`` layers
``sliding_attention`` with a window of ``--window`` tokens and the rest ``full_attention``
(Gemma 3: 5 of 6 sliding, window 512 in its 1B model). The model was not trained that way, so its
own perplexity is worse than SmolLM2's; what it is for is comparing caches on the *same* windowed
model with real weights and activations: ``kvarn eval`` compares every scheme with the fp16 cache
of that model, sliding layers 16-bit and windowed in all of them by default (as KVarN does)::

    python tools/windowed_model.py OUT [--window 512] [--every 6]
    kvarn eval --model OUT --schemes fp16,kvarn_k4v2_g128,kvarn_k4v4_g128,kivi2,kivi4,turboquant3,turboquant4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write(out: Path, window: int = 512, every: int = 6, model: str = "smollm2-135m") -> Path:
    """Write the windowed copy of ``model`` (an alias or a Llama folder) to ``out``; returns ``out``."""
    from kvarn.models import resolve_model

    src = resolve_model(model)
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{src}: model_type {config.get('model_type')!r}; a Llama folder is needed")
    if window < 1 or every < 1:
        raise ValueError(f"--window {window} and --every {every} must be >= 1")
    n = int(config["num_hidden_layers"])
    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    config.update(
        architectures=["MinistralForCausalLM"], model_type="ministral", sliding_window=window, layer_types=types
    )
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--window", type=int, default=512, help="sliding window in tokens (default 512)")
    p.add_argument("--every", type=int, default=6, help="one full-attention layer in every N (default 6)")
    p.add_argument("--model", default="smollm2-135m", help="alias or Llama folder (default smollm2-135m)")
    a = p.parse_args(argv)
    out = write(a.out, a.window, a.every, a.model)
    types = json.loads((out / "config.json").read_text())["layer_types"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    print(f"{out}: {len(types)} layers, full attention at {full}, the others sliding (window {a.window})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
