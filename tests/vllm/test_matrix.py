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
preemptions, prompts longer than the step's token budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOOL = Path(__file__).resolve().parents[2] / "tools" / "matrix.py"


def test_all_features_at_once_exact_and_nothing_leaks(tmp_path: Path) -> None:
    out = tmp_path / "matrix.json"
    cmd = [sys.executable, str(TOOL), "--cells", "all", "--dtypes", "float32", "--caches", "kvarn", "--model", "tiny"]
    proc = subprocess.run([*cmd, "--work", str(tmp_path), "--json", str(out)], capture_output=True, text=True)
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    plain, result = json.loads(out.read_text())
    assert plain["cell"] == "plain" and result["cell"] == "all"
    assert result["model"] == "tiny" and result["kv_cache_dtype"] == "kvarn_k4v2_g128"
    assert [r["verdict"] for r in result["requests"]] == ["exact"] * 6, result["requests"]
    start, after_crowd, after_alone = result["free_blocks"]
    assert start == after_crowd == after_alone, result["free_blocks"]
    assert result["preemptions"] > 0, result
    assert "| prefix hits + chunks of 96 + ngram + preemption + abort (tiny) | 6/6 exact" in proc.stdout, proc.stdout
    ref = result["vs_reference"]
    assert ref["verdicts"] == ["exact"] * 6, ref
    assert result["prefix_tokens_hit"] > 0 and result["draft_tokens_accepted"] > 0, result
    assert result["longest_prompt"] > result["step_budget"], result
    against = proc.stdout.split("Against the reference")[1]
    assert "| prefix hits + chunks of 96 + ngram + preemption + abort (tiny) | 6/6 exact (" in against, against
