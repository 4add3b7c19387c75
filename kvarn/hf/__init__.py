"""transformers integration: :class:`KVarNCache`, the cache specs it accepts, the layers it serves."""

from kvarn.hf.cache import KVarNCache
from kvarn.hf.committers import BaselineCommitter, TileCommitter
from kvarn.hf.geometry import FULL, LAYER_TYPES, SLIDING, CacheGeometry, cache_geometry, model_geometry
from kvarn.hf.layers import KVarNLayer
from kvarn.hf.spec import FP16, BaselineLike, baselines, known_names, resolve_spec, spec_name

__all__ = [
    "FP16",
    "FULL",
    "LAYER_TYPES",
    "SLIDING",
    "BaselineCommitter",
    "BaselineLike",
    "CacheGeometry",
    "KVarNCache",
    "KVarNLayer",
    "TileCommitter",
    "baselines",
    "cache_geometry",
    "known_names",
    "model_geometry",
    "resolve_spec",
    "spec_name",
]
