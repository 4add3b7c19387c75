"""KV connectors over kvarn pages (issue 33): ``KvarnStorageConnector`` between two engines, and the
connectors kvarn refuses at start-up.

Engine A (``kv_producer``, no prefix caching: every request computed alone) serves a prompt ``P``
(2 whole tiles and a partial one) and a longer prompt ``L`` that starts with ``P``; the records of
``L`` beyond ``P``'s are then deleted, so the store holds what A saved serving ``P``. Engine B (a
new engine process, ``kv_both``) serves ``L`` first (it loads ``P``'s tiles, tail rows and sink
rows, computes the rest) and then ``P`` (its tiles from B's own prefix cache, its tail rows from the
store). Every greedy token must equal A's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DTYPE = "kvarn_k4v2_g128"  # sink_tokens 1: the sink rows travel too
TILE = 128
SHORT, LONG, GEN = 300, 460, 8  # P: 2 tiles + 44 rows; L: 3 tiles + 76 rows


def __getattr__(name: str) -> Any:
    """``ThirdPartyConnector``: a connector class kvarn does not know (vLLM imports it by module path)."""
    if name != "ThirdPartyConnector":
        raise AttributeError(name)
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    return type(name, (ExampleConnector,), {})


@dataclass
class Served:
    tokens: list[int]  # greedy continuation
    cached: int  # prompt tokens vLLM did not compute (local prefix cache + connector)


@dataclass
class Runs:
    a: dict[str, Served]
    b: dict[str, Served]
    saved: dict[str, int]  # record file name -> bytes, of what A saved serving P
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _prompt(n: int) -> list[int]:
    from transformers import AutoTokenizer

    from kvarn.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    text = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = tok(text)["input_ids"]
    return ids[:n]


def _serve(store: Path, role: str, prompts: dict[str, list[int]], **kw: Any) -> tuple[dict[str, Served], Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine

    transfer = {"kv_connector": "KvarnStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"storage_path": str(store)}}  # fmt: skip
    out: dict[str, Served] = {}
    sp = SamplingParams(max_tokens=GEN, temperature=0)
    with cpu_engine(str(resolve_model("smollm2-135m")), DTYPE, max_model_len=640, max_num_seqs=2,
                    kv_transfer_config=transfer, **kw) as llm:  # fmt: skip
        model = llm.llm_engine.vllm_config.model_config
        shape = (model.get_num_layers(llm.llm_engine.vllm_config.parallel_config), model.get_total_num_kv_heads(),
                 model.get_head_size())  # fmt: skip
        for name, ids in prompts.items():
            r = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            out[name] = Served(list(r.outputs[0].token_ids), int(r.num_cached_tokens or 0))
            if name == "P":
                snapshot = {p.name: p.stat().st_size for p in store.rglob("*.safetensors")}
    return out, (snapshot, shape)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    store = tmp_path_factory.mktemp("kv_store")
    prompts = {"P": _prompt(SHORT), "L": _prompt(LONG)}
    assert prompts["L"][:SHORT] == prompts["P"]
    a, (saved, shape) = _serve(store, "kv_producer", prompts, enable_prefix_caching=False)
    for p in store.rglob("*.safetensors"):
        if p.name not in saved:
            p.unlink()  # what A saved for L beyond P
    b, _ = _serve(store, "kv_both", {"L": prompts["L"], "P": prompts["P"]})
    return Runs(a, b, saved, *shape)


def test_engine_b_decodes_a_prompt_engine_a_saved(runs: Runs) -> None:
    """B loads P's tiles and rows past them (all but the last prompt token) and decodes A's tokens."""
    assert runs.b["P"].cached >= SHORT - 1
    assert runs.b["P"].tokens == runs.a["P"].tokens


def test_a_saved_prefix_is_exact_in_a_longer_prompt(runs: Runs) -> None:
    """B's longer prompt loads what A saved for P (whole tiles, tail rows, sink rows), computes the rest."""
    assert runs.b["L"].cached == SHORT
    assert runs.b["L"].tokens == runs.a["L"].tokens


def test_store_holds_packed_tiles_tail_rows_and_sink_rows(runs: Runs) -> None:
    """A's records of P: its 2 tiles, one tail of 44 rows, one sink; tiles >= 4.3x fewer bytes than 16-bit."""
    kinds = sorted(name.split("-")[0] for name in runs.saved)
    assert kinds == ["sink", "tail", "tile", "tile"]
    tile_bytes = sum(b for n, b in runs.saved.items() if n.startswith("tile-")) / (2 * TILE)
    bf16 = 2 * runs.num_layers * runs.num_kv_heads * runs.head_dim * 2  # keys and values, 2 bytes each
    assert bf16 / tile_bytes >= 4.3
    tail = next(b for n, b in runs.saved.items() if n.startswith("tail-"))
    assert tail >= (SHORT - 2 * TILE) * bf16  # 44 exact rows


@pytest.mark.parametrize(
    ("connector", "why"),
    [
        ("ExampleConnector", "single token rows"),
        ("LMCacheConnectorV1", "16-bit"),
        ("OffloadingConnector", "sink rows"),
        ("NixlConnector", "sink rows"),
        ("MooncakeStoreConnector", "sink rows"),
    ],
)
def test_connectors_that_cannot_carry_kvarn_pages_are_refused(tmp_path: Path, connector: str, why: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.testing.synthetic import write_config_only
    from kvarn.vllm.plugin import register

    register()
    model = str(write_config_only(tmp_path / "m"))
    transfer = {"kv_connector": connector, "kv_role": "kv_both"}
    with pytest.raises(ValueError, match=rf"KV connector '{connector}' .*{why}"):
        EngineArgs(model=model, kv_cache_dtype=DTYPE, kv_transfer_config=transfer).create_engine_config()


def test_kvarn_connector_is_refused_where_it_cannot_carry_everything(tmp_path: Path) -> None:
    """Sliding-window layers (16-bit pages of vLLM's own layout) are refused; a plain model is served, and
    so is vLLM's offloading for a scheme without sink rows; a connector class kvarn does not know is refused."""
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.testing.synthetic import write_config_only
    from kvarn.vllm.plugin import register

    register()
    transfer = {"kv_connector": "KvarnStorageConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"storage_path": str(tmp_path / "s")}}  # fmt: skip
    plain = str(write_config_only(tmp_path / "plain"))
    EngineArgs(model=plain, kv_cache_dtype=DTYPE, kv_transfer_config=transfer).create_engine_config()
    sliding = str(write_config_only(tmp_path / "sw", layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=256, model_type="gemma2"))  # fmt: skip
    with pytest.raises(ValueError, match=r"'KvarnStorageConnector' .*sliding-window layers"):
        EngineArgs(model=sliding, kv_cache_dtype=DTYPE, kv_transfer_config=transfer).create_engine_config()
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}  # whole pages; no sink rows to lose
    EngineArgs(model=plain, kv_cache_dtype=f"{DTYPE}_sink0", kv_transfer_config=offload).create_engine_config()
    elsewhere = {"kv_connector": "ThirdPartyConnector", "kv_role": "kv_both", "kv_connector_module_path": __name__}
    with pytest.raises(ValueError, match=r"'ThirdPartyConnector' .*does not know"):
        EngineArgs(model=plain, kv_cache_dtype=DTYPE, kv_transfer_config=elsewhere).create_engine_config()


def test_vllm_offloading_moves_kvarn_pages_whole_and_back(tmp_path: Path) -> None:
    """vLLM's offloading derives a byte mapping per layer page (``derive_canonical_mappings``); a kvarn
    page is not a token-row layout it recognises, so it must map the page whole. Offloading blocks with
    that mapping's copy plan (``_build_copy_plan``, pointers by ``compute_sub_block_ptrs``; raw pointer
    copies stand in for ``swap_blocks_batch``, which vllm-cpu does not build) and restoring them into
    other blocks gives back every tile record and tail row byte for byte."""
    import ctypes
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef
    from vllm.v1.kv_offload.cpu.gpu_worker import _build_copy_plan, compute_sub_block_ptrs

    from kvarn.codec.tiles import quantize_tiles
    from kvarn.schemes import Scheme
    from kvarn.vllm.connectors.carry import read_tail, read_tiles, write_tail, write_tiles
    from kvarn.vllm.pages import packed_spec
    from kvarn.vllm.tail import tail_layout

    scheme, heads, d, nb = Scheme.from_name(DTYPE), 3, 64, 12
    tile = scheme.tile_bytes(d)
    spec = packed_spec(FullAttentionSpec(block_size=TILE, num_kv_heads=heads, head_size=d, dtype=torch.bfloat16),
                       scheme, tile)  # fmt: skip
    page = spec.real_page_size_bytes
    assert page == heads * tile
    cache = torch.zeros(nb, heads, 1, tile, dtype=torch.uint8)  # as vLLM allocates a kvarn layer: [B, H, 1, page / H]
    pages = cache[:, :, 0, :]
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2 * heads, TILE, d, generator=g, dtype=torch.bfloat16) for _ in range(2))
    write_tiles(pages, [3, 4], quantize_tiles(keys, values, scheme).view(2, heads, tile))
    layout = tail_layout(scheme, d, 1, torch.bfloat16)
    row = [3, 4, 7, 8, 9, 10, 1, 2][: 2 + 1 + layout.blocks]  # tiles 0, 1, 2, then tile 2's lookahead blocks
    rows = torch.randint(0, 256, (40, heads, layout.row_bytes), dtype=torch.uint8, generator=g)
    write_tail(pages, layout, row, 2, rows)

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, prefill_context_parallel_size=1, world_size=1, rank=0,
                                        decode_context_parallel_size=1, cp_kv_cache_interleave_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads),
    )  # fmt: skip
    kv_config = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    mapping = derive_canonical_mappings(config, kv_config, {"l0": cache})["l0"]  # type: ignore[arg-type]
    assert [(r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments) for r in mapping.runs] == [
        (0, 0, page, 1)
    ]
    ref = CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page, mapping=mapping)
    flat = cache.view(nb, page)
    host = torch.zeros(nb, page, dtype=torch.uint8)

    def copy(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int], out: bool) -> None:
        plan = _build_copy_plan(ref, gpu_to_cpu=out)
        s, t = np.zeros(len(src_blocks), np.uint64), np.zeros(len(dst_blocks), np.uint64)
        compute_sub_block_ptrs(np.array(src_blocks), 1, s, src)
        compute_sub_block_ptrs(np.array(dst_blocks), 1, t, dst)
        for a, b in zip(s, t, strict=True):
            for fs, fd, n in zip(plan.frag_offsets_src, plan.frag_offsets_dst, plan.frag_sizes, strict=True):
                ctypes.memmove(int(b + fd), int(a + fs), int(n))

    want_tiles, want_tail = read_tiles(pages, row[:2], tile), read_tail(pages, layout, row, 2, 40)
    slots = list(range(len(row)))
    copy(flat, row, host, slots, out=True)  # offload the request's blocks
    cache.zero_()
    back = [11, 0, 1, 2, 9, 10, 5, 6][: len(row)]
    copy(host, slots, flat, back, out=False)  # restore them into other blocks
    assert torch.equal(read_tiles(pages, back[:2], tile), want_tiles)
    assert torch.equal(read_tail(pages, layout, back, 2, 40), want_tail)


def test_store_matches_tiles_by_chain_and_tail_rows_by_common_prefix(tmp_path: Path) -> None:
    """A tile matches only with every token before it; a stored tail serves any prefix of its rows."""
    import torch

    from kvarn.vllm.connectors.store import ROOT_KEY, RecordStore, tile_keys

    store = RecordStore(tmp_path, "ns")
    tokens = list(range(1000, 1300))  # 2 tiles of 128, 44 rows
    keys = tile_keys(tokens, TILE)
    assert len(keys) == 2
    assert tile_keys([7, *tokens[1:]], TILE)[1] != keys[1]  # tile 1's key covers token 0 too
    store.write_tail(keys[1], tokens[256:], {"l0": torch.zeros(44, 1, 4, dtype=torch.uint8)})
    assert store.longest_tail(keys[1], tokens[256:299]) == (43, store.tail_key(keys[1], tokens[256:]))
    assert store.longest_tail(keys[1], [*tokens[256:266], 5, 6])[0] == 10  # diverges after 10 rows
    assert store.longest_tail(keys[0], tokens[128:140]) == (0, "")  # other tiles before it
    assert store.longest_tail(ROOT_KEY, tokens[:10]) == (0, "")
