"""kvarn: KV-cache quantization into packed low-bit tiles, with a reference codec as the oracle."""

from kvarn.codec import dequantize_tiles, quantize_tiles
from kvarn.schemes import (
    BUILTINS,
    Preset,
    PresetError,
    Scheme,
    SchemeError,
    UnknownSchemeError,
    get_preset,
    get_scheme,
    list_presets,
    load_preset,
    preset_problems,
    save_preset,
)

__version__ = "0.1.0"

__all__ = [
    "BUILTINS",
    "Preset",
    "PresetError",
    "Scheme",
    "SchemeError",
    "UnknownSchemeError",
    "__version__",
    "dequantize_tiles",
    "get_preset",
    "get_scheme",
    "list_presets",
    "load_preset",
    "preset_problems",
    "quantize_tiles",
    "save_preset",
]
