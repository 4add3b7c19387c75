"""transformers integration: :class:`KVarNCache` and the cache specs it accepts."""

from kvarn.hf.cache import KVarNCache, model_geometry
from kvarn.hf.layers import BaselineCommitter, KVarNLayer, TileCommitter
from kvarn.hf.spec import FP16, BaselineLike, baselines, known_names, resolve_spec, spec_name

__all__ = [
    "FP16",
    "BaselineCommitter",
    "BaselineLike",
    "KVarNCache",
    "KVarNLayer",
    "TileCommitter",
    "baselines",
    "known_names",
    "model_geometry",
    "resolve_spec",
    "spec_name",
]
