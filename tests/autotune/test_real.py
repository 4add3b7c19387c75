"""A small real tuning run on SmolLM2-135M (decode-mode harness): the preset loads by name and meets
its budget on the held-out text the search never saw."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("kvarn.eval.harness")


@pytest.mark.slow
def test_small_real_run_writes_loadable_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.autotune.cli import main
    from kvarn.schemes import get_preset

    out = tmp_path / "presets"
    # documents of 256 tokens hold two 128-token chunks each, too few for a useful bootstrap interval, so
    # this small run decides on the point estimate; the full-size runs are in docs/tuning.md
    rc = main(
        ["--model", "smollm2-135m", "--budget", "kl=0.02", "--tokens", "512", "--strategy", "ladder",
         "--feasibility", "point", "--group-sizes", "64", "--confirm", "2", "--no-compare-builtin",
         "--name", "real_small", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    )  # fmt: skip
    assert rc == 0
    monkeypatch.setenv("KVARN_PRESET_PATH", str(out))
    p = get_preset("real_small")
    prov = p.provenance
    assert prov["meets_budget_on_heldout"] is True
    assert prov["heldout"]["kl"] <= 0.02 and prov["calibration"]["kl"] <= 0.02
    # two calibration documents of two kinds, two held-out ones of a third, 256 tokens each
    assert prov["split"] == "documents" and prov["tokens"] == 512
    assert prov["heldout"]["tokens"] == 512 and prov["calibration"]["tokens"] == 512
    assert "kvarn-code" in prov["text"] and "python-docs" in prov["text"]
    assert prov["bits_context"] == 256  # a sink is priced over one document's tokens
    assert prov["bits_per_element"] == pytest.approx(p.scheme.bits_per_element(64, 30, context=256), abs=1e-6)
    assert prov["bits_per_element"] < 16.0
    lo, hi = prov["heldout_interval"]  # the interval is still measured and recorded
    assert lo <= prov["heldout"]["kl"] <= hi
