"""``tools/vllm_tasks.py`` without an engine: scoring served answers by the harness's rules, the table, the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvarn.bench import vllm_tasks
from kvarn.eval.needle import NeedlePrompt


@pytest.fixture(scope="module")
def tool() -> Any:
    return vllm_tasks


class DigitTokenizer:
    """Token id ``t`` decodes to the text ``str(t)`` followed by a space."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"{t} " for t in ids)


def prompts(tool: Any) -> Any:
    needle = {
        64: [
            NeedlePrompt(torch.tensor([[1, 2, 3]]), 11111, 0.0, 1),
            NeedlePrompt(torch.tensor([[1, 4]]), 22222, 1.0, 1),
        ],
        128: [NeedlePrompt(torch.tensor([[5]]), 33333, 0.5, 1)],
    }
    return tool.Prompts(needle, [[7, 8], [9]], DigitTokenizer(), False)


def test_token_ids_needle_by_length_then_drift(tool: Any) -> None:
    assert prompts(tool).token_ids() == [[1, 2, 3], [1, 4], [5], [7, 8], [9]]


def test_summarize_scores_like_the_harness(tool: Any) -> None:
    reference = [[11111], [22222], [33333], [1, 2, 3, 4], [5, 6]]
    served = [[11111, 9], [2222], [4, 33333], [1, 2, 9, 4], [5, 6]]
    run = tool.summarize("kvarn_k4v2_g128", prompts(tool), served, reference, 1.5)
    assert run.lengths == [64, 128]
    assert run.retrieved == [[True, False], [False]]  # the first number is the key, or it is missed
    assert run.answers[0][0] == "11111 9 "
    assert run.drift == [[1, 2, 9, 4], [5, 6]]
    assert run.divergence == [2, 2]
    assert run.mean_divergence == 2.0


def test_table_and_json(tool: Any, tmp_path: Path) -> None:
    p = prompts(tool)
    ref = [[11111], [22222], [33333], [1, 2], [5]]
    runs = [
        tool.summarize("auto", p, ref, ref, 2.0),
        tool.summarize("kvarn_k4v4_g128", p, ref[:3] + [[1, 3], [5]], ref, 3.25),
    ]
    md = tool.format_table(runs, markdown=True).splitlines()
    assert md[0] == "| kv_cache_dtype | needle 64 | needle 128 | divergence | per prompt | seconds |"
    assert md[2] == "| auto | 2/2 (`11`) | 1/1 (`1`) | 1.5 | 2 1 | 2.0 |"
    assert md[3] == "| kvarn_k4v4_g128 | 2/2 (`11`) | 1/1 (`1`) | 1.0 | 1 1 | 3.2 |"
    plain = tool.format_table(runs).splitlines()
    assert plain[1].split() == ["auto", "2/2", "(11)", "1/1", "(1)", "1.5", "2", "1", "2.0"]
    out = tmp_path / "runs.json"
    tool.write_json(runs, out, {"model_dtype": "bfloat16"})
    rows = json.loads(out.read_text())
    assert [r["dtype"] for r in rows] == ["auto", "kvarn_k4v4_g128"]
    assert rows[1]["divergence"] == [1, 1] and rows[1]["mean_divergence"] == 1.0
    assert rows[0]["model_dtype"] == "bfloat16"


def test_default_cache_always_served_first(tool: Any) -> None:
    assert tool.parse_args(["--dtypes", "kvarn_k4v2_g128,auto"]).dtypes == ["auto", "kvarn_k4v2_g128"]
    assert tool.parse_args([]).dtypes == ["auto", "kvarn_k4v2_g128", "kvarn_k4v4_g128"]


def test_compare_two_runs_token_by_token(tool: Any, tmp_path: Path) -> None:
    p = prompts(tool)
    ref = [[11111], [22222], [33333], [1, 2, 3], [5, 6]]
    a = [tool.summarize("auto", p, ref, ref, 1.0), tool.summarize("kvarn_k4v2_g128", p, ref, ref, 1.0)]
    other = [[11111], [2], [33333], [1, 2, 4], [5, 6]]
    b = [tool.summarize("kvarn_k4v2_g128", p, other, other, 1.0)]
    for runs, name in ((a, "a.json"), (b, "b.json")):
        tool.write_json(runs, tmp_path / name, {"backend": "vllm"})
    a2, b2 = tool.read_json(tmp_path / "a.json"), tool.read_json(tmp_path / "b.json")
    assert a2 == a and b2 == b
    md = tool.format_comparison(a2, b2, markdown=True).splitlines()
    assert len(md) == 3  # only the dtype in both
    assert md[2] == "| kvarn_k4v2_g128 | 2/2 (`11`); 1/1 (`1`) | 1/2 (`10`); 1/1 (`1`) | 2/3 | 2.0 | 2 2 |"


def test_compare_reads_kvarn_eval_needle_json(tool: Any, tmp_path: Path) -> None:
    row = {"scheme": "fp16", "bits_per_element": 16.0, "lengths": [64], "depths": [0.0, 1.0], "keys": [1, 2]}
    row |= {"retrieved": [[True, False]], "answers": [[" 1.", " no"]], "seconds": 1.0, "rates": [0.5]}
    (tmp_path / "needle.json").write_text(json.dumps([row]))
    (run,) = tool.read_json(tmp_path / "needle.json")
    assert (run.dtype, run.retrieved, run.drift) == ("auto", [[True, False]], [])
    assert run.mean_divergence is None
    served = tool.Run("auto", [64], [[True, True]], [[" 1.", " 2."]], [], [], 2.0)
    md = tool.format_comparison([served], [run], markdown=True).splitlines()
    assert md[2] == "| auto | 2/2 (`11`) | 1/2 (`10`) | 1/2 | - | - |"
