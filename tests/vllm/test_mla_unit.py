"""kvarn's MLA path without an engine: the latent codec, and the planner + store + decode of
:mod:`kvarn.vllm.mla` against attention computed from the rows directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvarn.codec.latent import dequantize_latent, latent_tile_bytes, quantize_latent
from kvarn.schemes import Scheme

T, LATENT, ROPE, HEADS = 32, 256, 64, 4


def test_latent_codec_round_trip_and_size() -> None:
    """RoPE dims come back bit-exact, the latent within 4-bit error; 8-bit is near-exact; the record
    of a DeepSeek row (512 + 64) at k4 g128 is 2.8x smaller than bf16."""
    torch.manual_seed(0)
    latent = torch.randn(3, T, LATENT) * torch.linspace(0.1, 4, LATENT)
    rope = torch.randn(3, T, ROPE).to(torch.bfloat16)
    for bits, bound in ((4, 0.12), (8, 0.01)):
        scheme = Scheme(bits, bits, T)
        rec = quantize_latent(latent, rope, scheme, torch.bfloat16)
        assert rec.shape == (3, latent_tile_bytes(scheme, LATENT, ROPE)) and rec.dtype == torch.uint8
        rows = dequantize_latent(rec, scheme, LATENT, ROPE, torch.bfloat16)
        assert torch.equal(rows[..., LATENT:], rope.float())
        err = (rows[..., :LATENT] - latent).norm() / latent.norm()
        assert err < bound, (bits, err)
    assert 1152 * 128 / latent_tile_bytes(Scheme(4, 2, 128), 512, 64) == pytest.approx(2.82, abs=0.01)
    with pytest.raises(ValueError, match="multiple of 128"):
        latent_tile_bytes(Scheme(4, 2, T), 96, 32)


SCHEMES = [Scheme(4, 2, T, sink_tokens=0), Scheme(4, 2, T, sink_tokens=2), Scheme(4, 2, T, sink_tile=True)]


@pytest.mark.vllm
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_mla_store_and_decode_match_the_reference(scheme: Scheme) -> None:
    """Two requests (prompts of 90 and 60 rows, tiles in blocks [3, 5, 7, 9] and [2, 4, 6], each
    followed by its lookahead blocks), then decode steps that cross tile boundaries: every decode
    output equals attention over the rows as kvarn keeps them (full tiles through the latent codec,
    the exact first rows where the scheme keeps them, the partial tile exact: its rows come back from
    the lookahead pages, since a step's scratch tiles start empty), and pages hold exactly the codec's
    records."""
    pytest.importorskip("vllm")
    from kvarn.vllm.mla import KvarnMLAImpl, MLAPlanner
    from kvarn.vllm.tail import page_layout

    torch.manual_seed(1)
    width = LATENT + ROPE
    slots = 3
    nbytes = latent_tile_bytes(scheme, LATENT, ROPE)
    layout = page_layout(scheme, nbytes, width, torch.float16, vectors=1)
    assert layout.rows_per_page == nbytes // (2 * width) and layout.blocks >= 2  # rows of one tile span pages
    planner = MLAPlanner(scheme, slots, layout)
    impl = KvarnMLAImpl.__new__(KvarnMLAImpl)  # the parts a forward uses, without a vLLM config
    cap = T if scheme.sink_tile else scheme.sink_tokens
    impl.scheme, impl.kv_lora_rank, impl.qk_rope_head_dim, impl.width = scheme, LATENT, ROPE, width
    impl.rope_type, impl.nbytes, impl.scale, impl.layout = torch.float16, nbytes, 0.1, layout
    impl.sink = torch.zeros(slots, cap, width) if cap else None
    cache = torch.zeros(20, 1, impl.nbytes + 8, dtype=torch.uint8)  # pages may be wider than a record
    ahead = [[11 + 2 * j for j in range(layout.blocks)], [10 + 2 * j for j in range(layout.blocks)]]
    rows_of = [[3, 5, 7, 9] + ahead[0], [2, 4, 6] + ahead[1]]
    total = [90 + 10, 60 + 10]
    data = [torch.randn(n, width).to(torch.float16).float() for n in total]  # rope exact in float16
    lens = [0, 0]
    steps = [[90, 60]] + [[1, 1]] * 10  # 90 -> 100 crosses 96, 60 -> 70 crosses 64
    for step in steps:
        qsl = [0, step[0], step[0] + step[1]]
        new_lens = [a + b for a, b in zip(lens, step, strict=True)]
        m = SimpleNamespace(
            num_reqs=2,
            query_start_loc_cpu=torch.tensor(qsl),
            seq_lens=torch.tensor(new_lens),
            block_table_tensor=torch.tensor([r + [0] * (4 + layout.blocks - len(r)) for r in rows_of]),
        )
        st = planner.build(m)
        for tile in planner.scratch.tiles or ():  # what a step reads of a partial tile comes from its pages
            tile.fill_(float("nan"))
        new = torch.cat([data[i][lens[i] : new_lens[i]] for i in range(2)])
        impl.store(new[:, :LATENT], new[:, None, LATENT:], cache, st)
        lens = new_lens
        if step[0] > 1:
            continue
        q = torch.randn(2, HEADS, width)
        out, _ = impl.forward_mqa(q, cache, SimpleNamespace(kvarn=st), None)
        for i in range(2):
            n_full = lens[i] // T
            keys = data[i][: lens[i]].clone()
            for j in range(n_full):
                block = rows_of[i][j]
                tile = data[i][j * T : (j + 1) * T][None]
                rec = quantize_latent(tile[..., :LATENT], tile[..., LATENT:], scheme, torch.float16)
                assert torch.equal(cache[block, 0, : impl.nbytes], rec[0])
                keys[j * T : (j + 1) * T] = dequantize_latent(rec, scheme, LATENT, ROPE, torch.float16)[0]
            if n_full:
                keys[:cap] = data[i][:cap]
            probs = (torch.einsum("hd,nd->hn", q[i], keys) * 0.1).softmax(-1)
            ref = probs @ keys[:, :LATENT]
            torch.testing.assert_close(out[i], ref, atol=2e-5, rtol=1e-4)
