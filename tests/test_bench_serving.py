"""tools/bench_serving.py without an engine: workloads, client arguments, parsing, summary, table, doc."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvarn import llama1b_shapes
from kvarn.bench import serving as bench

RESULT = {  # the fields of a `vllm bench serve --save-result` JSON that are read, plus some that are not
    "duration": 120.5, "completed": 16, "failed": 0, "total_input_tokens": 16384, "total_output_tokens": 2048,
    "request_throughput": 0.1328, "output_throughput": 17.0, "median_ttft_ms": 41000.0, "p99_ttft_ms": 80000.0,
    "median_tpot_ms": 420.0, "p99_tpot_ms": 610.0, "p50_ttft_ms": 41000.0, "median_itl_ms": 400.0,
}  # fmt: skip


def test_workloads_scale_and_keep_the_issue_sizes() -> None:
    w = bench.WORKLOADS
    assert (w["burst"].num_prompts, w["burst"].input_len, w["burst"].output_len) == (48, 3000, 256)
    assert w["burst"].max_concurrency == 48 and w["burst-long"].output_len == 1024
    assert w["one-at-a-time"].max_concurrency == 1 and w["shared-prefix"].prefix_len == 2048
    assert len({x.seed for x in w.values()}) == len(w)  # no two workloads send the same prompts
    s = bench.scaled(w["burst"], num_prompts=16, input_len=1024, output_len=128, latency_prompts=2)
    assert (s.num_prompts, s.input_len, s.output_len, s.max_concurrency) == (16, 1024, 128, 16)
    d = bench.scaled(w["one-at-a-time"], num_prompts=16, latency_prompts=2)
    assert (d.num_prompts, d.max_concurrency, d.input_len) == (2, 1, 3000)
    assert bench.scaled(w["burst"], prefix_len=128).prefix_len == 0  # only the shared-prefix workload has one
    with pytest.raises(ValueError, match="shorter than the prompt"):
        bench.scaled(w["shared-prefix"], input_len=1024)


def test_bench_arguments_per_dataset(tmp_path: Path) -> None:
    url, name = "http://127.0.0.1:8000", "r.json"
    a = bench.bench_args(bench.scaled(bench.WORKLOADS["burst"], 4, 256, 32), url, "m", "tok", tmp_path, name)

    def value(args: list[str], flag: str) -> str:
        return args[args.index(flag) + 1]

    assert a[:2] == ["bench", "serve"] and "--ignore-eos" in a and "--save-result" in a
    assert value(a, "--dataset-name") == "random" and value(a, "--random-input-len") == "256"
    assert value(a, "--random-output-len") == "32" and value(a, "--max-concurrency") == "4"
    assert value(a, "--result-dir") == str(tmp_path) and value(a, "--result-filename") == name
    p = bench.bench_args(bench.scaled(bench.WORKLOADS["shared-prefix"], 4, 256, 32, prefix_len=128), url, "m", "t",
                         tmp_path, name)  # fmt: skip
    assert value(p, "--dataset-name") == "prefix_repetition"
    assert value(p, "--prefix-repetition-prefix-len") == "128" and value(p, "--prefix-repetition-suffix-len") == "128"
    assert value(p, "--prefix-repetition-num-prefixes") == "1" and value(p, "--prefix-repetition-output-len") == "32"


def test_parse_result_reads_figures_and_refuses_failures() -> None:
    r = bench.parse_result(RESULT)
    assert r["output_tok_per_s"] == 17.0 and r["ttft_p99_ms"] == 80000.0 and r["tpot_p50_ms"] == 420.0
    with pytest.raises(ValueError, match="2 of 18 requests failed"):
        bench.parse_result({**RESULT, "failed": 2})
    with pytest.raises(ValueError, match="p99_tpot_ms"):
        bench.parse_result({k: v for k, v in RESULT.items() if k != "p99_tpot_ms"})


def test_server_log_and_metrics_parsing() -> None:
    log = (
        "INFO [kv_cache_utils.py:1] CPU KV cache size: 45,656 tokens, Maximum concurrency for 8,192 tokens "
        "per request: 5.57x\n"
        "INFO [loggers.py:2] Engine 000: Avg prompt throughput: 1800.2 tokens/s, Avg generation throughput: 0.0 "
        "tokens/s, Running: 15 reqs, Waiting: 33 reqs, GPU KV cache usage: 99.1%\n"
        "INFO [loggers.py:2] Engine 000: ... Running: 9 reqs, Waiting: 0 reqs\n"
    )
    assert bench.kv_tokens_from_log(log) == 45656 and bench.peak_running(log) == 15
    assert bench.phases("") == dict.fromkeys(bench.LOG_PHASES)
    assert bench.kv_tokens_from_log("nothing") is None and bench.peak_running("") is None
    metrics = (
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0\n'
        'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7649e+09\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    )
    assert bench.preemptions_from_metrics(metrics) == 7 and bench.preemptions_from_metrics("") == 0


def test_run_order_alternates() -> None:
    assert bench.run_order(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]


def _row(cache: str, rep: int, tok_s: float, ttft: float, kv: int, held: int = 10) -> dict[str, Any]:
    w = bench.scaled(bench.WORKLOADS["burst"], 16, 1024, 128)
    return {"model": "smollm2-135m", "workload": w.name, "letter": w.letter, "kv_cache_dtype": cache, "repeat": rep,
            "num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len, "prefix_len": 0,
            "max_concurrency": w.max_concurrency, **bench.parse_result(RESULT), "output_tok_per_s": tok_s,
            "ttft_p50_ms": ttft, "kv_tokens": kv, "peak_running": 16, "preemptions": rep, "log_prompt_phase_s": 900.0,
            "log_gen_after_prompts": 1500 + rep, "log_decode_only_tok_per_s": 50.0 + rep,
            "log_decode_only_running": 16, "load_avg_1min": 2.0 + rep, "running_while_waiting": held + rep,
            "logged_concurrency": kv / 1536}  # fmt: skip


def test_summary_takes_medians_and_ratios_to_the_default(tmp_path: Path) -> None:
    rows = [_row("auto", 0, 10.0, 4000, 45656), _row("kvarn_k4v2_g128", 0, 6.0, 8000, 204448, 28),
            _row("kvarn_k4v2_g128", 1, 8.0, 6000, 204448, 28), _row("auto", 1, 12.0, 2000, 45656)]  # fmt: skip
    s = {r["kv_cache_dtype"]: r for r in bench.summarize(rows)}
    assert s["auto"]["runs"] == 2 and s["auto"]["output_tok_per_s"] == 11.0 and s["auto"]["preemptions"] == 1
    k = s["kvarn_k4v2_g128"]
    assert k["output_tok_per_s_vs_default"] == round(7.0 / 11.0, 2) and k["ttft_p50_ms_vs_default"] == round(7 / 3, 2)
    assert k["kv_tokens_vs_default"] == round(204448 / 45656, 2) and s["auto"]["output_tok_per_s_vs_default"] == 1.0
    text = bench.table(bench.summarize(rows))
    assert "| (a) burst | 16 x 1,024 + 128, all at once | `kvarn_k4v2_g128` | 2 | 7.0 | 0.64x |" in text
    assert k["running_while_waiting"] == 28.5 and k["running_while_waiting_vs_default"] == round(28.5 / 10.5, 2)
    assert k["logged_concurrency_vs_default"] == round(204448 / 45656, 2)
    assert "204,448 | 4.48x | 16 | 1.00x | 28 | 2.71x | 133.10x | 4.48x | 1 | 900 | 1,500 | 50 | 16 |" in text
    assert len(text.splitlines()) == 4
    assert all(line.count("|") == text.splitlines()[0].count("|") for line in text.splitlines())
    json.dumps(bench.summarize(rows))  # --json writes it


def test_doc_section_is_replaced_between_markers(tmp_path: Path) -> None:
    doc = tmp_path / "serving.md"
    doc.write_text("# Serving\n\nintro\n\n<!-- serving:m -->\nold\n<!-- /serving:m -->\n\nafter\n")
    bench.write_section(doc, "serving:m", "new")
    bench.write_section(doc, "serving:other", "added")
    text = doc.read_text()
    assert "old" not in text and "<!-- serving:m -->\nnew\n<!-- /serving:m -->" in text
    assert text.index("after") < text.index("<!-- serving:other -->") and text.startswith("# Serving\n\nintro")
    argv = ["--model", "m", "--json", "x.json", "--log-dir", "d", "--no-doc", "--num-prompts", "4"]
    assert bench._measuring_args(argv) == ["--model", "m", "--num-prompts", "4"]
    body = bench.section(bench.summarize([_row("auto", 0, 1.0, 1.0, 1)]), argv, "2026-12-04 23:00 UTC", "cpu", "abc")
    assert "at commit abc on cpu" in body and "`python tools/bench_serving.py --model m --num-prompts 4`" in body


def test_from_json_rebuilds_the_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = {"commit": "abc", "machine": "cpu", "date": "2026-12-04 23:00 UTC", "argv": ["--num-prompts", "16"],
             "rows": [_row("auto", 0, 10.0, 4000, 45656), _row("kvarn_k4v2_g128", 0, 6.0, 8000, 204448)]}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(saved))
    doc = tmp_path / "serving.md"
    assert bench.main(["--from-json", str(tmp_path / "r.json"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "<!-- serving:smollm2-135m -->\nMeasured 2026-12-04 23:00 UTC at commit abc on cpu" in text
    assert "load average during the runs: 2.0-2.0." in text and "0.60x" in capsys.readouterr().out


def test_realistic_model_flops_ratio() -> None:
    model = llama1b_shapes
    assert model.flops_per_kv_element(model.LLAMA_3_2_1B) == 118784
    assert model.flops_per_kv_element(model.SMOLLM2) == 18432


def test_kv_gib_for_parses_and_names_a_bad_item(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.parse_kv_gib_for(["auto=2", "kvarn_k4v2_g128=0.5"]) == {"auto": 2.0, "kvarn_k4v2_g128": 0.5}
    assert bench.parse_kv_gib_for([]) == {}
    for bad in ["auto", "auto=", "=2", "auto=x", "auto=0", "auto=-1"]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            bench.parse_kv_gib_for([bad])
    with pytest.raises(SystemExit):
        bench.main(["--kv-gib-for", "auto=two", "--no-doc"])
    assert "'auto=two'" in capsys.readouterr().err


def _stats(stamp: str, prompt: float, gen: float, running: int, waiting: int) -> str:
    return (
        f"(APIServer pid=1) INFO {stamp} [loggers.py:335] Engine 000: Avg prompt throughput: {prompt} tokens/s, "
        f"Avg generation throughput: {gen} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
        "CPU KV cache usage: 4.7%, Prefix cache hit rate: 0.0%\n"
    )


def test_phases_of_a_run_from_the_stats_lines() -> None:
    """A burst as vLLM logs it: prompts finish while requests queue, then decode only, across midnight."""
    log = "".join([
        _stats("12-31 23:59:30", 0.0, 0.0, 0, 0),  # idle before the run: not counted
        _stats("12-31 23:59:40", 0.0, 0.0, 2, 6),  # the run starts in this window
        _stats("12-31 23:59:50", 300.0, 0.5, 3, 5),
        _stats("01-01 00:00:00", 0.0, 1.0, 8, 0),
        _stats("01-01 00:00:10", 300.0, 2.0, 8, 0),  # the last prompt is done: 40 s after the window began
        _stats("01-01 00:00:20", 0.0, 60.0, 8, 0),  # decode only, 8 running
        _stats("01-01 00:00:30", 0.0, 64.0, 7, 0),
        _stats("01-01 00:00:40", 0.0, 62.0, 8, 0),
        _stats("01-01 00:00:50", 0.0, 20.0, 2, 0),  # the batch drains: below 80% of 8, not decode speed
    ])  # fmt: skip
    p = bench.phases(log)
    assert p["prompt_phase_s"] == 40.0
    assert p["gen_after_prompts"] == (60 + 64 + 62 + 20) * 10
    assert p["decode_only_tok_per_s"] == 62.0 and p["decode_only_running"] == 8
    row = {f"log_{k}": v for k, v in p.items()}
    assert bench._phases_text(row) == "prompts done at 40 s, decode-only 62.0 tok/s at 8 running, "
    assert bench._phases_text(dict.fromkeys(row)) == ""  # a run too short for the stats lines
    # no prompt line: nothing to say
    assert bench.phases(_stats("12-05 10:00:00", 0.0, 5.0, 1, 0)) == dict.fromkeys(bench.LOG_PHASES)
    # decode never ran alone (a queue to the end): the prompt phase only
    q = bench.phases(_stats("12-05 10:00:00", 300.0, 1.0, 4, 2) + _stats("12-05 10:00:10", 0.0, 3.0, 4, 1))
    assert q["prompt_phase_s"] == 10.0 and q["gen_after_prompts"] == 30 and q["decode_only_tok_per_s"] is None
    # requests held while others waited: the windows with a queue only
    assert (
        bench.running_while_waiting(log) == 2.5
        and bench.running_while_waiting(_stats("12-05 10:00:00", 0, 1, 4, 0)) is None
    )


def test_vllms_logged_concurrency() -> None:
    log = (
        "(EngineCore pid=9) INFO 12-07 10:00:00 [kv_cache_utils.py:1297] GPU KV cache size: 51,712 tokens\n"
        "(EngineCore pid=9) INFO 12-07 10:00:00 [kv_cache_utils.py:1302] Maximum concurrency for 1,536 tokens per "
        "request: 25.19x\n"
    )
    assert bench.logged_concurrency(log) == 25.19 and bench.logged_concurrency("") is None


@pytest.mark.parametrize("avx512", [True, False])
def test_default_caches_add_fp8_where_vllm_cpu_serves_it(avx512: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    expected = ["auto", "fp8", "kvarn_k4v2_g128"] if avx512 else ["auto", "kvarn_k4v2_g128"]
    assert bench.default_caches() == expected
