"""Random YAML presets through the preset loader, random names through the scheme name parser,
the registry and the vLLM plugin's dtype lookup.

A preset is drawn field by field, each field either valid or broken (a wrong type, a huge or
negative number, an unknown word), with optional per-layer overrides and unknown keys. It loads, and
then its scheme round-trips through its name and through YAML, or it raises ``PresetError`` naming
something the draw broke.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvarn.schemes import UnknownSchemeError, get_preset
from kvarn.schemes.presets import PresetError, load_preset, preset_from_dict, preset_to_dict
from kvarn.schemes.scheme import (
    ALLOWED_BITS,
    ALLOWED_GROUP_SIZES,
    ALLOWED_ROTATIONS,
    ALLOWED_SCALE_DTYPES,
    ALLOWED_SINK_TOKENS,
    MAX_NORM_ITERS,
    Scheme,
    SchemeError,
)

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans()
)
JUNK = st.one_of(NUMBERS, st.none(), st.text(max_size=12), st.lists(st.integers(), max_size=3))
VALID: dict[str, st.SearchStrategy[Any]] = {
    "version": st.sampled_from((1, 2)),
    "key_bits": st.sampled_from(ALLOWED_BITS),
    "value_bits": st.sampled_from(ALLOWED_BITS),
    "group_size": st.sampled_from(ALLOWED_GROUP_SIZES),
    "rotation": st.sampled_from(ALLOWED_ROTATIONS),
    "norm_iters": st.integers(0, MAX_NORM_ITERS),
    "scale_dtype": st.sampled_from(ALLOWED_SCALE_DTYPES),
    "sink_tile": st.just(False),
    "sink_tokens": st.sampled_from(ALLOWED_SINK_TOKENS),
    "name": st.from_regex(r"[a-z][a-z0-9_.\-]{0,20}", fullmatch=True).filter(lambda s: not s.startswith("kvarn_k")),
}
LAYER_KEYS = ("layers", "key_bits", "value_bits", "unquantized")


@st.composite
def overrides(draw: st.DrawFn) -> tuple[list[Any], set[str]]:
    """A ``layers:`` list and the words an error about it may name ({} when every item is valid)."""
    items: list[Any] = []
    suspects: set[str] = set()
    nxt = 0
    for i in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 5)) == 0:  # a broken item: any junk, an unknown key, a bad range
            item = draw(st.one_of(JUNK, st.dictionaries(st.sampled_from((*LAYER_KEYS, "bits", "x")), JUNK)))
            suspects |= {"layers", f"layers[{i}]"}
        else:
            first = nxt + draw(st.integers(0, 3))
            last = first + draw(st.integers(0, 3))
            nxt = last + 1
            rng: Any = f"{first}-{last}" if last > first else first
            if draw(st.booleans()):
                item = {"layers": rng, "unquantized": True}
            else:
                item = {"layers": rng, "key_bits": draw(VALID["key_bits"]), "value_bits": draw(VALID["value_bits"])}
        items.append(item)
    return items, suspects


@st.composite
def preset_data(draw: st.DrawFn) -> tuple[Any, set[str]]:
    """A preset mapping (or junk) and the words an error about it may name (empty: all valid)."""
    if draw(st.integers(0, 20)) == 0:
        return draw(JUNK), {"mapping"}
    data: dict[str, Any] = {}
    suspects: set[str] = set()
    for key, valid in VALID.items():
        roll = draw(st.integers(0, 24))
        if roll == 0 and key != "sink_tokens":  # a required field left out
            suspects |= {key, "missing"}
            continue
        if roll == 1:
            data[key] = draw(JUNK)
            suspects.add(key)
        else:
            data[key] = draw(valid)
    if draw(st.integers(0, 3)) == 0:
        data["layers"], bad = draw(overrides())
        suspects |= bad | {"overlap"}  # valid ranges drawn in order do not overlap; junk ones may
    if draw(st.integers(0, 10)) == 0:
        key = draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in VALID and k not in ("layers",)))
        data[key] = draw(JUNK)
        suspects |= {"unknown", key}
    if draw(st.integers(0, 10)) == 0:
        data["sink_tile"], data["sink_tokens"] = True, draw(st.sampled_from((2, 4, 8)))
        suspects |= {"sink_tile", "sink_tokens"}
    return data, suspects


def _check_loaded_or_named(path: Path, data: Any, suspects: set[str]) -> None:
    try:
        p = load_preset(path)
    except PresetError as e:
        msg = str(e)
        assert suspects, f"a valid preset was refused: {msg}\n{data!r}"
        assert msg.startswith(str(path)), msg
        assert any(s in msg for s in suspects), f"{msg!r} names none of {sorted(suspects)}"
        return
    assert isinstance(data, dict)
    s = p.scheme
    assert Scheme.from_name(s.name) == s
    assert preset_from_dict(preset_to_dict(p), str(path)) == p
    for key in ("key_bits", "value_bits", "group_size", "rotation", "norm_iters", "scale_dtype", "sink_tile"):
        assert getattr(s, key) == data[key], key


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every case of a test (a case overwrites the file of the one before)."""
    return tmp_path_factory.mktemp("presets")


@given(preset_data())
def test_random_yaml_presets_load_or_name_the_bad_field(folder: Path, drawn: tuple[Any, set[str]]) -> None:
    data, suspects = drawn
    path = folder / "p.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    _check_loaded_or_named(path, data, suspects)


@given(st.text(max_size=200))
def test_random_text_as_a_preset_file_is_refused_with_the_file_named(folder: Path, text: str) -> None:
    path = folder / "text.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))  # lone surrogates: bytes that are not UTF-8
    try:
        load_preset(path)
    except PresetError as e:
        assert str(e).startswith(str(path)), str(e)
    else:  # only a text that happens to be a complete preset loads
        assert "version" in text and "name" in text


SUFFIXES = ("_rot-none", "_rot-rh", "_it0", "_it8", "_it33", "_s8", "_sink", "_sink0", "_sink1", "_sink3", "_L0k4v2")
NAMES = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda k, v, g, rest: f"kvarn_k{k}v{v}_g{g}{''.join(rest)}",
        st.integers(-3, 12),
        st.integers(-3, 12),
        st.sampled_from((0, 16, 32, 64, 128, 256, 512, 10**30)),
        st.lists(
            st.one_of(
                st.sampled_from(SUFFIXES),
                st.builds(
                    lambda a, b, k: f"_L{a}{'' if b is None else f'-{b}'}{k}",
                    st.integers(0, 2**40),
                    st.none() | st.integers(0, 2**40),
                    st.sampled_from(("k4v2", "k8v8", "fp16", "k5v2", "")),
                ),
            ),
            max_size=4,
        ),
    ),
)


@given(NAMES)
def test_random_scheme_names_parse_canonically_or_name_the_input(name: str) -> None:
    try:
        s = Scheme.from_name(name)
    except SchemeError as e:
        assert repr(name) in str(e) or any(part in str(e) for part in ("layer range", "overlap", "=")), str(e)
        return
    assert Scheme.from_name(s.name) == s
    assert name in (s.name, s.name.replace("_sink", "_sink1", 1)) or name.replace("_sink1", "", 1) == s.name


@given(NAMES)
def test_random_names_through_the_registry_and_the_vllm_dtype_lookup(name: str) -> None:
    from kvarn.vllm.registry import KvarnDtypes

    dtypes = KvarnDtypes()
    for lookup in (lambda n: get_preset(n, dirs=[]).scheme, dtypes.scheme):
        try:
            s = lookup(name)
        except UnknownSchemeError as e:
            assert repr(name) in str(e), str(e)
        except PresetError as e:  # a name that looks like a path to a YAML file
            assert name in str(e), str(e)
        else:
            assert Scheme.from_name(s.name) == s
    assert dtypes.is_kvarn(name) == (name.startswith("kvarn_") or name in dtypes.schemes)
