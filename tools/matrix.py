"""The feature matrix through vLLM: combinations of serving features, each checked the same way.

Each cell is an engine setting (prefix caching with real hits, chunks that cut tiles, ngram
speculative decoding, preemption, an abort mid-tile, TP=2, a per-layer mixed-bit preset, a
sliding-window model, a hybrid model, all of the first five at once). In each cell a crowd of
distinct requests (three shared prefixes of 1.5 tiles, two suffixes each) is served at once, then
every request alone on an empty prefix cache, by the same engine. A request is *exact* when its
greedy tokens are identical, *near-tie* when they first differ where both runs rank the two tokens
within :data:`kvarn.testing.greedy.NEAR_TIE` (logprobs within ``MAX_DRIFT`` before), else *wrong*.
vLLM's free blocks after the crowd and after the solo runs must equal those before it (no tail
block, sink or cached block leaked).

Crowd against alone compares kvarn with itself: a feature that moved every output alike would pass.
So each cell of the plain models is also compared with the reference it must equal: the ``plain``
cell on the same model, cache and dtype (prefix caching off, each prompt in one chunk, no
speculation, no preemption, one worker), each request alone. In float32 a request is *exact* when
its tokens are the reference's and every logprob is within :data:`FLOAT32_DRIFT` (another chunking
or worker count sums in another order: rounding only). In bfloat16 it is *exact* when its tokens are
the reference's and every logprob within :func:`kvarn.testing.greedy.bf16_tolerance` of the logits'
magnitude there (derived from bfloat16's 8 significant bits; the plain cell measures the magnitudes
with a float32 forward of its completions), a *near-tie* when the tokens first differ where the two
runs' gaps between the two tokens sum within that bound, else *wrong*; and the cell proves its
feature ran (prefix tokens hit, draft tokens accepted, preemptions, a prompt longer than the step's
token budget, two workers). The mixed-bit, sliding-window and hybrid cells
serve other schemes or models than any plain run; they keep the crowd-against-alone column only
(a mixed-bit preset's layers are compared with the uniform schemes' bytes in
``tests/vllm/test_mixed_layers.py``).

Every cell runs with kvarn's cache and with vLLM's 16-bit cache, in float32 (vLLM's CPU ops then
compute a request alike in any batch, so a kvarn difference is kvarn's) and in bfloat16 (as users
serve), each engine in a fresh process with vLLM's engine core in-process (so the block pool can be
read). Results are kept per run in ``--work`` (an interrupted matrix resumes); the table goes to
stdout, ``--json`` and ``--doc`` (a section of docs/reliability.md)::

    python tools/matrix.py --doc docs/reliability.md
    python tools/matrix.py --cells prefix,tp2 --dtypes float32 --json matrix.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import measured_at, measuring_args, write_section

GEN = 16  # greedy tokens per request
PREFIX, SUFFIXES = 192, (60, 180)  # 1.5 tiles shared, then distinct tokens; each crosses a tile in decode
ABORT_AFTER = 3  # tokens the aborted request produces before it is aborted
FLOAT32_DRIFT = 1e-3  # float32 logprobs of another summation order differ by ~1e-5 (docs/connectors.md)
KVARN = "kvarn_k4v2_g128"
MIXED = "kvarn_k4v2_g128_L0k2v2_L11k2v2_L17-18k4v3_L29k2v2"  # the tuned SmolLM2 mix, on 128-token tiles


@dataclass(frozen=True)
class Cell:
    """One combination: ``engine`` keyword arguments for :func:`kvarn.vllm.engine.cpu_engine`, the
    model (``smollm2``, ``tiny`` a random Llama that TP=2 can split, ``windowed`` SmolLM2 with 5 of
    6 layers sliding, ``hybrid`` a random Mamba2 + attention model), and what the crowd adds."""

    name: str
    what: str
    model: str = "smollm2"
    engine: dict[str, Any] = field(default_factory=dict)
    preempt: bool = False  # KV memory for the longest request and the start of another: vLLM must preempt
    abort: bool = False  # one more request, aborted mid-tile once it produced ABORT_AFTER tokens
    kvarn_dtype: str = KVARN
    reference: bool = True  # compared with the plain cell of its model (module docstring)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
CELLS = (
    Cell("plain", "the reference: no prefix caching, one chunk per prompt",
         engine={"enable_prefix_caching": False, "max_num_batched_tokens": 1024}),
    Cell("prefix", "prefix caching, shared prefixes (hits)"),
    Cell("no-prefix", "prefix caching off", engine={"enable_prefix_caching": False}),
    Cell("chunks", "chunks of 96 tokens (cut tiles)", engine={"max_num_batched_tokens": 96}),
    Cell("ngram", "ngram speculative decoding", engine={"speculative_config": NGRAM}),
    Cell("preempt", "KV memory too small for two requests (preemption)", preempt=True),
    Cell("abort", "a request aborted mid-tile", abort=True),
    Cell("tp2", "tensor parallel 2 (random Llama, 2 KV heads)", model="tiny", engine={"tensor_parallel_size": 2}),
    Cell("mixed", "per-layer mixed-bit preset", kvarn_dtype=MIXED, reference=False),
    Cell("sliding", "sliding-window layers (window 64, 5 of 6)", model="windowed", reference=False),
    Cell("hybrid", "hybrid Mamba2 + attention (prefix caching off)", model="hybrid",
         engine={"enable_prefix_caching": False, "block_size": None}, reference=False),
    Cell("all", "prefix hits + chunks of 96 + ngram + preemption + abort",
         engine={"max_num_batched_tokens": 96, "speculative_config": NGRAM}, preempt=True, abort=True),
)  # fmt: skip
CELL_NAMES = [c.name for c in CELLS]
MODELS = ("smollm2", "tiny", "windowed", "hybrid")


def model_folder(kind: str, work: Path) -> Path:
    """The model of a cell, built once into ``work`` (nothing is downloaded)."""
    from kvarn.models import resolve_model

    if kind == "smollm2":
        return Path(resolve_model("smollm2-135m"))
    folder = work / "models" / kind
    if (folder / "config.json").exists():
        return folder
    if kind == "tiny":
        from kvarn.testing.synthetic import make_tiny_llama

        return make_tiny_llama(folder, head_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    if kind == "windowed":
        from kvarn.testing.builders import windowed_copy

        return windowed_copy(folder, window=64, every=6, for_vllm=True)
    if kind == "hybrid":
        import torch

        from kvarn.testing.builders import build, granite_hybrid_config, save

        return save(build(granite_hybrid_config()).to(torch.bfloat16), folder)
    raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(MODELS)}")


def crowd_prompts(vocab: int) -> list[list[int]]:
    """Three prefixes of :data:`PREFIX` tokens, each with two suffixes: six distinct prompts of the
    bundled GPL-3 (token ids modulo ``vocab``)."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    ids = [
        i % vocab
        for i in tok(resources.files("kvarn").joinpath("data", "gpl-3.txt").read_text(encoding="utf-8"))["input_ids"]
    ]
    prompts = []
    for p in range(3):
        prefix = ids[p * 1000 : p * 1000 + PREFIX]
        for s, n in enumerate(SUFFIXES):
            start = p * 1000 + 400 + s * 200
            prompts.append(prefix + ids[start : start + n])
    return prompts


def _preempt_memory(folder: Path, kv_cache_dtype: str, dtype: str) -> int:
    """KV memory in which two requests of the crowd start but cannot both grow, so vLLM preempts: the
    longest request's tiles and one more (vLLM's 16-bit cache), or its tiles and two requests' tail
    blocks (kvarn): a block less than the longest request grown beside one of two tiles holds (with
    that block more, both finish without a preemption)."""
    import torch
    from transformers import AutoConfig

    from kvarn.schemes import Scheme
    from kvarn.vllm.pools import pool_bytes
    from kvarn.vllm.tail import tail_layout

    cfg = AutoConfig.from_pretrained(folder)
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tiles = -(-(PREFIX + max(SUFFIXES) + GEN) // 128)
    torch_dtype = getattr(torch, dtype)
    if kv_cache_dtype == "auto":
        page = 128 * heads * 2 * head_dim * int(torch_dtype.itemsize) * layers
        return int((tiles + 1) * page)
    scheme = Scheme.from_name(kv_cache_dtype)
    layer_schemes = [scheme.for_layer(i) for i in range(layers)]
    page = sum(s.tile_bytes(head_dim) for s in layer_schemes if s is not None) * int(heads)
    tail = tail_layout(scheme, head_dim, layers, torch_dtype, max_rollback=3).blocks
    pools = layers * pool_bytes(scheme, heads, head_dim, torch_dtype, 8)
    return int(pools + (tiles + 2 * tail) * page)


def _free_blocks(llm: Any) -> int:
    return int(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def run_one(cell: Cell, cache: str, dtype: str, work: Path) -> dict[str, Any]:
    """Serve ``cell``'s crowd and each request alone with ``cache`` ("kvarn" or "default") in ``dtype``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.testing.greedy import TOP, agree, first_difference, greedy
    from kvarn.vllm.engine import cpu_engine

    folder = model_folder(cell.model, work)
    kv_cache_dtype = cell.kvarn_dtype if cache == "kvarn" else "auto"
    kw: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "enable_chunked_prefill": True}
    kw |= cell.engine
    kw["kv_cache_memory_bytes"] = _preempt_memory(folder, kv_cache_dtype, dtype) if cell.preempt else 2**30
    if cell.preempt:  # vLLM refuses KV memory that holds no request of max_model_len
        kw["max_model_len"] = 128 * -(-(PREFIX + max(SUFFIXES) + GEN) // 128)
        # vLLM admits a request by default only when its whole prompt fits beside the running ones,
        # which kvarn's tail blocks (5 per request in bfloat16) left to one request at a time: no
        # preemption. Admitted by its first chunk, a request's later chunks find no free block.
        kw["scheduler_reserve_full_isl"] = False
    if cell.engine.get("tensor_parallel_size", 1) == 2:  # a core per rank; both share one when one is allowed
        first, second = (sorted(os.sched_getaffinity(0)) * 2)[:2]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}|{second}"
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True, logprobs=TOP)
    with cpu_engine(str(folder), kv_cache_dtype, dtype=dtype, disable_log_stats=False, **kw) as llm:
        prompts = crowd_prompts(llm.llm_engine.model_config.get_vocab_size())
        engine = llm.llm_engine
        free0 = _free_blocks(llm)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
        if cell.abort:
            engine.add_request("abort", TokensPrompt(prompt_token_ids=prompts[0][:150]), sp)
        done: dict[str, Any] = {}
        aborted = not cell.abort
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "abort" and not aborted and len(out.outputs[0].token_ids) >= ABORT_AFTER:
                    engine.abort_request(["abort"])
                    aborted = True
                elif out.finished and out.request_id != "abort":
                    done[out.request_id] = out
        crowd = greedy([done[str(i)] for i in range(len(prompts))])
        cached = sum(int(done[str(i)].num_cached_tokens or 0) for i in range(len(prompts)))
        free_crowd = _free_blocks(llm)
        metrics = {m.name: m for m in llm.get_metrics()}
        preemptions = int(getattr(metrics.get("vllm:num_preemptions"), "value", 0) or 0)
        accepted = int(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens"), "value", 0) or 0)
        alone = []
        for p in prompts:
            llm.reset_prefix_cache()
            alone.append(greedy(llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False))[0])
        free_end = _free_blocks(llm)
    forced: dict[str, Any] = {}
    if cell.name == "plain" and dtype == "bfloat16":
        forced = _forced(folder, prompts, [g.tokens for g in alone])
    rows = []
    for a, b in zip(crowd, alone, strict=True):
        at = first_difference(a, b)
        why = agree(a, b)
        rows.append({"verdict": "exact" if at is None else ("wrong" if why else "near-tie"), "at": at, "why": why})
    return {
        "cell": cell.name, "cache": cache, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "requests": rows,
        "free_blocks": [free0, free_crowd, free_end], "preemptions": preemptions,
        "prefix_tokens_hit": cached, "draft_tokens_accepted": accepted,
        "step_budget": kw.get("max_num_batched_tokens"), "longest_prompt": max(map(len, prompts)),
        "workers": cell.engine.get("tensor_parallel_size", 1),
        "crowd": [asdict(g) for g in crowd], "alone": [asdict(g) for g in alone], **forced,
    }  # fmt: skip


def _forced(folder: Path, prompts: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """What the plain cell's bfloat16 completions are checked with: the logits' magnitudes (``scales``,
    float32) the bound is measured in, and the logprobs transformers' own bfloat16 forward gives the
    same tokens (``eager``: another implementation's rounding, which vLLM's 16-bit cache must keep
    within the bound; kvarn's cache differs from it by quantization too)."""
    from kvarn.testing.logits import forced

    return {
        "scales": forced(folder, prompts, tokens).scales,
        "eager": forced(folder, prompts, tokens, "bfloat16").logprobs,
    }


def eager_margin(plain: dict[str, Any]) -> float:
    """The largest drift between the plain cell's logprobs and transformers' bfloat16 forward of the
    same tokens (``eager``), over its bound (:func:`kvarn.testing.greedy.bf16_tolerance`)."""
    from kvarn.testing.greedy import bf16_tolerance

    return max(
        float(abs(lp - g["top"][i][str(t)])) / bf16_tolerance(z)
        for g, scales, eager in zip(plain["alone"], plain["scales"], plain["eager"], strict=True)
        for i, (t, z, lp) in enumerate(zip(g["tokens"], scales, eager, strict=True))
    )


def exercised(result: dict[str, Any]) -> str:
    """What shows that the cell's feature ran ('' when it did not, or for the plain cell)."""
    name = result["cell"]
    proof = {
        "prefix": f"{result['prefix_tokens_hit']} prefix tokens hit" if result["prefix_tokens_hit"] else "",
        "ngram": f"{result['draft_tokens_accepted']} draft tokens accepted" if result["draft_tokens_accepted"] else "",
        "preempt": f"{result['preemptions']} preempted" if result["preemptions"] else "",
        "chunks": f"prompts of up to {result['longest_prompt']} tokens in steps of {result['step_budget']}"
        if result["longest_prompt"] > (result["step_budget"] or 0)
        else "",
        "tp2": "2 workers" if result["workers"] == 2 else "",
        "abort": "aborted mid-tile",  # the run stops the request itself once it has ABORT_AFTER tokens
        "no-prefix": "prefix caching off",
    }
    if name == "all":
        parts = [proof[k] for k in ("prefix", "ngram", "preempt", "chunks")]
        return ", ".join(parts) if all(parts) else ""
    return proof.get(name, "")


def against_reference(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Each crowd request of ``result`` against the same request alone in the plain cell ``reference``:
    ``{"verdicts": [...], "why": [...], "exercised": ..., "margin": ...}``, verdicts as in the module
    docstring; ``margin``: the largest drift (or summed gaps at a first difference) over its bound."""
    from kvarn.testing.greedy import Greedy, agree, bf16_tolerance, drifts

    verdicts, whys, margin = [], [], 0.0
    for q, (got, ref) in enumerate(zip(result["crowd"], reference["alone"], strict=True)):
        a, b = (Greedy(g["tokens"], [{int(t): v for t, v in d.items()} for d in g["top"]]) for g in (ref, got))
        if result["dtype"] == "float32":
            bound = [FLOAT32_DRIFT] * len(a.tokens)
            why = agree(a, b, bound) if a.tokens == b.tokens else "tokens differ"
        else:
            bound = [bf16_tolerance(z) for z in reference["scales"][q]]
            why = agree(a, b, bound)
        margin = max([margin] + [d / t if t else math.inf for d, t in zip(drifts(a, b), bound, strict=False)])
        verdicts.append("wrong" if why else ("exact" if a.tokens == b.tokens else "near-tie"))
        whys.append(why or "")
    return {"verdicts": verdicts, "why": whys, "exercised": exercised(result), "margin": margin}


def summary(result: dict[str, Any]) -> str:
    """``6/6 exact``, ``5 exact, 1 near-tie (at token 3)``, with ``LEAK`` when the free blocks moved:
    near-ties and wrong requests name the token (0..GEN-1) where each first differs from its solo run."""
    verdicts = [r["verdict"] for r in result["requests"]]
    parts = []
    for v in ("exact", "near-tie", "wrong"):
        hits = [r for r in result["requests"] if r["verdict"] == v]
        at = ", ".join(str(r["at"]) for r in hits if r["at"] is not None)
        if hits:
            parts.append(f"{len(hits)} {v}" + (f" (at token {at})" if at else ""))
    text = f"{len(verdicts)}/{len(verdicts)} exact" if verdicts.count("exact") == len(verdicts) else ", ".join(parts)
    free = result["free_blocks"]
    return text + ("" if free[0] == free[1] == free[2] else f"; LEAK free blocks {free}")


def table(results: list[dict[str, Any]], dtypes: list[str]) -> str:
    """A markdown table: a row per cell, a column per (dtype, cache)."""
    cols = [(d, c) for d in dtypes for c in ("kvarn", "default")]
    by = {(r["cell"], r["model"], r["dtype"], r["cache"]): r for r in results}
    lines = ["| cell | " + " | ".join(f"{c} {d}" for d, c in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, model, what in _rows(results):
        got = [by.get((name, model, d, c)) for d, c in cols]
        cells = [
            summary(r) + (f" ({r['preemptions']} preempted)" if r["preemptions"] else "") if r else "-" for r in got
        ]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rows(results: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """``(cell, model, label)`` of the table rows, in the order of :data:`CELLS`; the model is named where
    a cell ran on another than its own (``--model``, or the plain reference of the TP=2 cell's model)."""
    rows = []
    for cell in CELLS:
        for model in dict.fromkeys(r["model"] for r in results if r["cell"] == cell.name):
            rows.append((cell.name, model, cell.what + ("" if model == cell.model else f" ({model})")))
    return rows


def reference_table(results: list[dict[str, Any]], dtypes: list[str]) -> str:
    """A markdown table: a row per compared cell, a column per (dtype, cache): the verdicts of its crowd
    against the plain cell's solo runs, and what shows that its feature ran."""
    cols = [(d, c) for d in dtypes for c in ("kvarn", "default")]
    compared = [r for r in results if "vs_reference" in r]
    by = {(r["cell"], r["model"], r["dtype"], r["cache"]): r for r in compared}
    if not by:
        return "(no cell compared: run the plain cell beside the others)"
    lines = ["| cell | " + " | ".join(f"{c} {d}" for d, c in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, model, what in _rows(compared):
        got = [by.get((name, model, d, c)) for d, c in cols]
        texts = []
        for r in got:
            if r is None:
                texts.append("-")
                continue
            ref = r["vs_reference"]
            v = ref["verdicts"]
            text = f"{v.count('exact')}/{len(v)} exact" + "".join(
                f", {v.count(k)} {k}" for k in ("near-tie", "wrong") if v.count(k)
            )
            if r["dtype"] == "bfloat16":
                text += f", drift {ref['margin']:.2f} of the bound"
            texts.append(text + f" ({ref['exercised'] or 'FEATURE NOT EXERCISED'})")
        lines.append(f"| {what} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def _cell(name: str, model: str | None) -> Cell:
    cell = next(c for c in CELLS if c.name == name)
    return replace(cell, model=model) if model else cell


def _result_path(work: Path, cell: Cell, cache: str, dtype: str) -> Path:
    return work / f"{cell.name}-{cell.model}-{cache}-{dtype}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELL_NAMES), help=f"comma-separated, of: {', '.join(CELL_NAMES)}")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated (float32, bfloat16)")
    ap.add_argument("--caches", default="kvarn,default", help="kvarn, default (vLLM's 16-bit cache), or both")
    ap.add_argument("--work", type=Path, default=Path("matrix_runs"), help="per-run results and built models")
    ap.add_argument("--json", type=Path, help="write every run's result here")
    ap.add_argument("--doc", type=Path, help="replace the matrix section of this markdown file")
    ap.add_argument("--section", default="matrix", help="the name of that section (default: matrix)")
    ap.add_argument("--model", choices=MODELS, help="serve every cell on this model (a quick check: tiny)")
    ap.add_argument("--one", nargs=3, metavar=("CELL", "CACHE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cells, dtypes, caches = args.cells.split(","), args.dtypes.split(","), args.caches.split(",")
    bad = [c for c in cells if c not in CELL_NAMES] + [d for d in dtypes if d not in ("float32", "bfloat16")]
    bad += [c for c in caches if c not in ("kvarn", "default")]
    if bad:
        ap.error(f"unknown {bad}; cells: {', '.join(CELL_NAMES)}; dtypes: float32, bfloat16; caches: kvarn, default")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.one:
        name, cache, dtype = args.one
        cell = _cell(name, args.model)
        result = run_one(cell, cache, dtype, args.work)
        _result_path(args.work, cell, cache, dtype).write_text(json.dumps(result | {"model": cell.model}, indent=1))
        return 0
    chosen = [_cell(c, args.model) for c in cells]
    for model in dict.fromkeys(c.model for c in chosen if c.reference and c.name != "plain"):
        plain = _cell("plain", model)  # the reference the other cells of this model are compared with
        if plain not in chosen:
            chosen.insert(0, plain)
    runs = [(c, k, d) for d in dtypes for c in chosen for k in caches]
    # VLLM_CPU_KVCACHE_SPACE would replace each cell's KV memory (vLLM's CPU platform prefers it to
    # kv_cache_memory_bytes): a preemption cell would get 1 GiB or more and never preempt
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results = []
    for n, (cell, cache, dtype) in enumerate(runs, 1):
        out = _result_path(args.work, cell, cache, dtype)
        if not out.exists():
            t0 = time.time()
            what = f"{cell.name} ({cell.model}) {cache} {dtype}"
            print(f"[{n}/{len(runs)}] {what} ...", end=" ", flush=True, file=sys.stderr)
            log = out.with_suffix(".log").open("w")
            cmd = [sys.executable, __file__, "--work", str(args.work), "--one", cell.name, cache, dtype]
            cmd += ["--model", cell.model]
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"rc {rc}, {time.time() - t0:.0f} s", file=sys.stderr)
            if rc:
                results.append({"cell": cell.name, "model": cell.model, "cache": cache, "dtype": dtype,
                                "error": f"rc {rc}, see {log.name}"})  # fmt: skip
                continue
        results.append(json.loads(out.read_text()))
    ok = [r for r in results if "error" not in r]
    plains = {(r["model"], r["cache"], r["dtype"]): r for r in ok if r["cell"] == "plain"}
    for r in ok:
        ref = plains.get((r["model"], r["cache"], r["dtype"]))
        if r["cell"] != "plain" and _cell(r["cell"], None).reference and ref is not None:
            r["vs_reference"] = against_reference(r, ref)
    text = table(ok, dtypes) + "\n\nAgainst the reference (the plain cell, each request alone):\n\n"
    text += reference_table(ok, dtypes)
    eager = [r for r in ok if r["cell"] == "plain" and "eager" in r]
    text += "".join(
        f"\n\nThe plain cell ({r['model']}, {r['cache']} cache, bfloat16) against transformers' own bfloat16"
        f" forward of the same tokens: drift {eager_margin(r):.2f} of the bound"
        + (" (kvarn's cache quantizes: no verdict)" if r["cache"] == "kvarn" else "")
        for r in eager
    )
    failed = [f"{r['cell']} {r['cache']} {r['dtype']}: {r['error']}" for r in results if "error" in r]
    print(text + "".join(f"\nfailed: {f}" for f in failed))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.doc:
        measured = measuring_args(
            argv if argv is not None else sys.argv[1:], ("--json", "--doc", "--work", "--section")
        )
        command = " ".join(["python tools/matrix.py", *measured])
        write_section(args.doc, args.section, f"`{command}` ({measured_at()})\n\n{text}\n", title="# Reliability")
    wrong = any(r["verdict"] == "wrong" for r in ok for r in r["requests"])
    wrong |= any("wrong" in r["vs_reference"]["verdicts"] or not r["vs_reference"]["exercised"]
                 for r in ok if "vs_reference" in r)  # fmt: skip
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
