"""kvarn-tune's command line: bad arguments fail clearly; a run writes a preset that loads by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvarn.autotune.cli as cli
import kvarn.autotune.tuner as tuner
from kvarn.schemes import get_preset

from .conftest import HEAD_DIM, NUM_LAYERS, FakeFactory, sample_text


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFactory:
    f = FakeFactory()
    monkeypatch.setattr(cli, "model_dims", lambda model: (NUM_LAYERS, HEAD_DIM))
    monkeypatch.setattr(tuner, "harness_factory", lambda config: f)
    return f


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--budget", "0%"], "must be positive"),
        (["--budget", "lots"], "not understood"),
        (["--budget", "-1%"], "--budget '-1%': a budget must be positive"),  # not read as an option
        (["--budget=-1%"], "--budget '-1%': a budget must be positive"),
        (["--budget", "-.5%"], "must be positive"),
        (["--budget", "kl=-0.01"], "must be positive"),
        (
            ["--budget", "150%"],
            "--budget '150%': a perplexity budget is an increase in percent above 0% and at most 100%",
        ),
        (["--budget", "ppl=100.5%"], "at most 100%"),
        (["--budget", "1%", "--trials", "0"], "--trials 0"),
        (["--budget", "1%", "--holdout", "1.5"], "--holdout"),
        (["--budget", "1%", "--group-sizes", "48"], "allowed 32, 64, 128, 256"),
        (["--budget", "1%", "--text", "/nonexistent/file.txt"], "--text"),
        (["--budget", "1%", "--model", "/nonexistent/model"], "neither a built-in alias"),
        (["--budget", "1%", "--device", "tpu"], "device='tpu' is not supported; allowed: cpu, cuda"),
    ],
)
def test_bad_arguments(args: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args) == 1
    assert match in capsys.readouterr().err


def test_unwritable_output_fails_before_searching(
    tmp_path: Path, fake: FakeFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert cli.main(["--budget", "1%", "--out", str(blocker / "presets")]) == 1
    assert "cannot write presets to --out" in capsys.readouterr().err
    assert fake.made == []  # nothing was evaluated


def _run(tmp_path: Path, *extra: str) -> list[str]:
    text = tmp_path / "calib.txt"
    text.write_text(sample_text())
    return [
        "--budget", "1%", "--text", str(text), "--trials", "12", "--seed", "1", "--out", str(tmp_path / "presets"),
        "--cache-dir", str(tmp_path / "cache"), "--quiet", *extra,
    ]  # fmt: skip


def test_run_writes_preset_that_loads_by_name(
    tmp_path: Path, fake: FakeFactory, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(_run(tmp_path, "--name", "my_tuned")) == 0
    out = capsys.readouterr().out
    assert "winner" in out and "OK:" in out
    monkeypatch.setenv("KVARN_PRESET_PATH", str(tmp_path / "presets"))
    p = get_preset("my_tuned")
    prov = p.provenance
    assert prov["model"] == "smollm2-135m" and prov["budget"] == "1%" and prov["metric"] == "ppl"
    assert prov["heldout"]["delta_ppl_pct"] <= 1.0 and prov["meets_budget_on_heldout"] is True
    bits = p.scheme.bits_per_element(HEAD_DIM, NUM_LAYERS, context=prov["bits_context"])
    assert prov["bits_per_element"] == pytest.approx(bits, abs=1e-6)
    assert len(prov["text_sha256"]) == 64 and prov["kvarn_version"] and prov["date"].startswith("20")
    assert set(prov["calibration"]) >= {"ppl", "delta_ppl_pct", "kl"}
    assert (tmp_path / "presets" / "my_tuned.png").stat().st_size > 1000


def test_default_run_tunes_a_kl_budget_on_documents_of_kinds_it_names(
    tmp_path: Path, fake: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --budget, no --text: kl=0.01 on the default documents, which the provenance names."""
    out = tmp_path / "presets"
    args = ["--strategy", "ladder", "--tokens", "1024", "--out", str(out), "--cache-dir", str(tmp_path), "--quiet"]
    assert cli.main(args) == 0
    monkeypatch.setenv("KVARN_PRESET_PATH", str(out))
    prov = get_preset("kvarn_smollm2_135m_kl0p01").provenance
    assert prov["budget"] == "kl=0.01" and prov["metric"] == "kl" and prov["heldout"]["kl"] <= 0.01
    assert prov["split"] == "documents" and prov["calibration_docs"] == ["gpl-3", "kvarn-code"]
    assert prov["heldout_docs"] == ["python-docs:1/2", "python-docs:2/2"] and "python-docs" in prov["text"]
    calib, held = fake.made
    assert "GNU GENERAL PUBLIC LICENSE" in calib.text and "GNU GENERAL PUBLIC LICENSE" not in held.text


def test_json_and_unreachable_budget(tmp_path: Path, fake: FakeFactory, capsys: pytest.CaptureFixture[str]) -> None:
    args = _run(tmp_path, "--json", "--no-per-layer", "--trials", "4")
    args[1] = "0.001%"
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["exit_code"] == 2 and data["winner"] is None and data["presets"] == []
    assert data["closest"]["scheme"].startswith("kvarn_")
    assert "unreachable" in captured.err and "closest trade-off" in captured.err
    assert not list((tmp_path / "presets").glob("*.yaml"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_fails_before_searching(fake: FakeFactory, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--budget", "1%", "--device", "cuda"]) == 1
    assert "sees no CUDA device" in capsys.readouterr().err
    assert fake.made == []


def test_device_and_dtype_reach_the_evaluators_and_provenance(
    tmp_path: Path, fake: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []

    def spy(config: tuner.TuneConfig) -> FakeFactory:
        seen.append((config.device, config.dtype))
        return fake

    monkeypatch.setattr(tuner, "harness_factory", spy)
    assert cli.main(_run(tmp_path, "--name", "bf16_tuned", "--dtype", "bfloat16")) == 0
    assert seen == [("cpu", "bfloat16")]
    prov = get_preset(str(tmp_path / "presets" / "bf16_tuned.yaml")).provenance
    assert (prov["device"], prov["dtype"]) == ("cpu", "bfloat16")


def test_intervals_in_table_and_provenance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = FakeFactory(ci_halfwidth=0.2)
    monkeypatch.setattr(cli, "model_dims", lambda model: (NUM_LAYERS, HEAD_DIM))
    monkeypatch.setattr(tuner, "harness_factory", lambda config: f)
    assert cli.main(_run(tmp_path, "--name", "ci_tuned")) == 0
    out = capsys.readouterr().out
    assert "calib 90% CI" in out and "upper end of the 90% CI" in out
    prov = get_preset(str(tmp_path / "presets" / "ci_tuned.yaml")).provenance
    lo, hi = prov["calibration_interval"]
    assert prov["feasibility"] == "bound" and lo < prov["calibration"]["delta_ppl_pct"] < hi <= 1.0
    assert prov["heldout_interval"][0] < prov["heldout"]["delta_ppl_pct"] < prov["heldout_interval"][1]
    assert f"[{lo:.3g}, {hi:.3g}]" in out


@pytest.mark.parametrize(
    ("budget", "metric", "limit"),
    [
        ("1%", "ppl", 1.0),
        ("ppl=1%", "ppl", 1.0),
        ("100%", "ppl", 100.0),
        ("kl=0.01", "kl", 0.01),
        ("greedy=200", "greedy", 200.0),
    ],
)
def test_documented_budget_forms_are_accepted(budget: str, metric: str, limit: float) -> None:
    config = cli._config(cli.build_parser().parse_args(["--budget", budget]))
    assert isinstance(config, tuner.TuneConfig)
    assert (config.budget.metric, config.budget.limit) == (metric, limit)


def test_help_shows_defaults_and_says_vllm_serves_fp16_layers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "measured trials at most (resumed ones included); pruned-unmeasured trials are free (default: 30)" in text
    assert "allocate (default)" in text
    assert "(default: 0,1,2,4,tile)" in text and "(default: 256)" in text and "(default: smollm2-135m)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "vLLM serves them in its own 16-bit cache" in text
    assert "cannot serve" not in text and "not served" not in text


def test_ctrl_c_in_the_study_prints_one_line_with_the_resume_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "model_dims", lambda model: (NUM_LAYERS, HEAD_DIM))
    monkeypatch.setattr(tuner, "harness_factory", lambda config: FakeFactory(interrupt_after=5))
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    assert cli.main(_run(tmp_path, "--storage", storage, "--sensitivity-tokens", "0")) == 130
    out, err = capfd.readouterr()
    assert out == "" and "Traceback" not in err and "KeyboardInterrupt" not in err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line.startswith("kvarn-tune: interrupted after ") and f"rerun with the same --storage ({storage})" in line


def test_ctrl_c_outside_the_study_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "model_dims", lambda model: (NUM_LAYERS, HEAD_DIM))
    monkeypatch.setattr(cli, "tune", interrupted)
    assert cli.main(["--budget", "1%", "--quiet"]) == 130
    out, err = capfd.readouterr()
    assert out == "" and err == (
        "kvarn-tune: interrupted; nothing to resume (no --storage); pass --storage sqlite:///kvarn-tune.db "
        "to make a run resumable\n"
    )
