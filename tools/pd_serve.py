"""Prefill/decode disaggregation through two ``vllm serve`` processes that share a
``KvarnStorageConnector`` store (docs/connectors.md, "Prefill and decode in two servers").

The prefill server (``kv_role`` ``kv_producer``) serves each prompt alone, which saves its tiles,
tail rows and sink rows; it stops, and the decode server (``kv_consumer``, a new process tree
with an empty prefix cache) serves the same prompts, loading them. The two run one after the other
(a 2-core machine holds one engine at a time; the store is the hand-off either way). Printed: per
prompt, its tokens, the prompt tokens the decode server did not compute (``cached_tokens``), the
smallest gap between the prefill server's two best candidates (up to the first difference), the
largest logprob difference of the two servers' greedy tokens while they agree, and where they first
differ; there, whether both servers rank the two tokens as a near-tie
(:func:`kvarn.testing.greedy.agree`) and whether the decode server's tokens equal those of one
engine that computes the last prompt token in a step of its own (as vLLM has the decode server do:
it recomputes the last token of a fully loaded prompt).

Usage::

    python tools/pd_serve.py --prompt-lens 300 700 --max-tokens 16 --dtype bfloat16 --doc docs/connectors.md
    python tools/pd_serve.py --prompt-lens 300 700 --max-tokens 16 --dtype float32 --doc docs/connectors.md

A dtype other than bfloat16 writes the section ``pd-serve-DTYPE``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import measured_at, measuring_args, write_section
from kvarn.testing.greedy import agree, first_difference
from kvarn.testing.serve import complete, connector_server

DTYPE = "kvarn_k4v2_g128"


def run(lens: list[int], max_tokens: int, dtype: str) -> list[dict[str, Any]]:
    """Serve prompts of ``lens`` tokens (GPL-3 text, each from its own offset) on the prefill server,
    then the decode server; one row per prompt."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    model = str(resolve_model("smollm2-135m"))
    text = resources.files("kvarn").joinpath("data", "gpl-3.txt").read_text(encoding="utf-8")
    ids: list[int] = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    prompts = [ids[s : s + n] for s, n in zip(starts, lens, strict=True)]
    with tempfile.TemporaryDirectory() as tmp:
        store, logs = Path(tmp) / "store", Path(tmp)
        with connector_server(model, DTYPE, "kv_producer", store, logs / "prefill.log", dtype=dtype) as url:
            first = [complete(url, model, p, max_tokens) for p in prompts]
        with connector_server(model, DTYPE, "kv_consumer", store, logs / "decode.log", dtype=dtype) as url:
            second = [complete(url, model, p, max_tokens) for p in prompts]
    rows = []
    for p, a, b in zip(prompts, first, second, strict=True):
        at = first_difference(a.greedy, b.greedy)
        row: dict[str, Any] = {"prompt": len(p), "cached": b.cached, "at": at, "near_tie": "-", "split": "-"}
        if at is not None:
            x, y = a.greedy.tokens[at], b.greedy.tokens[at]
            row["gaps"] = [g.top[at].get(x, math.nan) - g.top[at].get(y, math.nan) for g in (a.greedy, b.greedy)]
            row["near_tie"] = "yes" if agree(a.greedy, b.greedy) is None else "NO"
            same = split_last_token(model, p, max_tokens, dtype) == b.greedy.tokens
            row["split"] = "yes" if same else "NO"
        row["drift"] = max(
            (
                abs(a.greedy.top[i][t] - b.greedy.top[i][t])
                for i, t in enumerate(a.greedy.tokens[: len(a.greedy.tokens) if at is None else at])
            ),
            default=0.0,
        )
        row["margin"] = min(_top2_gap(top) for top in a.greedy.top[: len(a.greedy.top) if at is None else at + 1])
        rows.append(row)
    return rows


def _top2_gap(top: dict[int, float]) -> float:
    """The logprob gap between the best and second-best candidate of one position."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else math.inf


def split_last_token(model: str, ids: list[int], max_tokens: int, dtype: str) -> list[int]:
    """The greedy tokens of one engine (no connector, no prefix cache) whose prefill computes all prompt
    tokens but the last, then the last in a step of its own, as the decode server does."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with cpu_engine(model, DTYPE, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=len(ids) - 1,
                    enable_prefix_caching=False, dtype=dtype) as llm:  # fmt: skip
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=max_tokens, temperature=0))
    return list(out[0].outputs[0].token_ids)


def main(argv: list[str] | None = None) -> None:
    args_list = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[300, 700])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype in both servers (vllm serve --dtype)")
    ap.add_argument("--doc", type=Path, help="replace this page's pd-serve section")
    args = ap.parse_args(args_list)
    rows = run(args.prompt_lens, args.max_tokens, args.dtype)
    lines = ["| prompt tokens | decode server: prompt tokens loaded | smallest top-2 gap (prefill server) | "
             "largest logprob difference while equal | first different token | there: logprob gap (prefill / decode "
             "server) | near-tie | same tokens as one engine computing the last prompt token in its own step |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        gaps = " / ".join(f"{g:.3f}" for g in r["gaps"]) if "gaps" in r else "-"
        at = "none" if r["at"] is None else str(r["at"])
        lines.append(
            f"| {r['prompt']} | {r['cached']} | {r['margin']:.4f} | {r['drift']:.4f} | {at} | {gaps} | {r['near_tie']} "
            f"| {r['split']} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.doc:
        cmd = " ".join(["python tools/pd_serve.py", *measuring_args(args_list, ("--doc",))])
        name = "pd-serve" if args.dtype == "bfloat16" else f"pd-serve-{args.dtype}"
        write_section(args.doc, name, f"`{cmd}` ({measured_at(False)}, smollm2-135m, {DTYPE}):\n\n{table}")
    if not all(r["at"] is None or (r["near_tie"] == "yes" and r["split"] == "yes") for r in rows):
        sys.exit("the decode server's greedy tokens differ from the prefill server's beyond a near-tie")


if __name__ == "__main__":
    main()
