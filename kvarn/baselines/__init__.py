"""Baselines: published KV-cache quantization methods, fake-quantized, measured in the same harness.

``fp8``, ``int8``, ``kivi2``, ``kivi4``, ``turboquant3``, ``turboquant4``, ``rtn_k{K}v{V}`` and
vLLM 0.33's KV dtypes under their vLLM names (:data:`VLLM033`); each
implements :class:`Baseline` (``commit_tokens``, ``window``, ``bits_per_element``, ``roundtrip``).

Example:
    >>> from kvarn.baselines import get_baseline
    >>> get_baseline("kivi2").bits_per_element(head_dim=64)
    3.0
"""

from kvarn.baselines.base import Baseline, minmax_roundtrip
from kvarn.baselines.fp8 import FP8Baseline
from kvarn.baselines.intquant import Int8Baseline
from kvarn.baselines.kivi import KIVIBaseline
from kvarn.baselines.lloydmax import lloyd_max_centroids, lloyd_max_mse
from kvarn.baselines.registry import BASELINES, VLLM033, UnknownBaselineError, get_baseline
from kvarn.baselines.rtn import RTNBaseline
from kvarn.baselines.turboquant import TurboQuantBaseline
from kvarn.baselines.turboquant_vllm import VllmTurboQuantBaseline
from kvarn.baselines.vllm_dtypes import VllmDtypeBaseline

__all__ = [
    "BASELINES",
    "Baseline",
    "FP8Baseline",
    "Int8Baseline",
    "KIVIBaseline",
    "RTNBaseline",
    "TurboQuantBaseline",
    "VLLM033",
    "UnknownBaselineError",
    "VllmDtypeBaseline",
    "VllmTurboQuantBaseline",
    "get_baseline",
    "lloyd_max_centroids",
    "lloyd_max_mse",
    "minmax_roundtrip",
]
