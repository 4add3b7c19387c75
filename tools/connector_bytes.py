"""Bytes a KV connector writes per prompt token: kvarn's ``KvarnStorageConnector`` on kvarn dtypes
vs vLLM's ``ExampleConnector`` on vLLM's own caches (16-bit, fp8), through vLLM on CPU.

Each dtype gets one engine (``kv_both``, a fresh store folder) that serves each prompt once with
one generated token; the bytes are the sizes of the files the connector wrote for that prompt.
kvarn's files are split into tiles, tail rows (16-bit rows of the partial tile) and sink rows.
``ExampleConnector`` saves the prompt's tokens up to the last whole block before its last token
(vLLM's ``align_to_block_size``), kvarn's connector all of them: both are divided by the tokens
they hold.

Usage::

    python tools/connector_bytes.py --prompt-lens 2048 2000 --doc docs/connectors.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvarn, installed or not

from doc_section import measuring_args, utc_stamp, write_section  # noqa: E402

MODEL = "smollm2-135m"
TILE = 128


def _prompts(lens: list[int]) -> list[list[int]]:
    """Prompts of ``lens`` tokens from the bundled GPL-3 text, each from its own offset (no shared prefix)."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    text = (Path(__file__).resolve().parents[1] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = tok(text)["input_ids"]
    out, at = [], 0
    for n in lens:
        if at + n > len(ids):
            raise ValueError(f"prompt lengths {lens} need {sum(lens)} tokens; the text has {len(ids)}")
        out.append(ids[at : at + n])
        at += n
    return out


def _files(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in root.rglob("*") if p.is_file()}


def measure(dtype: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """One engine of ``dtype`` with its connector: per prompt, the bytes written by kind and the tokens held."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import align_to_block_size
    from vllm.inputs import TokensPrompt

    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine
    from kvarn.vllm.registry import is_kvarn_dtype

    kvarn = is_kvarn_dtype(dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        extra = {"storage_path": str(store)} if kvarn else {"shared_storage_path": str(store)}
        transfer = {"kv_connector": "KvarnStorageConnector" if kvarn else "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": extra}  # fmt: skip
        longest = max(len(p) for p in prompts)
        with cpu_engine(str(resolve_model(MODEL)), dtype, max_model_len=longest + TILE, max_num_seqs=1,
                        max_num_batched_tokens=longest + TILE, kv_transfer_config=transfer) as llm:  # fmt: skip
            for ids in prompts:
                before = _files(store)
                llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1), use_tqdm=False)
                new = {p: s for p, s in _files(store).items() if p not in before}
                by_kind: dict[str, int] = {}
                for p, s in new.items():
                    kind = p.name.split("-")[0] if kvarn else "blocks"
                    by_kind[kind] = by_kind.get(kind, 0) + s
                tokens = len(ids) if kvarn else align_to_block_size(len(ids), TILE)
                rows.append({"dtype": dtype, "prompt": len(ids), "tokens": tokens, "bytes": by_kind})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure`'s rows; ``x fewer`` is against the 16-bit row of the same prompt."""
    base = {r["prompt"]: sum(r["bytes"].values()) / r["tokens"] for r in rows if r["dtype"] == "auto"}
    out = [
        "| kv_cache_dtype | connector | prompt | tokens held | bytes written | bytes / token | x fewer than 16-bit "
        "| tiles / tail / sink bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = sum(r["bytes"].values())
        per = total / r["tokens"]
        ratio = f"{base[r['prompt']] / per:.2f}" if r["prompt"] in base else "-"
        b = r["bytes"]
        parts = f"{b.get('tile', 0):,} / {b.get('tail', 0):,} / {b.get('sink', 0):,}" if "blocks" not in b else "-"
        conn = "ExampleConnector" if "blocks" in b else "KvarnStorageConnector"
        out.append(
            f"| {r['dtype']} | {conn} | {r['prompt']} | {r['tokens']} | {total:,} | {per:,.0f} | {ratio} | {parts} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args_list = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 2000])
    ap.add_argument("--dtypes", nargs="+", default=["kvarn_k4v2_g128", "auto", "fp8"])
    ap.add_argument("--doc", type=Path, help="replace this page's connector-bytes section")
    args = ap.parse_args(args_list)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the prompts need a few MiB
    prompts = _prompts(args.prompt_lens)
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        try:
            rows += measure(dtype, prompts)
        except Exception as e:  # a dtype this vLLM build cannot serve: say so, measure the rest
            print(f"{dtype}: not measured ({type(e).__name__}: {e})", file=sys.stderr)
    text = table(rows)
    print(text)
    if args.doc:
        cmd = " ".join(["python tools/connector_bytes.py", *measuring_args(args_list, ("--doc",))])
        write_section(args.doc, "connector-bytes", f"`{cmd}` ({utc_stamp()}, {MODEL}, bfloat16):\n\n{text}")


if __name__ == "__main__":
    main()
