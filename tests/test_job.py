"""`make run`'s serve step serves the file its tune step wrote (vLLM replaced by a recorder)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.config import derived_name
from kvarn.job import serve, steps, tune
from kvarn.schemes import Preset, Scheme, save_preset

NAME = "kvarn_smollm2_135m_1pct"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """The presets handed to vLLM, in order; the user preset folder, KVARN_PRESET_PATH and the
    torch thread count (the tune step sets it) restored after the test."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KVARN_PRESET_PATH", "")  # restored after the test: the serve step sets it
    calls: list[str] = []

    def fake_vllm(argv: Sequence[str], summary: dict[str, str] | None = None) -> int:
        calls.append(argv[argv.index("--preset") + 1])
        return 0

    monkeypatch.setattr(serve, "main", fake_vllm)
    yield calls
    torch.set_num_threads(threads)


def _tune_writes(monkeypatch: pytest.MonkeyPatch, scheme: Scheme | None) -> None:
    """The tune step's kvarn-tune replaced: writes ``scheme`` under the name the real run derives."""

    def fake_tune(model: str, budget: str, out: str | None = None) -> str | None:
        if scheme is None:
            return None
        assert out is not None
        name = derived_name(model, parse_budget(budget))
        prov = {"budget": budget, "scheme": scheme.name, "bits_per_element": 3.25, "heldout": {"kl": 0.0071},
                "heldout_docs": ["python-docs:1/2"]}  # fmt: skip
        save_preset(Preset(name, scheme, provenance=prov), Path(out) / f"{name}.yaml")
        return name

    monkeypatch.setattr(tune, "tune_default", fake_tune)


def test_serve_step_serves_the_file_the_tune_step_wrote_by_its_name(
    served: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tune_writes(monkeypatch, Scheme(3, 2, 64))
    args = argparse.Namespace(model="smollm2-135m", threads=1)
    run = steps.JobRun()
    assert steps.step_tune(args, run) == 0 and steps.step_serve(args, run) == 0
    written = derived_name("smollm2-135m", parse_budget(tune.BUDGET))
    assert served == [written]
    tuned = tmp_path / "config" / "kvarn" / "presets" / f"{written}.yaml"
    out = capsys.readouterr().out
    assert f"serving {written} from {tuned}" in out
    assert "3.250 bits/element" in out and "held-out KL 0.0071 on python-docs:1/2" in out
    assert str(tuned) in run.summary["serve"]


def test_a_failed_tune_step_is_reported_and_the_builtin_served(
    served: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The committed preset stands in only for a skipped tune step, never for a failed one."""
    _tune_writes(monkeypatch, None)
    args = argparse.Namespace(model="smollm2-135m", threads=1)
    run = steps.JobRun()
    assert steps.step_tune(args, run) == 1 and steps.step_serve(args, run) == 0
    assert served == ["kvarn_k4v2_g128"]
    assert "wrote no preset" in capsys.readouterr().out


def test_skipped_tune_step_serves_the_committed_preset_unless_shadowed(
    served: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No tune step: docs/tuned's file is served only if its name resolves to it."""
    args = argparse.Namespace(model="smollm2-135m", threads=1)
    assert steps.step_serve(args, steps.JobRun()) == 0
    committed = Path(steps.__file__).resolve().parents[2] / "docs" / "tuned" / f"{NAME}.yaml"
    assert served == [NAME] and f"serving {NAME} from {committed}" in capsys.readouterr().out
    # an earlier run's tuned file of that name in the user folder wins the lookup: not served as docs/tuned's
    save_preset(Preset(NAME, Scheme(3, 2, 64)), tmp_path / "config" / "kvarn" / "presets" / f"{NAME}.yaml")
    served.clear()
    assert steps.step_serve(args, steps.JobRun()) == 0
    assert served == ["kvarn_k4v2_g128"]
    assert f"not serving {NAME}: the name resolves to" in capsys.readouterr().out


def test_sample_prompt_reaches_past_the_first_tile() -> None:
    prompt = serve.sample_prompt()
    assert prompt.startswith("                    GNU GENERAL PUBLIC LICENSE")
    assert len(prompt) >= 4 * 300  # 432 SmolLM2 tokens; English text has under 4.5 characters a token
