"""``kvarn-tune``'s per-layer sensitivity pass on a small model folder, with the layers its probes
quantize: shared by the tests of models whose layers are not all quantized (sliding, recurrent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.result import TuneResult
from kvarn.autotune.tuner import TuneConfig, tune
from kvarn.eval.harness import Evaluator, default_text
from kvarn.schemes import Scheme


def tune_probed_layers(folder: Path, cache_dir: Path, num_layers: int, **config: Any) -> tuple[TuneResult, list[int]]:
    """One trial of ``kvarn-tune`` on ``folder`` (256 tokens, 128 for the sensitivity pass, tile 64,
    chunk 64, ``config`` on top): its result and the layer each probe quantized, one entry per probe
    (a probe quantizes one layer alone; the search's per-layer mixes quantize several)."""
    calls: list[Any] = []
    original = Evaluator.evaluate

    def counting(self: Evaluator, spec: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(spec)
        return original(self, spec, *args, **kwargs)

    tune_config = TuneConfig(
        budget=parse_budget("50%"), model=str(folder), text=default_text(), tokens=256, trials=1, sensitivity_tokens=128,
        group_sizes=(64,), confirm=1, prune_tokens=0, cache_dir=cache_dir, chunk=64, progress=False, **config,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Evaluator, "evaluate", counting)
        res = tune(tune_config)
    probes = [
        s for s in calls if isinstance(s, Scheme) and sum(s.for_layer(i) is not None for i in range(num_layers)) == 1
    ]
    return res, [i for s in probes for i in range(num_layers) if s.for_layer(i) is not None]
