"""Prefill/decode disaggregation through two ``vllm serve`` processes that share a
``KvarnStorageConnector`` store (docs/connectors.md, "Prefill and decode in two servers").

The prefill server (``kv_role`` ``kv_producer``) serves each prompt alone, which saves its tiles,
tail rows and sink rows; it stops, and the decode server (``kv_consumer``, a new process tree
with an empty prefix cache) serves the same prompts, loading them. The two run one after the other
(a 2-core machine holds one engine at a time; the store is the hand-off either way). Printed: per
prompt, its tokens, the prompt tokens the decode server did not compute (``cached_tokens``),
whether both servers' greedy completions are equal and, where not, whether the decode server's
equals that of one engine that computes the last prompt token in a step of its own (as vLLM has
the decode server do: it recomputes the last token of a fully loaded prompt).

Usage::

    python tools/pd_serve.py --prompt-lens 300 700 --max-tokens 16 --doc docs/connectors.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from doc_section import measuring_args, utc_stamp, write_section  # noqa: E402

from kvarn.testing.serve import vllm_server  # noqa: E402

DTYPE = "kvarn_k4v2_g128"


@contextlib.contextmanager
def server(model: str, role: str, store: Path, log: Path) -> Iterator[str]:
    """``vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --kv-transfer-config {KvarnStorageConnector,
    role, store}`` on 127.0.0.1 with the CPU settings of ``kvarn.vllm.engine.cpu_engine``; yields its
    URL once ``/health`` answers, and stops its process group on exit."""
    transfer = {"kv_connector": "KvarnStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"storage_path": str(store)}}  # fmt: skip
    args = [model, "--kv-cache-dtype", DTYPE, "--block-size", "128", "--enforce-eager"]
    args += ["--gpu-memory-utilization", "0.3", "--max-model-len", "1024", "--seed", "0"]
    args += ["--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)]
    with vllm_server(args, log, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}) as url:
        yield url


def complete(url: str, model: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy completion of the token ids ``ids``: its text and the prompt tokens served from a cache."""
    import httpx

    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    out = r.json()
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"text": out["choices"][0]["text"], "cached": int(details.get("cached_tokens") or 0)}


def run(lens: list[int], max_tokens: int) -> list[dict[str, Any]]:
    """Serve prompts of ``lens`` tokens (GPL-3 text, each from its own offset) on the prefill server,
    then the decode server; one row per prompt."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    model = str(resolve_model("smollm2-135m"))
    text = (ROOT / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    prompts = [ids[s : s + n] for s, n in zip(starts, lens, strict=True)]
    with tempfile.TemporaryDirectory() as tmp:
        store, logs = Path(tmp) / "store", Path(tmp)
        with server(model, "kv_producer", store, logs / "prefill.log") as url:
            first = [complete(url, model, p, max_tokens) for p in prompts]
        with server(model, "kv_consumer", store, logs / "decode.log") as url:
            second = [complete(url, model, p, max_tokens) for p in prompts]
    rows = [
        {"prompt": len(p), "cached": b["cached"], "same": a["text"] == b["text"], "texts": (a["text"], b["text"])}
        for p, a, b in zip(prompts, first, second, strict=True)
    ]
    for p, r in zip(prompts, rows, strict=True):
        r["split"] = "-" if r["same"] else ("yes" if split_last_token(model, p, max_tokens) == r["texts"][1] else "NO")
    return rows


def split_last_token(model: str, ids: list[int], max_tokens: int) -> str:
    """The greedy text of one engine (no connector, no prefix cache) whose prefill computes all prompt
    tokens but the last, then the last in a step of its own, as the decode server does."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with cpu_engine(model, DTYPE, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=len(ids) - 1,
                    enable_prefix_caching=False) as llm:  # fmt: skip
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=max_tokens, temperature=0))
    return str(out[0].outputs[0].text)


def main(argv: list[str] | None = None) -> None:
    args_list = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[300, 700])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--doc", type=Path, help="replace this page's pd-serve section")
    args = ap.parse_args(args_list)
    rows = run(args.prompt_lens, args.max_tokens)
    lines = ["| prompt tokens | decode server: prompt tokens loaded | same greedy text as the prefill server | "
             "if not: same as one engine computing the last prompt token in its own step |",
             "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['prompt']} | {r['cached']} | {'yes' if r['same'] else 'NO'} | {r['split']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    for r in rows:
        if not r["same"]:
            print(
                f"{r['prompt']} tokens: prefill server {r['texts'][0]!r}\n{' ' * len(str(r['prompt']))}  decode server  {r['texts'][1]!r}"
            )
    if args.doc:
        cmd = " ".join(["python tools/pd_serve.py", *measuring_args(args_list, ("--doc",))])
        write_section(args.doc, "pd-serve", f"`{cmd}` ({utc_stamp()}, smollm2-135m, {DTYPE}):\n\n{table}")
    if not all(r["same"] or r["split"] == "yes" for r in rows):
        sys.exit("the decode server's greedy text differs from one engine's on the same schedule")


if __name__ == "__main__":
    main()
