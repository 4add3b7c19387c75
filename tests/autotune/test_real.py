"""A small real tuning run on SmolLM2-135M (decode-mode harness): the preset loads by name, meets
its budget on the held-out document the search never saw, and measures by its name what its
provenance says it measured."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("kvarn.eval.harness")

HELDOUT = "python-docs:2/2"


@pytest.mark.slow
def test_small_real_run_writes_loadable_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.autotune.cli import main
    from kvarn.autotune.corpus import document
    from kvarn.autotune.pooled import PooledEvaluator
    from kvarn.schemes import Scheme, get_preset

    out = tmp_path / "presets"
    # documents of 256 tokens hold two 128-token chunks each, too few for a useful bootstrap interval, so
    # this small run decides on the point estimate; three trials: the ladder's top, then two bisection
    # steps (the full-size runs are in docs/tuning.md)
    rc = main(
        ["--model", "smollm2-135m", "--budget", "kl=0.02", "--tokens", "512", "--strategy", "ladder",
         "--feasibility", "point", "--group-sizes", "64", "--trials", "3", "--confirm", "1",
         "--heldout-docs", HELDOUT, "--no-compare-builtin", "--name", "real_small", "--out", str(out),
         "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    )  # fmt: skip
    assert rc == 0
    monkeypatch.setenv("KVARN_PRESET_PATH", str(out))
    p = get_preset("real_small")
    prov = p.provenance
    assert prov["meets_budget_on_heldout"] is True
    assert prov["heldout"]["kl"] <= 0.02 and prov["calibration"]["kl"] <= 0.02
    assert prov["trials"] <= 3  # the trial cap stopped the bisection
    # the preset is the scheme that was measured, under its own name
    assert p.scheme == Scheme.from_name(prov["scheme"]) and p.scheme.group_size == 64
    # two calibration documents of two kinds (256 tokens each), one held-out document of a third
    assert prov["split"] == "documents" and prov["tokens"] == 512
    assert prov["calibration"]["tokens"] == 512 and prov["heldout"]["tokens"] == 256
    assert prov["calibration_docs"] == ["gpl-3", "kvarn-code"] and prov["heldout_docs"] == [HELDOUT]
    assert prov["bits_context"] == 256  # a sink is priced over one document's tokens
    assert prov["bits_per_element"] == pytest.approx(p.scheme.bits_per_element(64, 30, context=256), abs=1e-6)
    assert prov["bits_per_element"] < 16.0
    lo, hi = prov["heldout_interval"]  # the interval is still measured and recorded
    assert lo <= prov["heldout"]["kl"] <= hi
    # loaded by its name, the preset measures on the held-out document what the tuner recorded
    again = PooledEvaluator("smollm2-135m", [document(HELDOUT).text], 256).evaluate("real_small", progress=False)
    assert again.kl == pytest.approx(prov["heldout"]["kl"], rel=1e-4)
    assert again.bits_per_element == pytest.approx(p.scheme.bits_per_element(64, 30, context=256), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g128_sink"])
def test_replayed_and_resumed_measurements_equal_the_fed_one(scheme: str) -> None:
    """The pooled evaluator's shortcuts change no figure: chunks that read nothing quantized
    replayed from fp16, and a prefix's measurement continued, give what feeding every chunk gives:
    bit for bit on one thread; within 1e-8 relative under `make test`'s workers, whose float
    reductions may sum in another order (measured: 7e-10 relative apart)."""
    from kvarn.autotune.corpus import document
    from kvarn.autotune.pooled import PooledEvaluator, measure, pool

    ev = PooledEvaluator("smollm2-135m", [document("gpl-3").text, document(HELDOUT).text], 512)
    assert all(r is not None for r in ev.replays)
    fed = pool(scheme, [measure(p, scheme)[0] for p in ev.parts], ev.chunk)  # every chunk run
    replayed = ev.evaluate(scheme, progress=False)
    ev.evaluate(scheme, max_tokens=384, progress=False)
    resumed = ev.evaluate(scheme, progress=False)
    close = pytest.approx
    for got in (replayed, resumed):
        assert (got.kl, got.delta_ppl_pct, got.top1_agreement) == close(
            (fed.kl, fed.delta_ppl_pct, fed.top1_agreement), rel=1e-8, abs=1e-12
        )
        assert (*got.kl_ci, *got.delta_ppl_pct_ci) == close((*fed.kl_ci, *fed.delta_ppl_pct_ci), rel=1e-8, abs=1e-12)
        assert got.bits_per_element == fed.bits_per_element
