"""The baseline registry: every built-in baseline by name, and lookup with a helpful error."""

from __future__ import annotations

import difflib

from kvarn.baselines.base import Baseline
from kvarn.baselines.fp8 import FP8Baseline
from kvarn.baselines.intquant import Int8Baseline
from kvarn.baselines.kivi import KIVI_GROUP, KIVI_WINDOW, KIVIBaseline
from kvarn.baselines.rtn import RTN_TILE, RTNBaseline
from kvarn.baselines.turboquant import TurboQuantBaseline
from kvarn.baselines.turboquant_vllm import TQ_BOUNDARY, TQ_PRESETS, VllmTurboQuantBaseline
from kvarn.baselines.vllm_dtypes import FORMATS, VllmDtypeBaseline

_RTN_BITS = ((4, 2), (4, 4), (2, 2), (3, 2), (4, 3))

# vLLM 0.33's KV dtypes under vLLM's names; TurboQuant as deployed, and with every layer quantized
VLLM033: tuple[Baseline, ...] = (
    *(VllmDtypeBaseline(f, commit_tokens=1, window=0, dtype=f) for f in FORMATS),
    *(VllmTurboQuantBaseline(p, commit_tokens=1, window=0, boundary_layers=TQ_BOUNDARY, preset=p) for p in TQ_PRESETS),
    *(VllmTurboQuantBaseline(f"{p}_all_layers", commit_tokens=1, window=0, preset=p) for p in TQ_PRESETS),
)

BASELINES: dict[str, Baseline] = {
    b.name: b
    for b in (
        FP8Baseline("fp8", commit_tokens=1, window=0),
        Int8Baseline("int8", commit_tokens=1, window=0),
        KIVIBaseline("kivi2", commit_tokens=KIVI_GROUP, window=KIVI_WINDOW, bits=2),
        KIVIBaseline("kivi4", commit_tokens=KIVI_GROUP, window=KIVI_WINDOW, bits=4),
        TurboQuantBaseline("turboquant3", commit_tokens=1, window=0, bits=3),
        TurboQuantBaseline("turboquant4", commit_tokens=1, window=0, bits=4),
        *(
            RTNBaseline(f"rtn_k{kb}v{vb}", commit_tokens=RTN_TILE, window=0, key_bits=kb, value_bits=vb)
            for kb, vb in _RTN_BITS
        ),
        *VLLM033,
    )
}


class UnknownBaselineError(KeyError):
    """No baseline of that name; the message lists the valid names and the closest match."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


def get_baseline(name: str) -> Baseline:
    """The built-in baseline ``name`` (e.g. ``"kivi2"``).

    Raises:
        UnknownBaselineError: ``name`` is not one of :data:`BASELINES`.
    """
    try:
        return BASELINES[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), BASELINES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownBaselineError(f"unknown baseline {name!r}{hint} Valid baselines: {', '.join(BASELINES)}") from None
