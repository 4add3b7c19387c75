"""YAML presets <-> schemes (schema version 2; version 1 still loads), loaded with OmegaConf.

A preset file::

    version: 2                 # schema version, required: 2 (what save_preset writes) or 1
    name: kvarn_smollm2_1pct   # the name it is served by, required ([A-Za-z0-9_.-]+)
    key_bits: 4                # 2, 3, 4 or 8
    value_bits: 2              # 2, 3, 4 or 8
    group_size: 128            # tile length in tokens: 32, 64, 128 or 256
    rotation: hadamard         # hadamard, none or rhadamard
    norm_iters: 8              # 0..32 (0 = no normalization)
    scale_dtype: fp16          # fp16 or log8
    sink_tile: false           # keep the first tile of every sequence unquantized
    sink_tokens: 1             # 0, 1, 2, 4 or 8 first tokens also kept exactly; optional: omitted
                               # means 1 in version 2, 0 in version 1 (whose files were written
                               # when no exact token was the default), so old files keep their meaning
    layers:                    # optional per-layer overrides
      - {layers: "0-1", key_bits: 8, value_bits: 4}
      - {layers: 29, unquantized: true}
    description: ...           # optional free text
    provenance: {...}          # optional mapping (kvarn-tune writes model, budget, measurements)

Every scheme field is required; an unknown key, a missing field or a bad value raises
:class:`PresetError` naming the file, the field, the value and what is allowed. A ``kernel_config``
mapping, which earlier files may hold, is accepted and ignored (kernel launch parameters come from
:mod:`kvarn.kernels`, not from presets).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvarn.schemes.scheme import LayerOverride, Scheme, SchemeError

SCHEMA_VERSION = 2  # 2: exact first tokens by default (Scheme.sink_tokens = 1); files write sink_tokens
SUPPORTED_VERSIONS = (1, 2)
# Defaults of the fields a version omits, where they differ from the current Scheme defaults.
_VERSION_DEFAULTS: dict[int, dict[str, Any]] = {1: {"sink_tokens": 0}}
_SCHEME_FIELDS = ("key_bits", "value_bits", "group_size", "rotation", "norm_iters", "scale_dtype", "sink_tile")
_OPTIONAL_SCHEME_FIELDS = ("sink_tokens",)  # optional: omitted means the version's default (_VERSION_DEFAULTS)
_OPTIONAL = ("layers", "description", "provenance")
_IGNORED = ("kernel_config",)  # read by no code; accepted so that files that have it still load
_ALLOWED_KEYS = ("version", "name", *_SCHEME_FIELDS, *_OPTIONAL_SCHEME_FIELDS, *_OPTIONAL)
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")


class PresetError(ValueError):
    """A preset file that cannot be read; the message names the file, the field and the value."""


@dataclass(frozen=True)
class Preset:
    """A scheme served under a name: a built-in (``source='built-in'``) or a YAML file."""

    name: str
    scheme: Scheme
    source: str = "built-in"
    description: str = ""
    provenance: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_layers(self) -> int | None:
        """The model's layer count its tuning run recorded (``provenance.num_layers``), else None.
        What :meth:`Scheme.bits_per_element` needs to weigh per-layer overrides."""
        n = self.provenance.get("num_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def _fail(path: str, msg: str) -> PresetError:
    return PresetError(f"{path}: {msg}")


def _parse_overrides(path: str, items: Any) -> tuple[LayerOverride, ...]:
    if not isinstance(items, list):
        raise _fail(path, f"layers must be a list of overrides, got {items!r}")
    out = []
    for i, item in enumerate(items):
        where = f"layers[{i}]"
        if not isinstance(item, dict):
            raise _fail(path, f"{where} must be a mapping, got {item!r}")
        unknown = set(item) - {"layers", "key_bits", "value_bits", "unquantized"}
        if unknown:
            raise _fail(
                path, f"{where} has unknown keys {sorted(unknown)}; allowed: layers, key_bits, value_bits, unquantized"
            )
        m = _RANGE_RE.fullmatch(str(item.get("layers", "")))
        if m is None:
            raise _fail(path, f"{where}.layers={item.get('layers')!r} must be a layer index or a range like '0-3'")
        first, last = int(m[1]), int(m[2] or m[1])
        try:
            if item.get("unquantized", False) is True:
                if "key_bits" in item or "value_bits" in item:
                    raise SchemeError("unquantized layers take no key_bits/value_bits")
                out.append(LayerOverride(first, last))
            else:
                out.append(LayerOverride(first, last, item.get("key_bits"), item.get("value_bits")))
        except SchemeError as e:
            raise _fail(path, f"{where}: {e}") from None
    return tuple(out)


def preset_from_dict(data: dict[str, Any], path: str = "<dict>") -> Preset:
    """Validate a preset mapping (schema version 2 or 1) and build the :class:`Preset`."""
    unknown = sorted(set(data) - set(_ALLOWED_KEYS) - set(_IGNORED))
    if unknown:
        raise _fail(path, f"unknown key(s) {unknown}; allowed: {', '.join(_ALLOWED_KEYS)}")
    missing = [k for k in ("version", "name", *_SCHEME_FIELDS) if k not in data]
    if missing:
        raise _fail(path, f"missing required field(s) {missing}")
    version = data["version"]
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise _fail(path, f"version={version!r} is not supported; allowed: {', '.join(map(str, SUPPORTED_VERSIONS))}")
    optional = {**_VERSION_DEFAULTS.get(version, {}), **{k: data[k] for k in _OPTIONAL_SCHEME_FIELDS if k in data}}
    name = data["name"]
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise _fail(path, f"name={name!r} must match [A-Za-z0-9_.-]+")
    try:
        scheme = Scheme(
            **{k: data[k] for k in _SCHEME_FIELDS},
            **optional,
            overrides=_parse_overrides(path, data.get("layers", [])),
        )
    except SchemeError as e:
        raise _fail(path, str(e)) from None
    except TypeError as e:
        raise _fail(path, f"bad field type: {e}") from None
    if name.startswith("kvarn_k"):
        try:
            canonical = Scheme.from_name(name)
        except SchemeError:
            canonical = None
        if canonical is not None and canonical != scheme:
            raise _fail(
                path, f"name {name!r} is the canonical name of another scheme; this file describes {scheme.name!r}"
            )
    if not isinstance(data.get("provenance", {}), dict):
        raise _fail(path, "provenance must be a mapping")
    return Preset(
        name=name,
        scheme=scheme,
        source=path,
        description=str(data.get("description", "")),
        provenance=dict(data.get("provenance", {})),
    )


def load_preset(path: str | os.PathLike[str]) -> Preset:
    """Read one preset YAML file. Raises :class:`PresetError` (file, field, value, allowed values)."""
    p = str(path)
    try:
        with open(p, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise PresetError(f"{p}: no such preset file") from None
    except (yaml.YAMLError, ValueError, OSError) as e:
        raise _fail(p, f"not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise _fail(p, f"a preset must be a YAML mapping, got {type(raw).__name__} {raw!r:.80}")
    try:
        data = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except (OmegaConfBaseException, ValueError) as e:
        raise _fail(p, f"not a valid preset mapping: {e}") from None
    assert isinstance(data, dict)
    return preset_from_dict({str(k): v for k, v in data.items()}, p)


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """The YAML mapping of a preset; ``preset_from_dict(preset_to_dict(p)) == p``."""
    s = preset.scheme
    data: dict[str, Any] = {"version": SCHEMA_VERSION, "name": preset.name}
    data.update({k: getattr(s, k) for k in _SCHEME_FIELDS})
    data.update({k: getattr(s, k) for k in _OPTIONAL_SCHEME_FIELDS})  # always written: defaults can change
    if s.overrides:
        data["layers"] = [
            {"layers": f"{o.first}-{o.last}", "unquantized": True}
            if o.unquantized
            else {"layers": f"{o.first}-{o.last}", "key_bits": o.key_bits, "value_bits": o.value_bits}
            for o in s.overrides
        ]
    if preset.description:
        data["description"] = preset.description
    if preset.provenance:
        data["provenance"] = preset.provenance
    return data


def save_preset(preset: Preset, path: str | os.PathLike[str]) -> Path:
    """Write a preset YAML atomically (temp file + rename); returns the path written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(OmegaConf.create(preset_to_dict(preset)))
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
