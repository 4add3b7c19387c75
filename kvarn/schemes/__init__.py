"""Schemes: the frozen :class:`Scheme`, YAML presets and the registry."""

from kvarn.schemes.presets import Preset, PresetError, load_preset, preset_from_dict, preset_to_dict, save_preset
from kvarn.schemes.registry import (
    BUILTINS,
    PresetClash,
    PresetProblem,
    UnknownSchemeError,
    get_preset,
    get_scheme,
    list_presets,
    preset_clashes,
    preset_problems,
    search_path,
    user_preset_dir,
)
from kvarn.schemes.scheme import (
    ALLOWED_BITS,
    ALLOWED_GROUP_SIZES,
    ALLOWED_SINK_TOKENS,
    LayerOverride,
    Scheme,
    SchemeError,
)

__all__ = [
    "ALLOWED_BITS",
    "ALLOWED_GROUP_SIZES",
    "ALLOWED_SINK_TOKENS",
    "BUILTINS",
    "LayerOverride",
    "Preset",
    "PresetClash",
    "PresetError",
    "PresetProblem",
    "Scheme",
    "SchemeError",
    "UnknownSchemeError",
    "get_preset",
    "get_scheme",
    "list_presets",
    "load_preset",
    "preset_clashes",
    "preset_from_dict",
    "preset_problems",
    "preset_to_dict",
    "save_preset",
    "search_path",
    "user_preset_dir",
]
