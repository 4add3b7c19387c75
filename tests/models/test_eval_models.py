"""``kvarn eval`` and ``kvarn-tune`` end to end on the random Gemma-like (and hybrid) model saved to a folder.

Random weights: the accuracy figures mean little here (the model's next-token distributions are
nearly uniform); what is checked is that sliding-window models go through and that the bits
reported are those of what the cache holds (sliding layers 16-bit, windowed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from kvarn.autotune.budget import parse_budget
from kvarn.autotune.tuner import TuneConfig, tune
from kvarn.cli import main
from kvarn.eval.harness import Evaluator, default_text
from kvarn.hf import cache_geometry
from kvarn.schemes import Scheme
from tests.models._tune_probes import tune_probed_layers
from tests.models.conftest import WINDOW

TOKENS, CHUNK, D = 320, 64, 256


def expected_bits(scheme: str, tokens: int) -> float:
    """Bits per held number after ``tokens``: 5 sliding layers hold ``WINDOW - 1`` tokens at 16
    bits; the full layer holds packed tiles, a 16-bit tail and the exact first tokens beside its
    packed tile 0 (one KV head, head_dim 256)."""
    s = Scheme.from_name(scheme)
    tiles, tail = divmod(tokens, s.group_size)
    sliding = 5 * (WINDOW - 1)
    exact = s.sink_tokens if tiles else 0
    bits = 8 * tiles * s.tile_bytes(D) + 16 * 2 * D * (tail + sliding + exact)
    return bits / (2 * D * (tokens + sliding))


def test_kvarn_eval_runs_on_a_sliding_window_model(gemma_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(gemma_folder), "--schemes", "fp16,kvarn_k4v2_g128,kivi2,turboquant3"]
    argv += ["--tokens", str(TOKENS), "--chunk", str(CHUNK), "--greedy-tokens", "8", "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["fp16", "kvarn_k4v2_g128", "kivi2", "turboquant3"]
    assert rows["fp16"]["bits_per_element"] == 16.0 and rows["fp16"]["kl"] == 0.0
    assert rows["kvarn_k4v2_g128"]["bits_per_element"] == pytest.approx(expected_bits("kvarn_k4v2_g128", TOKENS))
    for name in ("kvarn_k4v2_g128", "kivi2", "turboquant3"):
        r = rows[name]
        assert r["tokens"] == TOKENS and 0 < r["kl"] < 1.0, r  # quantized tokens were read, and differ
        assert r["bits_per_element"] < 16.0 and isinstance(r["greedy_agreement_tokens"], int)


def test_kvarn_eval_runs_on_a_hybrid_model(hybrid_folder: Path, tmp_path: Path) -> None:
    """GraniteMoeHybrid-like (Mamba2 + attention, head_dim 64): only the attention layers are
    quantized; bits are those of the attention layers (2 packed tiles, a 64-token tail and the exact
    first token, per layer and KV head)."""
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(hybrid_folder), "--schemes", "fp16,kvarn_k4v2_g128,kivi2,turboquant3"]
    argv += ["--tokens", str(TOKENS), "--chunk", str(CHUNK), "--greedy-tokens", "8", "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())}
    assert rows["fp16"]["bits_per_element"] == 16.0 and rows["fp16"]["kl"] == 0.0
    s, d = Scheme.from_name("kvarn_k4v2_g128"), 64
    tiles, tail = divmod(TOKENS, s.group_size)
    bits = (8 * tiles * s.tile_bytes(d) + 16 * 2 * d * (tail + s.sink_tokens)) / (2 * d * TOKENS)
    assert rows["kvarn_k4v2_g128"]["bits_per_element"] == pytest.approx(bits)
    for name in ("kvarn_k4v2_g128", "kivi2", "turboquant3"):
        assert rows[name]["tokens"] == TOKENS and 0 < rows[name]["kl"] < 1.0, rows[name]


def test_evaluator_quantize_sliding_counts_the_windowed_tiles(gemma_folder: Path) -> None:
    ev = Evaluator(str(gemma_folder), tokens=TOKENS, chunk=CHUNK, greedy_tokens=0, quantize_sliding=True)
    r = ev.evaluate("kvarn_k4v2_g32", greedy=False, progress=False)
    exact = Evaluator(str(gemma_folder), tokens=TOKENS, chunk=CHUNK, greedy_tokens=0)
    r_exact = exact.evaluate("kvarn_k4v2_g32", greedy=False, progress=False)
    assert r.bits_per_element < r_exact.bits_per_element and r.kl > r_exact.kl > 0


def _tune_small(folder: Path, tmp_path: Path) -> tuple[Any, list[dict[str, Any]]]:
    """A 2-trial ``kvarn-tune`` run on ``folder`` (256 tokens, no per-layer search): the model's cache
    geometry and the trials that were measured (at least one)."""
    config = TuneConfig(
        budget=parse_budget("50%"), model=str(folder), text=default_text(), tokens=256, trials=2, sensitivity_tokens=0,
        per_layer=False, group_sizes=(32, 64), confirm=1, prune_tokens=0, cache_dir=tmp_path, chunk=CHUNK,
        progress=False,
    )  # fmt: skip
    res = tune(config)
    measured = [t for t in res.trials if t.get("bits") is not None]
    assert measured
    return cache_geometry(AutoConfig.from_pretrained(folder)), measured


def test_kvarn_tune_counts_sliding_layers_at_16_bits(gemma_folder: Path, tmp_path: Path) -> None:
    geometry, measured = _tune_small(gemma_folder, tmp_path)
    for t in measured:
        scheme = Scheme.from_name(t["scheme"])
        assert t["bits"] == pytest.approx(geometry.bits_per_element(scheme, 256))
        assert t["bits"] > scheme.bits_per_element(D, 6, 256)  # the sliding layers' 16 bits are counted


def test_kvarn_tune_on_a_hybrid_model_counts_attention_layers_only(hybrid_folder: Path, tmp_path: Path) -> None:
    geometry, measured = _tune_small(hybrid_folder, tmp_path)
    assert geometry.attention_layers == (1, 3)
    for t in measured:
        scheme = Scheme.from_name(t["scheme"])
        assert t["bits"] == pytest.approx(geometry.bits_per_element(scheme, 256))
        assert t["bits"] == pytest.approx(scheme.bits_per_element(64, 2, 256))  # the two attention layers


def test_kvarn_tune_sensitivity_skips_recurrent_layers(hybrid_folder: Path, tmp_path: Path) -> None:
    """The per-layer sensitivity pass evaluates the attention layers only: a Mamba layer has nothing
    to quantize (0.0, no evaluation)."""
    res, probed = tune_probed_layers(hybrid_folder, tmp_path, 4)
    assert sorted(probed) == [1, 3]
    assert res.sensitivity[0] == res.sensitivity[2] == 0.0 and res.sensitivity[1] > 0 and res.sensitivity[3] > 0
