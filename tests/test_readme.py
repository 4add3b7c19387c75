"""The README: short, and its shell blocks marked runnable (``<!-- runnable -->`` on the line before
the fence) run as written, in order, in a fresh folder, with ``.venv/bin`` first on ``PATH`` (as
after ``source .venv/bin/activate``): a custom YAML preset, listed, then served by ``vllm serve`` on
the embedded model and asked for a completion."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)```", re.S)


def runnable_blocks(text: str) -> list[str]:
    """The bodies of the ``bash`` blocks marked runnable, in order."""
    return RUNNABLE.findall(text)


def test_readme_is_short_and_marks_its_runnable_blocks() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    blocks = runnable_blocks(text)
    assert len(blocks) == 2 and "my_k4v3.yaml" in blocks[0] and "vllm serve" in blocks[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_readme_runnable_blocks_run(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    script = "set -euo pipefail\n" + "\n".join(runnable_blocks(README.read_text()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVARN_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine, whatever happened
    log = (tmp_path / "serve.log").read_text() if (tmp_path / "serve.log").exists() else ""
    assert proc.returncode == 0, out[-3000:] + log[-3000:]
    assert re.search(r"^my_k4v3\b", out, re.M), out[-3000:]
    assert '"choices"' in out and '"completion_tokens"' in out, out[-3000:] + log[-3000:]
