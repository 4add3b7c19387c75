"""``kvarn eval``: a tiny end-to-end run (table, JSON, plot) and bad input (exit code 2)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from kvarn.cli import main
from kvarn.eval.cli import expand_schemes
from kvarn.schemes import BUILTINS

FIELDS = {"scheme", "bits_per_element", "ppl", "delta_ppl_pct", "kl", "top1_agreement", "greedy_agreement_tokens"}


def test_eval_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    args = ["eval", "--schemes", "fp16,kvarn_k4v2_g64,rtn_k4v2", "--tokens", "256", "--chunk", "64"]
    rc = main([*args, "--greedy-tokens", "4", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["scheme"] for r in rows] == ["fp16", "kvarn_k4v2_g64", "rtn_k4v2"]
    assert all(set(r) >= FIELDS for r in rows)
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0 and rows[2]["kl"] > 0.0
    assert rows[1]["bits_per_element"] == pytest.approx(3.75 + 16 / 256)  # tiles + the exact first token
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "kvarn_k4v2_g64" in table and "KL" in table


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--schemes", "fp16,kvarn_k9v2_g128"], "fp16"),  # unknown scheme: lists the valid names
        (["--schemes", "nope"], "kivi2"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--text", "no-such-file.txt"], "no-such-file.txt"),
    ],
)
def test_bad_input_exits_2_with_a_message(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["eval", "--schemes", "fp16", "--no-progress", *extra])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_chunk_zero_and_short_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["eval", "--chunk", "0"])
    assert e.value.code == 2
    assert "--chunk must be >= 1" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("A short text, far shorter than one tile of 128 tokens.")
    rc = main(["eval", "--schemes", "kvarn_k4v2_g128", "--text", str(short), "--no-progress"])
    assert rc == 2
    assert "too short" in capsys.readouterr().err


def test_scheme_groups() -> None:
    names = expand_schemes("all")
    assert names[0] == "fp16" and set(BUILTINS) <= set(names) and {"fp8", "int8", "kivi2"} <= set(names)
    assert expand_schemes("kvarn,kvarn_k4v2_g128,fp16") == [*BUILTINS, "fp16"]
    with pytest.raises(ValueError, match="names no scheme"):
        expand_schemes(" , ")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device", "tpu"], "device='tpu' is not supported; allowed: cpu, cuda"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
    ],
)
def test_bad_device_or_dtype_names_the_value(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) if "--dtype" in extra else contextlib.nullcontext():
        assert main(["eval", "--schemes", "fp16", "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--schemes", "fp16", "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "device='cuda'" in err and "sees no CUDA device" in err


@pytest.mark.slow  # bfloat16 matmuls are slow on CPUs without native bf16 (about 40 s here)
def test_bfloat16_on_cpu_measures_against_a_bfloat16_reference(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["eval", "--schemes", "fp16,kvarn_k4v4_g64", "--tokens", "128", "--chunk", "64", "--greedy-tokens", "0"]
    assert main([*args, "--dtype", "bfloat16", "--json", str(out), "--no-progress"]) == 0
    fp16, k4v4 = json.loads(out.read_text())
    assert fp16["dtype"] == k4v4["dtype"] == "bfloat16" and fp16["device"] == "cpu"
    # the reference runs in bfloat16 too: its own KL is exactly 0, a quantized cache's is small but not 0
    assert fp16["kl"] == 0.0 and 0.0 < k4v4["kl"] < 0.2
    assert 5.0 < fp16["ppl"] < 200.0


def test_eval_states_the_bos_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    args = ["eval", "--schemes", "fp16,turboquant_k8v4", "--tokens", "192", "--chunk", "64", "--greedy-tokens", "0"]
    assert main([*args, "--bos", "yes", "--json", str(out), "--no-progress"]) == 0
    assert "BOS prepended, --bos yes" in capsys.readouterr().out
    fp16, tq = json.loads(out.read_text())
    assert fp16["bos"] == "yes" and fp16["bos_prepended"] is True
    # as deployed: 4 of SmolLM2's 30 layers at 16 bits, the rest at vLLM's 100 bytes per token and head
    assert tq["bits_per_element"] == pytest.approx((26 * 6.25 + 4 * 16) / 30)
    assert 0.0 < tq["kl"] < 0.05
