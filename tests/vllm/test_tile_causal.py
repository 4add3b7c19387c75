"""Tile-causal attention through the backend's step planner and layer forward (CPU ops, no engine).

Every query in tile ``j`` must see the packed tiles ``0..j-1`` as the reference codec decodes them
(tile 0 with its exact sink rows where the scheme keeps them) and the tokens of tile ``j`` up to
itself exactly: in prefill, chunked prefill, decode and mixed steps alike, so outputs do not depend
on how the prompt was split or whether its prefix was cached.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.codec import dequantize_tiles, quantize_tiles  # noqa: E402
from kvarn.kernels import AttentionOps  # noqa: E402
from kvarn.kernels.cpu import ops as cpu_ops  # noqa: E402
from kvarn.kernels.cpu.ops import SHORT_SEGMENT  # noqa: E402
from kvarn.schemes import Scheme  # noqa: E402
from kvarn.vllm.forward import run_layer  # noqa: E402
from kvarn.vllm.sinks import SinkPool  # noqa: E402
from kvarn.vllm.step import build_step  # noqa: E402
from kvarn.vllm.tail import Scratch, plan_tails, tail_layout  # noqa: E402
from tests.kernels._reference import sqnr_db  # noqa: E402

pytestmark = pytest.mark.vllm
T, H, HQ, D, SCALE = 32, 2, 4, 64, 0.125


class Layer:
    """One layer's pages (packed tiles, and the requests' 16-bit tails in their lookahead blocks),
    sink pool and scratch tiles, planned and run the way the backend does it
    (:class:`kvarn.vllm.planner.StepPlanner`)."""

    def __init__(
        self,
        scheme: Scheme,
        slots: int = 4,
        blocks: int = 40,
        dtype: torch.dtype = torch.float32,
        prompts: list[int] | None = None,
    ) -> None:
        """``prompts``: each request's prompt length, to tell the planner which new tokens follow
        a prompt (vLLM's ``is_prefilling``); None: not told."""
        self.scheme = scheme
        self.dtype = dtype
        self.prompts = prompts
        self.pages = torch.zeros(blocks, H, scheme.tile_bytes(D) + 8, dtype=torch.uint8)  # wider pages are fine
        self.layout = tail_layout(scheme, D, 1, dtype)
        self.scratch = Scratch()
        cap = T if scheme.sink_tile else scheme.sink_tokens
        self.sinks = SinkPool(slots, cap, T) if cap else None
        self.sink = (
            (torch.zeros(slots, H, cap, D, dtype=dtype), torch.zeros(slots, H, cap, D, dtype=dtype)) if cap else None
        )

    def step(
        self, items: list[tuple[int, int, list[int]]], data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """``items``: (request, new tokens, block ids: its tiles, then at least ``layout.blocks``
        lookahead blocks); ``data[request]``: its q, k, v. Returns outputs."""
        qsl, lens, rows, qs, ks, vs = [0], [], [], [], [], []
        for r, n, row in items:
            done = self.done.get(r, 0)
            qsl.append(qsl[-1] + n)
            lens.append(done + n)
            rows.append(row)
            q, k, v = data[r]
            qs.append(q[done : done + n])
            ks.append(k[done : done + n])
            vs.append(v[done : done + n])
            self.done[r] = done + n
        decode = all(n == 1 for _, n, _ in items)
        prompts = self.prompts
        prefilling = None if prompts is None else [self.done[r] - n < prompts[r] for r, n, _ in items]
        plans, moves = plan_tails(qsl, lens, rows, self.layout, torch.device("cpu"))
        if self.sinks is not None:
            self.sinks.plan(plans)
        width = max(len(r) for r in rows)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        st = build_step(
            plans, table, T, sink_tile=self.scheme.sink_tile, has_sink=self.sink is not None, decode=decode,
            prefilling=prefilling, tail=moves, layout=self.layout, scratch=self.scratch,
        )  # fmt: skip
        if st.decode_rows is not None:  # prompt segments short enough for the decode kernel, routed to prefill
            short = [0 < n <= SHORT_SEGMENT for n in st.cu_seqlens.diff().tolist()]
            self.short_prompt_rows += sum(s and not d for s, d in zip(short, st.decode_rows.tolist(), strict=True))
        out = torch.zeros(qsl[-1], HQ, D, dtype=self.dtype)
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        run_layer(q, k, v, self.pages, self.sink, st, self.scheme, SCALE, out, ops=self.ops)
        return [out[a:b] for a, b in zip(qsl, qsl[1:], strict=False)]

    done: dict[int, int]
    short_prompt_rows = 0  # rows the decode kernel would take, sent to the prefill path as prompt rows
    ops: AttentionOps | None = None  # None: the CPU ops as served (the native store)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Tile-causal attention of all positions of one sequence, float32, by the reference codec."""
    n = q.shape[0]
    full = n // T
    kq, vq = k.clone(), v.clone()
    if full:
        tiles = [x[: full * T].view(full, T, H, D).permute(0, 2, 1, 3).reshape(-1, T, D) for x in (k, v)]
        kd, vd = dequantize_tiles(quantize_tiles(tiles[0], tiles[1], scheme), scheme, D)
        kq[: full * T] = kd.view(full, H, T, D).permute(0, 2, 1, 3).reshape(-1, H, D)
        vq[: full * T] = vd.view(full, H, T, D).permute(0, 2, 1, 3).reshape(-1, H, D)
    exact = T if scheme.sink_tile else scheme.sink_tokens
    kq[:exact], vq[:exact] = k[:exact], v[:exact]
    out = torch.empty(n, HQ, D)
    g = HQ // H
    for j in range(0, n, T):
        e = min(n, j + T)
        kk = torch.cat([kq[:j], k[j:e]]).repeat_interleave(g, 1).transpose(0, 1)
        vv = torch.cat([vq[:j], v[j:e]]).repeat_interleave(g, 1).transpose(0, 1)
        mask = torch.ones(e - j, e, dtype=torch.bool).tril(diagonal=j)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[j:e].transpose(0, 1), kk, vv, attn_mask=mask, scale=SCALE
        )
        out[j:e] = o.transpose(0, 1)
    return out


def _data(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, H, H))
    return q, k, v


def _run(scheme: Scheme, chunks: list[list[int]], total: list[int]) -> list[torch.Tensor]:
    """Requests of ``total`` tokens fed by steps of ``chunks`` (new tokens per request, 0: absent),
    each checked against the tile-causal reference (float32)."""
    layer = Layer(scheme)
    outs, data = _serve(layer, chunks, total)
    for r in range(len(total)):
        torch.testing.assert_close(outs[r], _reference(*data[r], scheme), atol=3e-5, rtol=1e-4)
    return outs


def _serve(
    layer: Layer, chunks: list[list[int]], total: list[int]
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Outputs of requests of ``total`` tokens (request ``r``'s data seeded by ``r``, in the layer's
    dtype) fed by steps of ``chunks``, and their data."""
    layer.done = {}
    data = [_data(n, seed=r, dtype=layer.dtype) for r, n in enumerate(total)]
    width = 4 + layer.layout.blocks  # the tiles of the longest request (at most 4 here), then its lookahead
    rows = [[1 + width * r + i for i in range(width)] for r in range(len(total))]
    assert width * len(total) < layer.pages.shape[0]
    outs = [torch.zeros(n, HQ, D, dtype=layer.dtype) for n in total]
    for step in chunks:
        items = []
        for r, c in enumerate(step):
            if c:
                seq = layer.done.get(r, 0) + c
                items.append((r, c, rows[r][: (seq + T - 1) // T + layer.layout.blocks]))
        starts = {r: layer.done.get(r, 0) for r, _, _ in items}
        for (r, c, _), o in zip(items, layer.step(items, data), strict=True):
            outs[r][starts[r] : starts[r] + c] = o
    assert [layer.done[r] for r in range(len(total))] == total
    return outs, data


# explicit fields: built-in names may change their sink default
SCHEMES = [
    Scheme(4, 2, T, sink_tokens=0),
    Scheme(4, 2, T, sink_tokens=1),
    Scheme(4, 4, T, sink_tokens=4),
    Scheme(4, 2, T, sink_tile=True),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_prefill_chunks_decode_and_mixed_steps_are_tile_causal(scheme: Scheme) -> None:
    """Two requests: one long prefill + decode, one chunked (chunks not tile-aligned) + decode; steps
    mix prefill chunks and decode tokens; tiles complete inside chunks and on decode tokens."""
    steps = [[70, 0], [1, 20], [1, 45], [1, 0], *[[1, 1]] * 10, [0, 3], [2, 0]]
    total = [sum(s[0] for s in steps), sum(s[1] for s in steps)]
    outs = _run(scheme, steps, total)  # asserts every request against the tile-causal reference
    for out, n in zip(outs, total, strict=True):  # and every token got an output row (rows start at 0)
        assert out.shape[0] == n and bool(out.abs().sum(-1).gt(0).all())


def test_outputs_do_not_depend_on_chunking() -> None:
    scheme = Scheme(4, 2, T, sink_tokens=1)
    a = _run(scheme, [[70], [1], [1]], [72])
    b = _run(scheme, [[33], [20], [17], [1], [1]], [72])
    c = _run(scheme, [[30], *[[1]] * 42], [72])
    torch.testing.assert_close(a[0], b[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(a[0], c[0], atol=2e-5, rtol=0)


# request 0: a 100-token prompt (tiles 0-2 full, 4 tokens in tile 3), then 8 tokens past it; requests 1
# and 2 (prompts of 70 and 40 tokens) share its steps
PROMPTS = [100, 70, 40]
ALONE = [[64], [36], *[[1]] * 8]
COMPOSITIONS = {
    "a short last chunk": [[40], [50], [10], *[[1]] * 8],
    "a chunk that ends 3 tokens into a tile": [[67], [33], *[[1]] * 8],
    "chunks of other widths beside other prompts": [[30, 40, 0], [44, 30, 0], [26, 0, 40], *[[1, 1, 0]] * 8],
    "decode tokens beside prefill chunks": [[64, 0, 0], [36, 0, 0], [1, 50, 0], [1, 20, 17], [1, 1, 23], *[[1]] * 5],
    "verified in segments past the prompt": [[100], [3, 40], [1, 30], [4, 0]],
}


@pytest.mark.parametrize(
    "scheme", [Scheme(4, 2, T, sink_tokens=1), Scheme(4, 2, T, sink_tile=True)], ids=lambda s: s.name
)
@pytest.mark.parametrize("steps", list(COMPOSITIONS.values()), ids=list(COMPOSITIONS))
def test_bfloat16_outputs_do_not_depend_on_the_step_composition(scheme: Scheme, steps: list[list[int]]) -> None:
    """A request's bfloat16 outputs are bit-identical however its prompt is chunked and whatever
    shares its steps: prompt tokens by the prefill path at one padded width, tokens past the prompt
    (decode steps, beside prefill chunks, verified a few at once) as decode rows."""
    fed = [sum(s[r] for s in steps if r < len(s)) for r in range(3)]
    total = [n for n in fed if n]
    alone, _ = _serve(Layer(scheme, dtype=torch.bfloat16, prompts=PROMPTS), ALONE, [108])
    together, _ = _serve(Layer(scheme, dtype=torch.bfloat16, prompts=PROMPTS), steps, total)
    assert bool(alone[0].abs().sum(-1).gt(0).all())
    differ = (alone[0] != together[0]).flatten(1).any(1).nonzero().flatten().tolist()
    assert differ == [], f"tokens {differ} of request 0 differ from its run alone"


# The CPU ops with the reference codec's store: tiles bit-exact to the codec's, so the outputs meet the
# tile-causal reference at float32 rounding. The native store is within its own tolerance of the codec
# (tests/fuzz/test_kernels.py); one key scale one fp16 step apart moves these outputs by 2e-4 (88 dB).
REFERENCE_STORE = SimpleNamespace(
    decode_attention=cpu_ops.decode_attention,
    prefill_attention=cpu_ops.prefill_attention,
    store_tiles=functools.partial(cpu_ops.store_tiles, impl="reference"),
)
# bfloat16 against the float32 reference over the same (bf16) inputs: rounding the output to an 8-bit
# significand alone costs about 59 dB (relative error uniform within 2**-9); the prefill path attends in
# bfloat16 besides (53.1-55.1 dB measured here); 45 dB leaves room for vLLM's CPU attention kernel, which
# rounds in another order, far above a wrong context (a tile's rows dropped or misplaced: < 30 dB).
BF16_SQNR_DB = 45.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("steps", list(COMPOSITIONS.values()), ids=list(COMPOSITIONS))
def test_prompt_rows_routed_by_is_prefilling_match_the_reference(steps: list[list[int]], dtype: torch.dtype) -> None:
    """Told which requests are prefilling (vLLM's ``is_prefilling``), the planner sends short prompt
    segments to the prefill path rather than the decode kernel; every request's outputs still match
    the tile-causal reference codec's attention (float32 over the same inputs)."""
    scheme = Scheme(4, 2, T, sink_tokens=1)
    layer = Layer(scheme, dtype=dtype, prompts=PROMPTS)
    layer.ops = REFERENCE_STORE
    total = [n for n in (sum(s[r] for s in steps if r < len(s)) for r in range(3)) if n]
    outs, data = _serve(layer, steps, total)
    assert layer.short_prompt_rows > 0  # the routing this test is about took place
    for r in range(len(total)):
        ref = _reference(*(x.float() for x in data[r]), scheme)
        if dtype == torch.float32:
            torch.testing.assert_close(outs[r], ref, atol=3e-5, rtol=1e-4)
        else:
            got = sqnr_db(ref, outs[r].float())
            assert got >= BF16_SQNR_DB, (r, got)
