"""YAML presets and the registry: round-trip, lookup, and every documented error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvarn.schemes import (
    BUILTINS,
    LayerOverride,
    Preset,
    PresetError,
    Scheme,
    UnknownSchemeError,
    get_preset,
    list_presets,
    load_preset,
    preset_clashes,
    preset_problems,
    save_preset,
)
from kvarn.schemes.registry import bundled_preset_dir

GOOD = """\
version: 1
name: my_preset
key_bits: 3
value_bits: 2
group_size: 64
rotation: rhadamard
norm_iters: 4
scale_dtype: log8
sink_tile: true
layers:
  - {layers: "0-1", key_bits: 8, value_bits: 4}
  - {layers: 29, unquantized: true}
"""


def test_yaml_round_trip_is_lossless(tmp_path: Path) -> None:
    src = tmp_path / "a.yaml"
    src.write_text(GOOD)
    p = load_preset(src)
    assert p.name == "my_preset"
    assert p.scheme == Scheme(
        3, 2, 64, "rhadamard", 4, "log8", True, (LayerOverride(0, 1, 8, 4), LayerOverride(29, 29))
    )
    p2 = Preset(p.name, p.scheme, provenance={"model": "x", "kl": 0.01}, description="d")
    out = save_preset(p2, tmp_path / "sub" / "b.yaml")
    back = load_preset(out)
    assert back == Preset(p.name, p.scheme, source=str(out), description="d")
    assert back.provenance == {"model": "x", "kl": 0.01}


def test_bundled_yaml_files_match_builtins() -> None:
    files = sorted(bundled_preset_dir().glob("*.yaml"))
    assert files, "presets/ ships the built-ins as YAML"
    for f in files:
        p = load_preset(f)
        assert BUILTINS[p.name] == p.scheme


def test_lookup_by_builtin_name_path_dir_and_canonical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "x.yaml").write_text(GOOD)
    assert get_preset("kvarn_k4v2_g128").scheme == Scheme()
    assert get_preset(str(tmp_path / "x.yaml")).name == "my_preset"
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    assert get_preset("my_preset").scheme.key_bits == 3
    assert "my_preset" in [p.name for p in list_presets()]
    assert get_preset("kvarn_k3v3_g64_s8").scheme == Scheme(3, 3, 64, scale_dtype="log8")


def test_unknown_name_lists_valid_and_closest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    with pytest.raises(UnknownSchemeError) as e:
        get_preset("kvarn_k4v2_g12")
    msg = str(e.value)
    assert "kvarn_k4v4_g128" in msg and "Did you mean 'kvarn_k4v2_g128'" in msg


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (("key_bits: 3", "key_bits: 5"), ["key_bits=5", "allowed: 2, 3, 4, 8"]),
        (("group_size: 64", "group_size: 100"), ["group_size=100", "32, 64, 128, 256"]),
        (("norm_iters: 4", "norm_iters: -1"), ["norm_iters=-1", "0..32"]),
        (("sink_tile: true", "sink_tile: true\ncolour: red"), ["unknown key(s) ['colour']"]),
        (("version: 1", "version: 3"), ["version=3", "allowed: 1, 2"]),
        (("scale_dtype: log8\n", ""), ["missing required field(s) ['scale_dtype']"]),
        (("value_bits: 4}", "value_bits: 6}"), ["layers[0]", "value_bits=6"]),
        (("name: my_preset", "name: kvarn_k4v2_g128"), ["canonical name of another scheme"]),
        (("key_bits: 3", "key_bits: [3"), ["not valid YAML"]),
    ],
)
def test_bad_preset_files_name_file_field_value(tmp_path: Path, edit: tuple[str, str], needles: list[str]) -> None:
    f = tmp_path / "bad.yaml"
    assert edit[0] in GOOD
    f.write_text(GOOD.replace(edit[0], edit[1]))
    with pytest.raises(PresetError) as e:
        load_preset(f)
    msg = str(e.value)
    assert str(f) in msg
    for n in needles:
        assert n in msg


def test_missing_file() -> None:
    with pytest.raises(PresetError, match="no such preset file"):
        load_preset("/nonexistent/dir/p.yaml")


def test_sink_tokens_field_is_optional_and_round_trips(tmp_path: Path) -> None:
    s = Scheme(4, 2, 128, scale_dtype="log8", sink_tokens=2)
    out = save_preset(Preset("tuned_sink", s), tmp_path / "t.yaml")
    assert "sink_tokens: 2" in out.read_text()
    assert load_preset(out).scheme == s
    # omitted in version 2: the Scheme default (1 exact first token); a sink tile needs no copies (0)
    src = tmp_path / "old.yaml"
    v2 = GOOD.replace("version: 1", "version: 2")
    src.write_text(v2.replace("sink_tile: true", "sink_tile: false"))
    assert load_preset(src).scheme.sink_tokens == 1
    src.write_text(v2)
    assert load_preset(src).scheme.sink_tokens == 0
    # omitted in version 1 (written when no exact token was the default): 0, what the file meant then
    src.write_text(GOOD.replace("sink_tile: true", "sink_tile: false"))
    assert load_preset(src).scheme.sink_tokens == 0
    src.write_text(GOOD.replace("sink_tile: true", "sink_tile: false\nsink_tokens: 1"))
    assert load_preset(src).scheme.sink_tokens == 1
    # written always, in version 2, so a file means the same if the default changes again
    out = save_preset(Preset("no_sink", Scheme(sink_tokens=0)), tmp_path / "n.yaml")
    text = out.read_text()
    assert text.startswith("version: 2\n") and "sink_tokens: 0" in text
    assert load_preset(out).scheme == Scheme(sink_tokens=0)
    src.write_text(GOOD.replace("sink_tile: true", "sink_tile: false\nsink_tokens: 3"))
    with pytest.raises(PresetError, match="sink_tokens=3 is not allowed"):
        load_preset(src)


def test_preset_problems_name_each_bad_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "my_k5.yaml").write_text(
        GOOD.replace("name: my_preset", "name: my_k5").replace("key_bits: 3", "key_bits: 5")
    )
    (tmp_path / "broken.yml").write_text(
        GOOD.replace("name: my_preset", "name: my_broken").replace("key_bits: 3", "key_bits: [3")
    )
    problems = preset_problems([tmp_path])
    assert [p.path.name for p in problems] == ["broken.yml", "my_k5.yaml"]  # in file-name order
    broken, k5 = problems
    assert k5.names == ("my_k5",) and str(tmp_path / "my_k5.yaml") in str(k5)
    assert "key_bits=5" in str(k5) and "allowed: 2, 3, 4, 8" in str(k5)
    assert broken.names == ("my_broken", "broken") and "not valid YAML" in str(broken)
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    assert get_preset("my_preset").scheme.key_bits == 3  # the good file still loads
    with pytest.raises(UnknownSchemeError) as e:
        get_preset("my_k5")
    msg = str(e.value)
    assert "'my_k5' may be defined by a preset file that failed to load" in msg
    assert "key_bits=5" in msg and "not valid YAML" not in msg  # only the file that may define it
    with pytest.raises(UnknownSchemeError) as e:
        get_preset("nothing_like_it")
    assert "failed to load (skipped)" in str(e.value) and "my_k5.yaml" in str(e.value) and "broken.yml" in str(e.value)


def test_no_problems_in_bundled_presets() -> None:
    assert preset_problems([bundled_preset_dir()]) == []


def test_name_clash_warns_naming_both_files_and_the_user_folder_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The user preset folder (where kvarn-tune writes) wins over KVARN_PRESET_PATH (e.g. docs/tuned)."""
    user, shared = tmp_path / "config" / "kvarn" / "presets", tmp_path / "shared"
    user.mkdir(parents=True)
    shared.mkdir()
    (user / "tuned.yaml").write_text(GOOD.replace("key_bits: 3", "key_bits: 4"))
    (shared / "committed.yaml").write_text(GOOD)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KVARN_PRESET_PATH", str(shared))
    with caplog.at_level("WARNING", logger="kvarn.schemes.registry"):
        p = get_preset("my_preset")
        get_preset("my_preset")  # warned once per process, not per lookup
    assert p.scheme.key_bits == 4 and p.source == str(user / "tuned.yaml")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert f"{user / 'tuned.yaml'} is used" in warnings[0] and f"{shared / 'committed.yaml'} ignored" in warnings[0]
    (clash,) = preset_clashes()
    assert clash.name == "my_preset" and clash.winner == user / "tuned.yaml"
    assert clash.shadowed == (shared / "committed.yaml",)
    assert [q.source for q in list_presets() if q.name == "my_preset"] == [str(user / "tuned.yaml")]


def test_one_folder_listed_twice_is_no_clash(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text(GOOD)
    assert preset_clashes([tmp_path, tmp_path]) == []
    (tmp_path / "y.yaml").write_text(GOOD)  # two files in one folder do clash
    (clash,) = preset_clashes([tmp_path, tmp_path])
    assert (clash.winner.name, [f.name for f in clash.shadowed]) == ("x.yaml", ["y.yaml"])


def test_num_layers_comes_from_the_tuning_provenance(tmp_path: Path) -> None:
    assert Preset("p", Scheme(), provenance={"num_layers": 30}).num_layers == 30
    for bad in ({}, {"num_layers": "30"}, {"num_layers": 0}, {"num_layers": True}):
        assert Preset("p", Scheme(), provenance=bad).num_layers is None
    assert (
        load_preset(Path(__file__).resolve().parents[1] / "docs" / "tuned" / "kvarn_smollm2_135m_1pct.yaml").num_layers
        == 30
    )


def test_kernel_config_of_older_files_is_accepted_and_dropped(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(GOOD + "kernel_config: {decode: {BT: 16}}\n")
    p = load_preset(path)
    again = load_preset(save_preset(p, tmp_path / "again.yaml"))
    assert (again.name, again.scheme) == (p.name, p.scheme)
    assert "kernel_config" not in (tmp_path / "again.yaml").read_text()
