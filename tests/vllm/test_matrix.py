"""The feature matrix's combined cell in ``make test`` (the whole matrix: ``tools/matrix.py``, its
table in docs/reliability.md): prefix hits, chunks that cut tiles, ngram speculative decoding,
preemption and an abort mid-tile at once, on a tiny random Llama in float32. Every request of the
crowd gets exactly the greedy tokens the same engine gives it alone, vLLM's free blocks come back to
where they started, and vLLM preempted requests (the cell's KV memory holds one request and the
start of another; the tool leaves ``VLLM_CPU_KVCACHE_SPACE``, which another test of the same
process may have set, out of the engine's environment: vLLM would give it precedence). And every
request of the crowd gets the tokens of the reference it must equal, the plain cell (prefix caching
off, one chunk per prompt, no speculation or preemption) serving it alone, each logprob within
``FLOAT32_DRIFT``, with proof that each feature ran: prefix tokens hit, draft tokens accepted,
preemptions, prompts longer than the step's token budget.

The same cell in bfloat16: every request of the crowd within the bound derived from bfloat16's
precision of the plain cell's (``kvarn.testing.greedy.bf16_tolerance``: tokens equal and logprobs
within it, or first differing at a near-tie), the features proved the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOOL = Path(__file__).resolve().parents[2] / "tools" / "matrix.py"


def _combined(tmp_path: Path, dtype: str) -> tuple[dict[str, Any], str]:
    """The combined cell and its plain reference on the tiny Llama in ``dtype``, kvarn's cache: the
    combined cell's result and the tool's table."""
    out = tmp_path / "matrix.json"
    cmd = [sys.executable, str(TOOL), "--cells", "all", "--dtypes", dtype, "--caches", "kvarn", "--model", "tiny"]
    proc = subprocess.run([*cmd, "--work", str(tmp_path), "--json", str(out)], capture_output=True, text=True)
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    plain, result = json.loads(out.read_text())
    assert plain["cell"] == "plain" and result["cell"] == "all"
    assert result["model"] == "tiny" and result["kv_cache_dtype"] == "kvarn_k4v2_g128"
    start, after_crowd, after_alone = result["free_blocks"]
    assert start == after_crowd == after_alone, result["free_blocks"]
    assert result["preemptions"] > 0, result
    assert result["prefix_tokens_hit"] > 0 and result["draft_tokens_accepted"] > 0, result
    assert result["longest_prompt"] > result["step_budget"], result
    return result, proc.stdout


def test_all_features_at_once_exact_and_nothing_leaks(tmp_path: Path) -> None:
    result, table = _combined(tmp_path, "float32")
    assert [r["verdict"] for r in result["requests"]] == ["exact"] * 6, result["requests"]
    assert "| prefix hits + chunks of 96 + ngram + preemption + abort (tiny) | 6/6 exact" in table, table
    ref = result["vs_reference"]
    assert ref["verdicts"] == ["exact"] * 6, ref
    against = table.split("Against the reference")[1]
    assert "| prefix hits + chunks of 96 + ngram + preemption + abort (tiny) | 6/6 exact (" in against, against


def test_all_features_at_once_in_bfloat16_within_the_derived_bound(tmp_path: Path) -> None:
    result, table = _combined(tmp_path, "bfloat16")
    assert "wrong" not in [r["verdict"] for r in result["requests"]], result["requests"]
    ref = result["vs_reference"]
    assert "wrong" not in ref["verdicts"], ref
    assert ref["exercised"], ref
