"""`make run`'s serve step serves the file its tune step wrote (vLLM replaced by a recorder)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pytest

import kvarn.run as run
import kvarn.run_tune as run_tune
import kvarn.run_vllm as run_vllm
from kvarn.schemes import Preset, Scheme, save_preset

NAME = "kvarn_smollm2_135m_1pct"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The presets handed to vLLM, in order; the user preset folder and KVARN_PRESET_PATH isolated."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KVARN_PRESET_PATH", "")  # restored after the test: the serve step sets it
    monkeypatch.setattr(run, "_TUNED", [])
    monkeypatch.setattr(run, "_SUMMARY", {})
    calls: list[str] = []

    def fake_vllm(argv: Sequence[str], summary: dict[str, str] | None = None) -> int:
        calls.append(argv[argv.index("--preset") + 1])
        return 0

    monkeypatch.setattr(run_vllm, "main", fake_vllm)
    return calls


def _tune_writes(monkeypatch: pytest.MonkeyPatch, scheme: Scheme | None) -> None:
    def fake_tune(model: str, budget: str, out: str | None = None) -> str | None:
        if scheme is None:
            return None
        assert out is not None
        save_preset(Preset(NAME, scheme), Path(out) / f"{NAME}.yaml")
        return NAME

    monkeypatch.setattr(run_tune, "tune_default", fake_tune)


def test_serve_step_serves_the_tuned_file_and_names_it(
    served: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tune_writes(monkeypatch, Scheme(3, 2, 64))
    args = argparse.Namespace(model="smollm2-135m")
    assert run.step_tune(args) == 0 and run.step_serve(args) == 0
    assert served == [NAME]
    tuned = tmp_path / "config" / "kvarn" / "presets" / f"{NAME}.yaml"
    assert f"serving {NAME} from {tuned}" in capsys.readouterr().out
    assert str(tuned) in run._SUMMARY["serve"]


def test_serve_step_skips_a_committed_preset_shadowed_by_another_file(
    served: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No preset tuned this run: docs/tuned's file is served only if its name resolves to it."""
    _tune_writes(monkeypatch, None)
    args = argparse.Namespace(model="smollm2-135m")
    assert run.step_tune(args) == 0 and run.step_serve(args) == 0
    committed = Path(run.__file__).resolve().parents[1] / "docs" / "tuned" / f"{NAME}.yaml"
    assert served == [NAME] and f"serving {NAME} from {committed}" in capsys.readouterr().out
    # an earlier run's tuned file of that name in the user folder wins the lookup: not served as docs/tuned's
    save_preset(Preset(NAME, Scheme(3, 2, 64)), tmp_path / "config" / "kvarn" / "presets" / f"{NAME}.yaml")
    served.clear()
    assert run.step_serve(args) == 0
    assert served == ["kvarn_k4v2_g128"]
    assert f"not serving {NAME}: the name resolves to" in capsys.readouterr().out


def test_sample_prompt_reaches_past_the_first_tile() -> None:
    prompt = run_vllm.sample_prompt()
    assert prompt.startswith("                    GNU GENERAL PUBLIC LICENSE")
    assert len(prompt) >= 4 * 300  # 432 SmolLM2 tokens; English text has under 4.5 characters a token
