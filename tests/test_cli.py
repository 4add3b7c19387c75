"""`kvarn presets`: the table and the JSON the README's figures come from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvarn.cli import main


def test_presets_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets", "--json", "--head-dim", "128"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    ref = by_name["kvarn_k4v2_g128"]
    assert {"name", "key_bits", "value_bits", "group_size", "bits_per_element", "compression"} <= set(ref)
    assert ref["bits_per_element"] == pytest.approx(3.375)  # the packed tiles
    assert ref["sink_tokens"] == 1 and ref["context"] == 8192
    assert ref["bits_per_element_at_context"] == pytest.approx(3.375 + 16 / 8192)  # + the exact first token
    assert ref["compression"] == pytest.approx(4.7407, rel=1e-4)
    assert by_name["kvarn_k4v2_g128_s8"]["bits_per_element"] < 3.375


def test_presets_table_and_user_preset(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "mine.yaml").write_text(
        "version: 1\nname: mine\nkey_bits: 8\nvalue_bits: 8\ngroup_size: 32\nrotation: none\n"
        "norm_iters: 0\nscale_dtype: fp16\nsink_tile: false\n"
    )
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    assert main(["presets", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "kvarn_k4v2_g128" in out and "3.5625" in out and "mine" in out


def test_console_script_bad_head_dim() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvarn.cli", "presets", "--head-dim", "96"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "invalid choice: 96" in r.stderr


def test_presets_warns_for_bad_files_and_strict_fails(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "my_k5.yaml").write_text(
        "version: 1\nname: my_k5\nkey_bits: 5\nvalue_bits: 2\ngroup_size: 128\nrotation: hadamard\n"
        "norm_iters: 8\nscale_dtype: fp16\nsink_tile: false\n"
    )
    (tmp_path / "junk.yaml").write_text("name: [unclosed\n")
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    assert main(["presets"]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'my_k5.yaml'}: key_bits=5 is not allowed; allowed: 2, 3, 4, 8" in err
    assert f"{tmp_path / 'junk.yaml'}: not valid YAML" in err
    assert main(["presets", "--json", "--strict"]) == 1
    assert "my_k5.yaml" in capsys.readouterr().err
    (tmp_path / "my_k5.yaml").unlink()
    (tmp_path / "junk.yaml").unlink()
    assert main(["presets", "--strict"]) == 0


def test_presets_warns_for_a_name_clash_and_strict_fails(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    body = "version: 1\nname: twice\nkey_bits: {}\nvalue_bits: 2\ngroup_size: 128\nrotation: hadamard\n"
    body += "norm_iters: 8\nscale_dtype: fp16\nsink_tile: false\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "twice.yaml").write_text(body.format(3))
    (tmp_path / "b" / "twice.yaml").write_text(body.format(4))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KVARN_PRESET_PATH", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert main(["presets"]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a' / 'twice.yaml'} is used" in err and f"{tmp_path / 'b' / 'twice.yaml'} ignored" in err
    assert main(["presets", "--json", "--strict"]) == 1


def test_presets_json_averages_per_layer_presets_as_the_tuner_did(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """docs/tuned's preset: the tuner's own figure (provenance, at its 2048 tokens) and every layer."""
    tuned = Path(__file__).resolve().parents[1] / "docs" / "tuned"
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tuned))
    assert main(["presets", "--json", "--head-dim", "64", "--context", "2048"]) == 0
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["kvarn_smollm2_135m_1pct"]
    provenance = yaml.safe_load((tuned / "kvarn_smollm2_135m_1pct.yaml").read_text())["provenance"]
    assert row["num_layers"] == provenance["num_layers"] == 30
    assert row["bits_per_element_at_context"] == pytest.approx(provenance["bits_per_element"], abs=1e-6)
    layers = row["layers"]
    assert [x["layer"] for x in layers] == list(range(30))
    assert [(x["key_bits"], x["value_bits"]) for x in layers[:2]] == [(2, 2), (4, 2)]  # L0k2v2, then the base
    assert [(x["key_bits"], x["value_bits"]) for x in layers[17:19]] == [(4, 3), (4, 3)]  # L17-18k4v3
    mean = sum(x["bits_per_element"] for x in layers) / 30
    assert row["bits_per_element"] == pytest.approx(mean) and row["bits_per_element"] < 3.2  # base layers: 3.23
    assert row["overrides"][0] == {"first": 0, "last": 0, "key_bits": 2, "value_bits": 2}


def test_presets_without_a_layer_count_say_so_and_take_num_layers(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "hand.yaml").write_text(
        "version: 2\nname: hand\nkey_bits: 4\nvalue_bits: 2\ngroup_size: 128\nrotation: hadamard\n"
        "norm_iters: 8\nscale_dtype: fp16\nsink_tile: false\nlayers:\n  - {layers: 3, unquantized: true}\n"
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path))
    assert main(["presets", "--json", "--head-dim", "128"]) == 0
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["hand"]
    assert row["num_layers"] is None and row["layers"] is None and row["bits_per_element"] == pytest.approx(3.375)
    assert main(["presets", "--json", "--head-dim", "128", "--num-layers", "4"]) == 0
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["hand"]
    assert row["bits_per_element"] == pytest.approx((3 * 3.375 + 16) / 4)
    assert row["layers"][3] == {
        "layer": 3,
        "key_bits": None,
        "value_bits": None,
        "unquantized": True,
        "bits_per_element": 16.0,
        "bits_per_element_at_context": 16.0,
    }
    assert main(["presets", "--head-dim", "128"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("hand ")]
    assert line.split()[5:7] == ["?", "3.3750"]
    assert main(["presets", "--num-layers", "0"]) == 2


def test_subcommand_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kvarn.eval.cli")
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "greedy continuation (0: none) (default: 256)" in text and "(default: None)" not in text
