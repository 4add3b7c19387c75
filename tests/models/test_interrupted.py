"""Interrupted work loses nothing: ``kvarn-tune`` killed mid-search resumes from its SQLite storage
to the winner of an uninterrupted run; ``kvarn eval --json`` killed mid-run leaves its finished rows.

Both run as subprocesses killed with SIGKILL (no handler runs, as when a machine goes down) on a
random-weight Llama-like model saved to a folder.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvarn.testing.builders import build, llama_config, save

TEXT = Path("/usr/share/common-licenses/GPL-3")
DEADLINE = 240.0  # seconds a subprocess may take before the test gives up on it


@pytest.fixture(scope="module")
def llama4_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-like, 4 full-attention layers (head_dim 64, 2 KV heads), with the byte tokenizer."""
    return save(build(llama_config(hidden=128, layers=4)), tmp_path_factory.mktemp("llama4"))


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 20,000 characters of English text (byte tokens: calibration and held-out parts of 1,024)."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    source = TEXT.read_text() if TEXT.is_file() else (Path(__file__).parents[2] / "README.md").read_text() * 4
    path.write_text(source[:20_000])
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def _kill_when(cmd: list[str], ready: Callable[[], bool], cwd: Path) -> int:
    """Start ``cmd``, SIGKILL it as soon as ``ready()`` holds; its return code (negative: killed)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - start < DEADLINE:
            if ready():
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        return proc.wait(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _completed(db: Path) -> int:
    """COMPLETE trials in an Optuna SQLite storage (0 before the study exists)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0) as con:
            return int(con.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0])
    except sqlite3.OperationalError:  # the schema is still being written
        return 0


def _tune(folder: Path, text: Path, db: Path, tmp: Path) -> list[str]:
    return [
        sys.executable, "-m", "kvarn.autotune.cli", "--model", str(folder), "--text", str(text), "--tokens", "1024",
        "--budget", "kl=0.0003", "--sensitivity-tokens", "0", "--no-compare-builtin", "--quiet", "--json",
        "--storage", f"sqlite:///{db}", "--out", str(tmp / "presets"), "--cache-dir", str(tmp / "cache"),
    ]  # fmt: skip


def _finished(cmd: list[str], cwd: Path) -> dict[str, Any]:
    out = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.slow
def test_kvarn_tune_killed_mid_search_resumes_to_the_same_winner(
    llama4_folder: Path, text: Path, tmp_path: Path
) -> None:
    whole = _finished(_tune(llama4_folder, text, tmp_path / "whole.db", tmp_path), tmp_path)
    measured = sum(bool(t["evaluated"]) for t in whole["trials"] if t["state"] == "COMPLETE")
    assert whole["winner"] is not None and measured >= 4, whole["trials"]  # room to kill it half-way

    db, n = tmp_path / "cut.db", 2
    rc = _kill_when(_tune(llama4_folder, text, db, tmp_path), lambda: _completed(db) >= n, tmp_path)
    assert rc == -signal.SIGKILL, f"kvarn-tune ended by itself (rc {rc}) before {n} trials finished"
    kept = _completed(db)
    assert n <= kept < measured

    again = _finished(_tune(llama4_folder, text, db, tmp_path), tmp_path)
    assert again["study_name"] == whole["study_name"]
    assert again["winner"]["scheme"] == whole["winner"]["scheme"]
    assert again["winner"]["calib_metric"] == pytest.approx(whole["winner"]["calib_metric"], rel=1e-6)
    # the trials finished before the kill were reused, not measured again
    evaluated = [t["scheme"] for t in again["trials"] if t["state"] == "COMPLETE" and t["evaluated"]]
    assert len(evaluated) == len(set(evaluated)) == measured
    assert not [t for t in again["trials"] if t["state"] == "RUNNING"]


@pytest.mark.slow
def test_kvarn_eval_killed_mid_run_keeps_the_finished_rows(llama4_folder: Path, text: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    schemes = ["fp16", "kvarn_k4v2_g64", "kvarn_k4v4_g64", "kvarn_k3v2_g64", "kvarn_k2v2_g64"]
    cmd = [
        sys.executable, "-m", "kvarn.cli", "eval", "--model", str(llama4_folder), "--text", str(text), "--tokens",
        "1024", "--chunk", "64", "--greedy-tokens", "0", "--schemes", ",".join(schemes), "--no-progress", "--json",
        str(out),
    ]  # fmt: skip

    def rows() -> list[dict[str, Any]]:
        return json.loads(out.read_text()) if out.exists() else []  # type: ignore[no-any-return]

    rc = _kill_when(cmd, lambda: len(rows()) >= 2, tmp_path)
    assert rc == -signal.SIGKILL, f"kvarn eval ended by itself (rc {rc}) before 2 rows were written"
    kept = rows()  # parses: the file is replaced whole, never left half-written
    assert 2 <= len(kept) < len(schemes)
    assert [r["scheme"] for r in kept] == schemes[: len(kept)]
    assert kept[0]["kl"] == 0.0 and all(r["kl"] > 0.0 and r["tokens"] == 1024 for r in kept[1:])
