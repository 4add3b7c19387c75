"""CPU attention ops (kvarn.kernels.cpu.ops) vs float64 attention over the reference-dequantized context.

The CPU ops compute in float32: SQNR >= 60 dB against the oracle (they reach ~125 dB with float32
queries; half-precision inputs are rounded the same way for the oracle).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from kvarn.bench import cpu_engine, cpu_ops
from kvarn.bench.doc_section import write_section
from kvarn.codec.tiles import layout
from kvarn.kernels import KernelArgumentError, PagedContext
from kvarn.kernels.cpu import native
from kvarn.kernels.cpu import ops as cpu
from kvarn.schemes import Scheme

from ._reference import PagedBatch, assert_store_refusals, attention, paged_batch, sqnr_db

MIN_SQNR_DB = 60.0
HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
# every decode case runs through both paths: the native kernel (where it builds) and the torch path
IMPLS = ["torch", "native"] if HAS_COMPILER else ["torch"]


def test_native_kernel_builds() -> None:
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the ops use the torch path")
    assert native.extension() is not None


def scheme(name: str, sink_tokens: int = 0) -> Scheme:
    """A built-in or named scheme with an explicit ``sink_tokens`` (presets may change their default)."""
    return dataclasses.replace(Scheme.from_name(name), sink_tokens=sink_tokens)


@dataclasses.dataclass
class Args:
    """The staging arguments of one call: per sequence, or pools read by (permuted) slot ids."""

    tail_k: torch.Tensor
    tail_v: torch.Tensor
    kwargs: dict[str, torch.Tensor | None]


def staging(sc: Scheme, pb: PagedBatch, pooled: bool, seed: int = 0) -> Args:
    """Per-sequence tails and sinks as :func:`paged_batch` makes them, or the same rows scattered
    into pools with spare, garbage-filled slots at a random permutation of slot ids."""
    sink_cap = sc.sink_tokens or sc.group_size
    sink_k = None if pb.sink_k is None else pb.sink_k[:, :, :sink_cap]
    sink_v = None if pb.sink_v is None else pb.sink_v[:, :, :sink_cap]
    kw: dict[str, torch.Tensor | None] = {"sink_k": sink_k, "sink_v": sink_v, "sink_lens": pb.sink_lens}
    if not pooled:
        return Args(pb.tail_k, pb.tail_v, kw)
    g = torch.Generator().manual_seed(seed)
    bsz = pb.tail_k.shape[0]

    def pool(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        p = torch.randn(bsz + 3, *rows.shape[1:], generator=g, dtype=rows.dtype) * 100  # never read
        p[slots.long()] = rows
        return p

    tail_slot = torch.randperm(bsz + 3, generator=g)[:bsz].to(torch.int32)
    args = Args(pool(pb.tail_k, tail_slot), pool(pb.tail_v, tail_slot), {**kw, "tail_slot": tail_slot})
    if sink_k is not None and sink_v is not None:
        sink_slot = torch.randperm(bsz + 3, generator=g)[:bsz].to(torch.int32)
        args.kwargs.update(sink_k=pool(sink_k, sink_slot), sink_v=pool(sink_v, sink_slot), sink_slot=sink_slot)
    return args


def _decode_check(sc: Scheme, lens: list[int], hkv: int, group: int, d: int, pooled: bool, seed: int = 0) -> None:
    pb = paged_batch(sc, lens, hkv, d, seed=seed)
    a = staging(sc, pb, pooled, seed)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(seed))
    ref = torch.cat([attention(q[b : b + 1], pb.context_k[b], pb.context_v[b]) for b in range(len(lens))])
    for impl in IMPLS:
        out = cpu.decode_attention(
            q,
            PagedContext(pb.cache, pb.block_table, pb.num_tiles, a.tail_k, a.tail_v, pb.tail_lens, sc, **a.kwargs),
            impl=impl,
        )
        assert out.shape == q.shape and out.dtype == q.dtype
        assert sqnr_db(ref, out) >= MIN_SQNR_DB, impl


@pytest.mark.parametrize(
    "name",
    [
        "kvarn_k4v2_g128",
        "kvarn_k4v4_g64",
        "kvarn_k3v2_g32",
        "kvarn_k2v3_g32_rot-none_it0",
        "kvarn_k8v8_g32_rot-rh_s8",
    ],
)
@pytest.mark.parametrize("pooled", [False, True])
def test_decode_schemes_mixed_lengths(name: str, pooled: bool) -> None:
    sc = scheme(name)
    t = sc.group_size
    # several tiles and a tail, exactly one tile with a full tail, tail only
    _decode_check(sc, [3 * t + 5, 2 * t, 1], hkv=2, group=3, d=64, pooled=pooled)


def test_decode_largest_tile() -> None:
    _decode_check(scheme("kvarn_k3v8_g256_s8"), [256 + 5, 1], hkv=1, group=3, d=64, pooled=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_decode_head_dims_and_gqa(d: int, group: int) -> None:
    _decode_check(scheme("kvarn_k4v2_g32"), [2 * 32 + 17, 32, 9], hkv=2, group=group, d=d, pooled=True, seed=d + group)


@pytest.mark.parametrize("tail", [1, 2, 31, 32])
def test_decode_tail_lengths_up_to_a_full_tile(tail: int) -> None:
    _decode_check(scheme("kvarn_k4v2_g32"), [2 * 32 + tail, tail], hkv=1, group=2, d=64, pooled=True, seed=tail)


@pytest.mark.parametrize(
    ("name", "sink_tokens"),
    [
        ("kvarn_k4v2_g32", 2),
        ("kvarn_k3v2_g32_rot-rh_s8", 8),
        ("kvarn_k2v4_g64_rot-none", 1),
        ("kvarn_k4v2_g32_sink", 0),
    ],
)
@pytest.mark.parametrize("pooled", [False, True])
def test_decode_sinks_read_exact_rows(name: str, sink_tokens: int, pooled: bool) -> None:
    sc = scheme(name, sink_tokens)
    t = sc.group_size
    # tiles and a tail; exactly one tile; tail only (copies ignored), shorter and longer than the sink
    _decode_check(sc, [3 * t + 5, t, 1, 20], hkv=2, group=3, d=64, pooled=pooled)


def test_decode_half_precision_and_out_buffer() -> None:
    sc = scheme("kvarn_k4v2_g32", 2)
    pb = paged_batch(sc, [3 * 32 + 4, 7], 2, 64)
    for dtype in (torch.float16, torch.bfloat16):
        a = staging(sc, dataclasses.replace(pb, tail_k=pb.tail_k.to(dtype), tail_v=pb.tail_v.to(dtype)), True)
        a.kwargs.update(sink_k=a.kwargs["sink_k"].to(dtype), sink_v=a.kwargs["sink_v"].to(dtype))  # type: ignore[union-attr]
        q = torch.randn(2, 4, 64).to(dtype)
        ctx = [(k.clone(), v.clone()) for k, v in zip(pb.context_k, pb.context_v, strict=True)]
        for b, (k, v) in enumerate(ctx):  # the oracle sees the unquantized rows rounded like the inputs
            n = k.shape[1] - int(pb.tail_lens[b])
            k[:, n:], v[:, n:] = k[:, n:].to(dtype).float(), v[:, n:].to(dtype).float()
            k[:, :2], v[:, :2] = k[:, :2].to(dtype).float(), v[:, :2].to(dtype).float()
        ref = torch.cat([attention(q[b : b + 1].float(), *ctx[b]) for b in range(2)])
        for impl, out_dtype in [(i, dtype) for i in IMPLS] + [("auto", torch.float32)]:
            out = torch.full((2, 4, 64), float("nan"), dtype=out_dtype)
            got = cpu.decode_attention(
                q,
                PagedContext(pb.cache, pb.block_table, pb.num_tiles, a.tail_k, a.tail_v, pb.tail_lens, sc, **a.kwargs),
                out=out,
                impl=impl,
            )
            assert got is out
            assert sqnr_db(ref, out.float()) >= 40.0, impl  # output rounding of half precision


def test_decode_strided_query_and_output() -> None:
    """vLLM hands a query split from its fused qkv tensor (rows strided) and writes into a slice."""
    sc = scheme("kvarn_k4v2_g32")
    pb = paged_batch(sc, [3 * 32 + 9, 40], 2, 64, seed=4)
    qkv = torch.randn(2, 6 + 2 * 2, 64, generator=torch.Generator().manual_seed(4))
    q = qkv[:, :6]  # [2, 6, 64], row stride 10 * 64
    ref = torch.cat([attention(q[b : b + 1], pb.context_k[b], pb.context_v[b]) for b in range(2)])
    for impl in IMPLS:
        out = torch.zeros(4, 6, 64)
        cpu.decode_attention(
            q,
            PagedContext(pb.cache, pb.block_table, pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens, sc),
            out=out[1:3],
            impl=impl,
        )
        assert sqnr_db(ref, out[1:3]) >= MIN_SQNR_DB, impl
        assert not out[0].any() and not out[3].any()


def test_decode_sequence_without_tokens_gets_zeros() -> None:
    sc = scheme("kvarn_k4v2_g32")
    pb = paged_batch(sc, [40, 5], 1, 64)
    lens = torch.tensor([0, 5], dtype=torch.int32)
    q = torch.randn(2, 2, 64)
    tiles = torch.tensor([0, 0], dtype=torch.int32)
    for impl in IMPLS:
        out = cpu.decode_attention(
            q, PagedContext(pb.cache, pb.block_table, tiles, pb.tail_k, pb.tail_v, lens, sc), impl=impl
        )
        assert torch.equal(out[0], torch.zeros(2, 64))
        assert sqnr_db(attention(q[1:], pb.tail_k[1, :, :5], pb.tail_v[1, :, :5]), out[1:]) >= MIN_SQNR_DB


def test_native_decode_gives_nan_for_a_query_head_with_nan() -> None:
    """Softmax of NaN scores is NaN: the head with a NaN query gets a NaN row, the other heads are exact."""
    if cpu.native.extension() is None:
        pytest.skip("no native CPU kernel here")
    sc = scheme("kvarn_k4v2_g32")
    pb = paged_batch(sc, [100, 40], 1, 64)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(3))
    q[0, 1, 7] = float("nan")
    ctx = PagedContext(pb.cache, pb.block_table, pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens, sc)
    out = cpu.decode_attention(q, ctx, impl="native")
    assert torch.isnan(out[0, 1]).all()
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[1]).all()
    ref = torch.cat([attention(q[b : b + 1], pb.context_k[b], pb.context_v[b]) for b in range(2)])
    assert sqnr_db(ref[1], out[1]) >= MIN_SQNR_DB


def test_decode_ignores_whatever_rows_past_the_tail_hold() -> None:
    """Rows of a tail slot past its length are not the request's (vLLM's scratch tiles are uninitialized
    memory): NaN there changes nothing, in every implementation."""
    sc = scheme("kvarn_k4v2_g32")
    pb = paged_batch(sc, [2 * 32 + 5, 9], 2, 64, seed=3)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    tail_k, tail_v = pb.tail_k.clone(), pb.tail_v.clone()
    for b, n in enumerate(pb.tail_lens.tolist()):
        tail_k[b, :, n:] = float("nan")
        tail_v[b, :, n:] = float("nan")
    for impl in IMPLS:
        clean = cpu.decode_attention(
            q, PagedContext(pb.cache, pb.block_table, pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens, sc), impl=impl
        )
        dirty = cpu.decode_attention(
            q, PagedContext(pb.cache, pb.block_table, pb.num_tiles, tail_k, tail_v, pb.tail_lens, sc), impl=impl
        )
        assert torch.equal(clean, dirty), impl


def test_decode_mixed_dtypes_fall_back_to_torch() -> None:
    """Tails in another dtype than the query: the native kernel declines, the torch path answers."""
    sc = scheme("kvarn_k4v2_g32")
    pb = paged_batch(sc, [2 * 32 + 3], 1, 64)
    q = torch.randn(1, 2, 64)
    args = (q, pb.cache, pb.block_table, pb.num_tiles, pb.tail_k.half(), pb.tail_v.half(), pb.tail_lens, sc)
    if HAS_COMPILER:
        with pytest.raises(KernelArgumentError, match="native"):
            cpu.decode_attention(args[0], PagedContext(*args[1:]), impl="native")
    ctx_k, ctx_v = pb.context_k[0].clone(), pb.context_v[0].clone()
    ctx_k[:, -3:], ctx_v[:, -3:] = ctx_k[:, -3:].half().float(), ctx_v[:, -3:].half().float()
    assert sqnr_db(attention(q, ctx_k, ctx_v), cpu.decode_attention(args[0], PagedContext(*args[1:]))) >= MIN_SQNR_DB


@pytest.mark.parametrize(
    ("name", "sink_tokens"),
    [("kvarn_k4v2_g32", 0), ("kvarn_k3v2_g32_rot-rh_s8", 4), ("kvarn_k4v2_g32_sink", 0), ("kvarn_k4v4_g64", 0)],
)
@pytest.mark.parametrize("pooled", [False, True])
def test_prefill_chunks_after_context(name: str, sink_tokens: int, pooled: bool) -> None:
    assert _prefill_sqnr(name, sink_tokens, pooled) >= MIN_SQNR_DB


def _prefill_sqnr(name: str, sink_tokens: int, pooled: bool, dtype: torch.dtype = torch.float32) -> float:
    """SQNR (dB) of ``prefill_attention`` against the float reference: chunks of 7, 1 and 2T+3 new
    tokens after 2T+5, T and 0 cached tokens, and a sequence with none (inputs and rows in ``dtype``,
    the reference from the same rounded new tokens and the float context)."""
    sc = scheme(name, sink_tokens)
    t = sc.group_size
    lens, q_lens = [2 * t + 5, t, 0, 3], [7, 1, 2 * t + 3, 0]
    hkv, group, d = 2, 3, 64
    pb = paged_batch(sc, lens, hkv, d, seed=5)
    a = staging(sc, pb, pooled, seed=5)
    g = torch.Generator().manual_seed(1)
    total = sum(q_lens)
    q = torch.randn(total, hkv * group, d, generator=g).to(dtype)
    k, v = torch.randn(total, hkv, d, generator=g).to(dtype), torch.randn(total, hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = {key: x.to(dtype) if x is not None and x.is_floating_point() else x for key, x in a.kwargs.items()}
    out = cpu.prefill_attention(
        q,
        k,
        v,
        cu,
        PagedContext(
            pb.cache, pb.block_table, pb.num_tiles, a.tail_k.to(dtype), a.tail_v.to(dtype), pb.tail_lens, sc, **rows
        ),
    ).float()
    refs = []
    for b in range(len(lens)):
        s, e = int(cu[b]), int(cu[b + 1])
        kk = torch.cat([pb.context_k[b], k[s:e].transpose(0, 1)], 1)
        vv = torch.cat([pb.context_v[b], v[s:e].transpose(0, 1)], 1)
        refs.append(attention(q[s:e], kk, vv, causal_offset=pb.context_k[b].shape[1]))
    return sqnr_db(torch.cat(refs), out)


@pytest.mark.parametrize(("name", "sink_tokens"), [("kvarn_k4v2_g32", 0), ("kvarn_k3v2_g32_rot-rh_s8", 4)])
def test_prefill_in_bfloat16_has_the_accuracy_of_a_16_bit_cache(name: str, sink_tokens: int) -> None:
    """bfloat16 queries: keys and values are attended rounded to bfloat16, as a 16-bit cache holds them."""
    assert _prefill_sqnr(name, sink_tokens, True, torch.bfloat16) >= 40.0


def test_prefill_segments_of_several_requests_equal_each_segment_alone() -> None:
    """Segments are batched (tiles dequantized once, one gathered context per request); each gets
    what it gets alone."""
    sc = scheme("kvarn_k4v2_g32_sink", 0)
    pb = paged_batch(sc, [3 * 32 + 7, 2 * 32 + 1], 2, 64, seed=4)
    a = staging(sc, pb, True, seed=4)
    req = torch.tensor([0, 0, 0, 1, 1])  # each request's segments: after its sink tile, then tile by tile
    tiles = torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32)
    tails = torch.tensor([0, 0, 7, 0, 1], dtype=torch.int32)
    table = pb.block_table[req].contiguous()
    kw = {key: x[req].contiguous() if key.endswith(("_slot", "_lens")) else x for key, x in a.kwargs.items()}
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 20, 45, 63, 93, 110], dtype=torch.int32)  # longer than SHORT_SEGMENT
    q, k, v = (torch.randn(110, n, 64, generator=g) for n in (6, 2, 2))
    ctx = PagedContext(
        pb.cache,
        table,
        tiles,
        a.tail_k,
        a.tail_v,
        tails,
        sc,
        tail_slot=a.kwargs["tail_slot"][req],
        **{key: x for key, x in kw.items() if key != "tail_slot"},
    )  # type: ignore[arg-type]
    both = cpu.prefill_attention(q, k, v, cu, ctx)
    for s in range(5):
        a0, b0 = int(cu[s]), int(cu[s + 1])
        one = dataclasses.replace(
            ctx, block_table=table[s : s + 1], num_tiles=tiles[s : s + 1], tail_lens=tails[s : s + 1],
            tail_slot=ctx.tail_slot[s : s + 1], sink_lens=ctx.sink_lens[s : s + 1], sink_slot=ctx.sink_slot[s : s + 1],
        )  # type: ignore[index]  # fmt: skip
        alone = cpu.prefill_attention(q[a0:b0], k[a0:b0], v[a0:b0], torch.tensor([0, b0 - a0], dtype=torch.int32), one)
        torch.testing.assert_close(both[a0:b0], alone, atol=1e-6, rtol=1e-5)


def test_prefill_short_segments_without_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native kernel cannot take the rows, short segments are attended by the prefill path."""
    refused: list[int] = []

    def no_native(*args: object, **kw: object) -> bool:
        refused.append(1)
        return False

    monkeypatch.setattr(native, "decode", no_native)
    assert _prefill_sqnr("kvarn_k3v2_g32_rot-rh_s8", 4, True) >= MIN_SQNR_DB
    assert refused, "the short segments never asked the native kernel"


def test_arguments_are_checked_with_names() -> None:
    sc = scheme("kvarn_k4v2_g32")
    pb = paged_batch(sc, [40], 1, 64)
    q = torch.randn(1, 2, 64)
    base = (pb.cache, pb.block_table, pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens)
    with pytest.raises(KernelArgumentError, match="query"):
        cpu.decode_attention(q[0], PagedContext(*base, sc))
    with pytest.raises(KernelArgumentError, match="multiple of num_kv_heads"):
        cpu.decode_attention(
            torch.randn(1, 3, 64), PagedContext(pb.cache.expand(-1, 2, -1).contiguous(), *base[1:], sc)
        )
    for impl in IMPLS:  # index checks: on the host (torch), in the kernel before any read (native)
        with pytest.raises(KernelArgumentError, match="tail_slot must hold indices in 0..0"):
            cpu.decode_attention(q, PagedContext(*base, sc, tail_slot=torch.tensor([1], dtype=torch.int32)), impl=impl)
        with pytest.raises(KernelArgumentError, match="block ids in 0..3"):
            cpu.decode_attention(q, PagedContext(pb.cache, pb.block_table + 4, *base[2:], sc), impl=impl)
        with pytest.raises(KernelArgumentError, match="num_tiles"):
            cpu.decode_attention(q, PagedContext(pb.cache, pb.block_table, pb.num_tiles + 9, *base[3:], sc), impl=impl)
    with pytest.raises(KernelArgumentError, match="pass sink_k, sink_v and sink_lens"):
        cpu.decode_attention(q, PagedContext(*base, scheme("kvarn_k4v2_g32", 2)))
    with pytest.raises(KernelArgumentError, match="block_table"):
        cpu.decode_attention(q, PagedContext(pb.cache, pb.block_table.long(), *base[2:], sc))
    with pytest.raises(KernelArgumentError, match="cu_seqlens_q must rise from 0 to 3"):
        cu = torch.tensor([0, 2], dtype=torch.int32)
        cpu.prefill_attention(
            torch.randn(3, 2, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64), cu, PagedContext(*base, sc)
        )


def test_bench_tool_measures_every_method_and_replaces_its_doc_section(tmp_path: Path) -> None:
    rows = cpu_ops.bench_ops([1], [300], repeats=1, vllm_baseline=False, triad_bytes=4 << 20)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 300)]
    methods = {"kvarn native", "kvarn torch", "dequantize + SDPA"} | {f"SDPA {t} KV" for t in ("bf16", "fp16", "fp32")}
    assert set(rows[0]["ms"]) == methods
    assert all(ms > 0 for ms in rows[0]["ms"].values())
    # 2 full tiles of 128 and a tail of 44 bf16 key and value rows, 3 KV heads at head_dim 64
    row = rows[0]
    assert row["kvarn_bytes"] == 3 * (2 * Scheme.from_name("kvarn_k4v2_g128").tile_bytes(64) + 2 * 44 * 64 * 2)
    assert row["kvarn_gbs"] == pytest.approx(row["kvarn_bytes"] / row["ms"]["kvarn native"] / 1e6)
    assert row["triad_gbs"] > 0 and row["triad_share"] == pytest.approx(row["kvarn_gbs"] / row["triad_gbs"])
    assert row["vllm_vs_kvarn"] is None  # no vLLM baseline measured
    head, _, line = cpu_ops.ops_table(rows).splitlines()
    assert head.endswith("| kvarn GB/s | % of triad (" + f"{row['triad_gbs']:.1f} GB/s) | CPU_ATTN / kvarn |")
    assert line.endswith(f"| {row['kvarn_gbs']:.2f} | {100 * row['triad_share']:.0f}% | - |")
    with_vllm = [
        {**row, "ms": {**row["ms"], "vLLM CPU_ATTN bf16 KV": 2 * row["ms"]["kvarn native"]}, "vllm_vs_kvarn": 2.0}
    ]
    assert cpu_ops.ops_table(with_vllm).splitlines()[2].endswith("| 2.00x |")
    pre = cpu_ops.bench_prefill([0, 256], chunk=256, repeats=1, vllm_baseline=False)
    assert [(r["context"], r["chunk"]) for r in pre] == [(0, 256), (256, 256)]
    assert set(pre[0]["ms"]) == {"kvarn attention, flash", "kvarn store"} and all(v > 0 for v in pre[1]["ms"].values())
    assert cpu_ops.prefill_table(pre).splitlines()[2].startswith("| 0 | 256 |")
    ttft = {"kv_cache_dtype": "auto", "batch": 4, "context": 2048, "miss_s": 2.0, "miss_cpu_s": 3.0}
    ttft |= {"hit_s": 0.5, "hit_cpu_s": 0.25} | {
        f"{k}_vs_default": 1.0 for k in ("miss_s", "miss_cpu_s", "hit_s", "hit_cpu_s")
    }
    assert cpu_engine.serve_prefill_table([ttft]).splitlines()[2] == (
        "| `auto` | 4 | 2048 | 2.00 | 1.00x | 3.00 | 1.00x | 0.50 | 1.00x | 0.25 | 1.00x |"
    )
    store = cpu_ops.bench_store((("kvarn_k4v2_g32", 64),), tiles=2, heads=1, repeats=1)
    assert [(r["scheme"], r["head_dim"]) for r in store] == [("kvarn_k4v2_g32", 64)]
    assert store[0]["native_ms"] > 0 and store[0]["reference_ms"] > 0 and 0.5 <= store[0]["identical"] <= 1
    assert "| `kvarn_k4v2_g32` | 64 |" in cpu_ops.store_table(store)
    doc = tmp_path / "cpu_serving.md"
    doc.write_text("# title\n\nkept\n")
    write_section(doc, "ops", cpu_ops.ops_table(rows))
    write_section(doc, "ops", "second")
    text = doc.read_text()
    assert "kept" in text and "second" in text and "kvarn native" not in text


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native kernel")
def test_native_decode_is_the_same_on_any_number_of_threads() -> None:
    """Tasks (request, KV head, split) are independent and merged in a fixed order: bitwise equal."""
    sc = scheme("kvarn_k4v2_g32", 2)
    pb = paged_batch(sc, [9 * 32 + 5, 4 * 32, 3, 6 * 32 + 31], 2, 64, seed=3)
    a = staging(sc, pb, True, seed=3)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    args = (q, pb.cache, pb.block_table, pb.num_tiles, a.tail_k.bfloat16(), a.tail_v.bfloat16(), pb.tail_lens, sc)
    kw = {**a.kwargs, "sink_k": a.kwargs["sink_k"].bfloat16(), "sink_v": a.kwargs["sink_v"].bfloat16()}  # type: ignore[union-attr]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu.decode_attention(args[0], PagedContext(*args[1:], **kw), impl="native"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native kernel")
@pytest.mark.parametrize(("name", "sink_tokens"), [("kvarn_k4v2_g32", 2), ("kvarn_k4v2_g32_sink", 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_segment_gives_the_bits_of_decoding_token_by_token(
    name: str, sink_tokens: int, dtype: torch.dtype
) -> None:
    """A speculative verification (a segment of 4 new tokens after 5 staged ones, bf16) attends each
    token exactly as the decode step of that token alone would; decode rows are batch-invariant: the
    same bits beside a sequence with 10 tiles as alone (float32 shows any other order of the sums)."""
    sc = scheme(name, sink_tokens)
    t, hkv, d, new = sc.group_size, 2, 64, 4
    pb = paged_batch(sc, [3 * t + 5 + (t if sc.sink_tile else 0), 10 * t + 3], hkv, d, seed=4)
    a = staging(sc, pb, True, seed=4)
    bf = dtype
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(new, n, d, generator=g).to(bf) for n in (hkv * 3, hkv, hkv))
    tail_k, tail_v = a.tail_k.to(bf), a.tail_v.to(bf)
    kw = {n: (x.to(bf) if n in ("sink_k", "sink_v") and x is not None else x) for n, x in a.kwargs.items()}
    one = {n: (x[:1].contiguous() if n in ("sink_lens", "sink_slot", "tail_slot") else x) for n, x in kw.items()}
    staged = int(pb.tail_lens[0])
    cu = torch.tensor([0, new], dtype=torch.int32)
    bt, nt = pb.block_table[:1].contiguous(), pb.num_tiles[:1].contiguous()
    verified = cpu.prefill_attention(
        q, k, v, cu, PagedContext(pb.cache, bt, nt, tail_k, tail_v, pb.tail_lens[:1].contiguous(), sc, **one)
    )  # type: ignore[arg-type]
    slot = int(kw["tail_slot"][0])  # type: ignore[index]
    decoded, batched = [], []
    for i in range(new):  # each decode step writes its token into the staging slot first
        tail_k[slot, :, staged + i], tail_v[slot, :, staged + i] = k[i], v[i]
        lens = torch.tensor([staged + i + 1], dtype=torch.int32)
        decoded.append(
            cpu.decode_attention(
                q[i : i + 1], PagedContext(pb.cache, bt, nt, tail_k, tail_v, lens, sc, **one), impl="native"
            )
        )  # type: ignore[arg-type]
        lens2 = torch.cat([lens, pb.tail_lens[1:]])
        q2 = torch.cat([q[i : i + 1], q[i : i + 1]])
        both = cpu.decode_attention(
            q2, PagedContext(pb.cache, pb.block_table, pb.num_tiles, tail_k, tail_v, lens2, sc, **kw), impl="native"
        )  # type: ignore[arg-type]
        batched.append(both[:1])
    assert torch.equal(torch.cat(decoded), verified)
    assert torch.equal(torch.cat(batched), verified)


def test_prefill_segments_sharing_tiles() -> None:
    """vLLM cuts a chunk into one sequence per tile (segments) that read the same blocks."""
    sc = scheme("kvarn_k4v2_g32", 2)
    pb = paged_batch(sc, [3 * 32 + 7], 1, 64, seed=9)
    table = pb.block_table.expand(3, -1).contiguous()  # segments after tile 1, tile 2, and the tail
    tiles = torch.tensor([1, 2, 3], dtype=torch.int32)
    tails = torch.tensor([0, 0, 7], dtype=torch.int32)
    rows = (pb.tail_k.expand(3, -1, -1, -1), pb.tail_v.expand(3, -1, -1, -1))
    sinks = {"sink_k": pb.sink_k, "sink_v": pb.sink_v, "sink_lens": pb.sink_lens}
    sinks.update(sink_slot=torch.zeros(3, dtype=torch.int32), sink_lens=pb.sink_lens.expand(3).contiguous())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, n, 64, generator=g) for n in (2, 1, 1))
    cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    out = cpu.prefill_attention(q, k, v, cu, PagedContext(pb.cache, table, tiles, *rows, tails, sc, **sinks))  # type: ignore[arg-type]
    refs = []
    for i, ctx_len in enumerate([32, 64, 3 * 32 + 7]):
        s, e = int(cu[i]), int(cu[i + 1])
        kk = torch.cat([pb.context_k[0][:, :ctx_len], k[s:e].transpose(0, 1)], 1)
        vv = torch.cat([pb.context_v[0][:, :ctx_len], v[s:e].transpose(0, 1)], 1)
        refs.append(attention(q[s:e], kk, vv, causal_offset=ctx_len))
    assert sqnr_db(torch.cat(refs), out) >= MIN_SQNR_DB


# --- the native store (kvarn.kernels.cpu.store) against the reference codec ---------------------------------------

STORE_CASES = [  # (scheme, head_dim, dtype): bit widths 2/3/4/8, tiles 32..128, fp16 and log8 params, rotations
    ("kvarn_k4v2_g128", 64, torch.bfloat16),
    ("kvarn_k4v4_g128", 128, torch.float16),
    ("kvarn_k3v2_g128_s8", 64, torch.float32),
    ("kvarn_k4v2_g128_sink", 128, torch.bfloat16),
    ("kvarn_k4v4_g64", 256, torch.bfloat16),
    ("kvarn_k2v2_g32_rot-rh_it3", 64, torch.float32),
    ("kvarn_k8v3_g32_rot-none_it2_s8", 128, torch.float16),
    ("kvarn_k4v2_g32_it0", 64, torch.float32),
]


def store_inputs(
    sc: Scheme, n: int, h: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, h, T, d]`` keys (outlier channel, loud first token, per-tile magnitude from 1e-3 to 1e3) and
    values (per-token magnitudes), plus one all-zero key tile, one constant value tile, one tiny tile."""
    g = torch.Generator().manual_seed(seed)
    t = sc.group_size
    k = torch.randn(n, h, t, d, generator=g)
    k[..., 3] = k[..., 3] * 6 + 3
    k[:, :, 0] *= 4
    k = k * torch.exp(torch.randn(n, h, 1, 1, generator=g) * 2)
    v = torch.randn(n, h, t, d, generator=g) * torch.exp(torch.randn(n, h, t, 1, generator=g))
    k[0, 0], v[-1, -1] = 0.0, 0.5
    k[-1, 0] *= 1e-6
    return k.to(dtype), v.to(dtype)


def records_in_pages(
    name: str, d: int, blocks: list[int]
) -> tuple[Scheme, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The reference codec's records of ``U = len(blocks)`` tiles of two heads (:func:`store_inputs`)
    at ``blocks`` of pages 16 bytes wider than a record: the scheme, the record view
    ``[max(blocks) + 1, 2, tile_bytes]`` uint8 of the pages, ``blocks`` ``[U]`` int64 and the
    reference's dequantized keys and values, each ``[2, U, T, D]`` float32."""
    from kvarn.codec import dequantize_tiles, quantize_tiles

    sc = Scheme.from_name(name)
    u, h, t = len(blocks), 2, sc.group_size
    k, v = store_inputs(sc, u, h, d, torch.float32, seed=d + len(name))
    nb = sc.tile_bytes(d)
    rec = quantize_tiles(k.reshape(u * h, t, d), v.reshape(u * h, t, d), sc).view(u, h, nb)
    pages = torch.zeros(max(blocks) + 1, h, nb + 16, dtype=torch.uint8)
    ids = torch.tensor(blocks)
    pages[ids, :, :nb] = rec
    ref = [x.view(u, h, t, d).transpose(0, 1) for x in dequantize_tiles(rec.view(u * h, nb), sc, d)]
    return sc, pages[:, :, :nb], ids, ref


def assert_dequantized(
    out: tuple[torch.Tensor, ...] | list[torch.Tensor],
    ref: list[torch.Tensor],
    dtype: torch.dtype,
    expected: tuple[torch.Tensor, ...] | list[torch.Tensor] | None = None,
) -> None:
    """Dequantized keys and values ``[H, U, T, D]`` in ``dtype`` equal ``expected`` (default: the
    reference ``ref`` rounded to ``dtype``) to float32 rounding (1e-6) or the dtype's (2**-7), relative
    to each tile's largest magnitude in ``ref``."""
    for i, (mine, theirs) in enumerate(zip(out, ref, strict=True)):
        assert mine.shape == theirs.shape and mine.dtype == dtype
        scale = theirs.abs().amax((2, 3), keepdim=True).clamp_min(1e-30)  # per tile: they span 1e-6 to 1e3
        want = theirs.to(dtype) if expected is None else expected[i]
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(mine.float() / scale, want.float() / scale, rtol=0, atol=tol)


def assert_store_matches_reference(out: torch.Tensor, ref: torch.Tensor, sc: Scheme, d: int, x: tuple) -> None:
    """The native store's tolerance (kvarn.kernels.cpu.store): codes equal to the reference's for
    >= 99.9% of elements (99.5% at 8 bits); in >= 90% of tile sides every stored param within two fp16
    steps or log8 codes (a side whose Sinkhorn iterates tie may pick another one, with other params);
    every tile side's squared reconstruction error within 0.2% of the reference's."""
    from kvarn.codec import decode_records, dequantize_tiles

    nb = sc.tile_bytes(d)
    out, ref = out.reshape(-1, nb), ref.reshape(-1, nb)
    a, b = decode_records(out, sc, d), decode_records(ref, sc, d)
    for name, bits in (("key_codes", sc.key_bits), ("value_codes", sc.value_bits)):
        equal = float((getattr(a, name) == getattr(b, name)).float().mean())
        assert equal >= (0.995 if bits == 8 else 0.999), (name, equal)
    step = 2.0**-10 if sc.scale_dtype == "fp16" else 2.0 ** (1 / 8) - 1  # one fp16 step / one log8 code, relative
    for side in ("key", "value"):
        close = torch.ones(out.shape[0], dtype=torch.bool)
        for param in ("scale", "factor", "offset"):
            p, r = getattr(a, f"{side}_{param}"), getattr(b, f"{side}_{param}")
            # two steps, relative (fp16 subnormals: absolute): a factor one step apart moves the range of
            # the rows it divides, so their scales and zero points round up to one more step apart
            bound = 2.02 * step * r.abs() + 2.0**-23
            if param == "offset" and sc.scale_dtype == "log8":  # z * scale: scale one code apart, or z one apart
                bound = bound + torch.maximum(getattr(a, f"{side}_scale"), getattr(b, f"{side}_scale"))
            close &= ((p - r).abs() <= bound).flatten(1).all(1)
        assert float(close.float().mean()) >= 0.9, (side, int((~close).sum()))
    keys, values = (t.reshape(-1, sc.group_size, d).float() for t in x)
    mine, theirs = dequantize_tiles(out, sc, d), dequantize_tiles(ref, sc, d)
    for side, exact in enumerate((keys, values)):
        err = (mine[side] - exact).square().sum((1, 2))
        bound = (theirs[side] - exact).square().sum((1, 2)) * 1.002 + 1e-12
        assert bool((err <= bound).all()), (side, (err / bound).max())


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native store")
@pytest.mark.parametrize(("name", "d", "dtype"), STORE_CASES)
def test_native_store_matches_the_reference_codec(name: str, d: int, dtype: torch.dtype) -> None:
    from kvarn.codec import quantize_tiles
    from kvarn.kernels.cpu.store import store_tiles

    sc = Scheme.from_name(name)
    n, h, t = 6, 2, sc.group_size
    k, v = store_inputs(sc, n, h, d, dtype, seed=len(name) + d)
    cache = torch.zeros(n + 3, h, sc.tile_bytes(d), dtype=torch.uint8)
    ids = torch.tensor([4, 0, 7, 2, 8, 5], dtype=torch.int32)
    store_tiles(k, v, cache, ids, sc, impl="native")
    ref = quantize_tiles(k.reshape(n * h, t, d), v.reshape(n * h, t, d), sc)
    assert_store_matches_reference(cache[ids.long()], ref, sc, d, (k, v))
    untouched = torch.ones(n + 3, dtype=torch.bool)
    untouched[ids.long()] = False
    assert not cache[untouched].any()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native store")
@pytest.mark.parametrize(("name", "d"), [("kvarn_k4v2_g128", 64), ("kvarn_k3v2_g128_s8", 128), ("kvarn_k4v4_g64", 256)])
def test_native_store_tolerance_holds_over_many_tiles(name: str, d: int) -> None:
    """The tolerance over 200 tiles of the kernel tests' usual shape (kv_tiles); and it can fail: two
    records (1%) with their key codes one step off are refused."""
    from kvarn.codec import quantize_tiles
    from kvarn.kernels.cpu.store import store_tiles

    from ._reference import kv_tiles

    sc = Scheme.from_name(name)
    k, v = kv_tiles(200, sc.group_size, d, seed=d)
    cache = torch.zeros(200, 1, sc.tile_bytes(d), dtype=torch.uint8)
    store_tiles(k[:, None], v[:, None], cache, torch.arange(200), sc, impl="native")
    ref = quantize_tiles(k, v, sc)
    assert_store_matches_reference(cache[:, 0], ref, sc, d, (k, v))
    off = cache[:, 0].clone()
    lay = layout(sc, d)
    off[:2, lay.key_codes : lay.value_codes] ^= 1  # the lowest bit plane's first code in each byte
    with pytest.raises(AssertionError):
        assert_store_matches_reference(off, ref, sc, d, (k, v))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native store")
def test_native_store_strided_input_into_page_views_on_any_number_of_threads() -> None:
    """The backend's two inputs: staging slots [F, H, T, D] and this step's tokens viewed as
    [F, T, H, D].transpose(1, 2); pages wider than a record (only the record's bytes are written).
    Tasks are independent: the same bytes on 1, 2 or 3 threads."""
    from kvarn.codec import quantize_tiles
    from kvarn.kernels.cpu.store import store_tiles

    sc = Scheme.from_name("kvarn_k4v2_g128")
    d, h, t = 64, 3, sc.group_size
    g = torch.Generator().manual_seed(4)
    tokens_k = torch.randn(2 * t, h, d, generator=g).bfloat16()
    tokens_v = torch.randn(2 * t, h, d, generator=g).bfloat16()
    k, v = (x.view(2, t, h, d).transpose(1, 2) for x in (tokens_k, tokens_v))
    nb = sc.tile_bytes(d)
    ref = quantize_tiles(k.reshape(2 * h, t, d), v.reshape(2 * h, t, d), sc).view(2, h, nb)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            pages = torch.full((4, h, nb + 16), 7, dtype=torch.uint8)
            store_tiles(k, v, pages[:, :, :nb], torch.tensor([3, 1]), sc, impl="native")
            assert_store_matches_reference(pages[[3, 1], :, :nb], ref, sc, d, (k, v))
            assert bool((pages[:, :, nb:] == 7).all()) and bool((pages[[0, 2]] == 7).all())
    finally:
        torch.set_num_threads(threads)


def test_store_arguments_are_checked_with_names() -> None:
    from kvarn.kernels.cpu.store import store_tiles

    sc = Scheme.from_name("kvarn_k4v2_g32")
    k = torch.randn(2, 1, 32, 64)
    cache = torch.zeros(3, 1, sc.tile_bytes(64), dtype=torch.uint8)
    ids = torch.tensor([0, 2])
    with pytest.raises(KernelArgumentError, match="keys must be"):
        store_tiles(k[0], k[0], cache, ids, sc)
    with pytest.raises(KernelArgumentError, match="impl='fast' is not one of: auto, native, reference"):
        store_tiles(k, k, cache, ids, sc, impl="fast")
    with pytest.raises(KernelArgumentError, match="values dtype"):
        store_tiles(k, k.half(), cache, ids, sc)
    with pytest.raises(KernelArgumentError, match=r"block_ids must be block ids in 0..2, got \[0, 3\]"):
        store_tiles(k, k, cache, torch.tensor([0, 3]), sc)
    assert_store_refusals(store_tiles, k, cache, ids, sc)


def test_reference_store_writes_the_codec_records() -> None:
    """``impl="reference"`` (the fallback without a compiler): the reference records, scattered."""
    from kvarn.codec import quantize_tiles
    from kvarn.kernels.cpu.store import store_tiles

    sc = Scheme.from_name("kvarn_k4v2_g32")
    k, v = (torch.randn(2, 2, 32, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    cache = torch.zeros(3, 2, sc.tile_bytes(64), dtype=torch.uint8)
    store_tiles(k, v, cache, torch.tensor([2, 0]), sc, impl="reference")
    ref = quantize_tiles(k.reshape(4, 32, 64), v.reshape(4, 32, 64), sc).view(2, 2, -1)
    assert torch.equal(cache[[2, 0]], ref) and not cache[1].any()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native store")
def test_quantize_tiles_cpu_is_a_drop_in_for_the_reference_codec() -> None:
    from kvarn.codec import quantize_tiles

    sc = Scheme.from_name("kvarn_k4v2_g128")
    k, v = store_inputs(sc, 4, 1, 64, torch.float32, seed=8)
    k, v = k[:, 0], v[:, 0]
    out = cpu.quantize_tiles_cpu(k, v, sc)
    assert out.shape == (4, sc.tile_bytes(64)) and out.dtype == torch.uint8
    assert_store_matches_reference(out, quantize_tiles(k, v, sc), sc, 64, (k, v))
    bad = k.clone()
    bad[1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        cpu.quantize_tiles_cpu(bad, v, sc)
    with pytest.raises(KernelArgumentError, match="must both be"):
        cpu.quantize_tiles_cpu(k, v[:, :64], sc)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native kernel")
def test_remembered_layers_take_new_step_tensors_and_still_check_indices() -> None:
    """vLLM's pattern: the same pools and pages every step, new index tensors each step, an output
    buffer: the results stay bitwise those without an output buffer over steps and layers; bad
    indices still raise by name."""
    sc = scheme("kvarn_k4v2_g32", 2)
    layers = [paged_batch(sc, [5 * 32 + 3, 2 * 32 + 7, 9], 2, 64, seed=s) for s in (1, 2)]
    pools = [staging(sc, pb, True, seed=s) for s, pb in enumerate(layers)]
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        # a new step: new tensor objects, lengths moved on by one token
        tails = [(pb.tail_lens + step).clamp(max=32).clone() for pb in layers]
        q = torch.randn(3, 4, 64, generator=g)
        for pb, a, tail in zip(layers, pools, tails, strict=True):
            args = (q, pb.cache, pb.block_table.clone(), pb.num_tiles.clone(), a.tail_k, a.tail_v, tail, sc)
            kw = {k: (None if v is None else v.clone() if v.dtype == torch.int32 else v) for k, v in a.kwargs.items()}
            fast = cpu.decode_attention(
                args[0], PagedContext(*args[1:], **kw), out=torch.empty(3, 4, 64), impl="native"
            )  # type: ignore[arg-type]
            full = cpu.decode_attention(args[0], PagedContext(*args[1:], **kw), impl="native")  # type: ignore[arg-type]
            assert torch.equal(fast, full)
            again = cpu.decode_attention(args[0], PagedContext(*args[1:], **kw), out=torch.empty(3, 4, 64))  # type: ignore[arg-type]
            assert torch.equal(again, full)
    pb, a = layers[0], pools[0]
    base = (pb.cache, pb.block_table, pb.num_tiles, a.tail_k, a.tail_v, pb.tail_lens, sc)
    cpu.decode_attention(q, PagedContext(*base, **a.kwargs), out=torch.empty(3, 4, 64))  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="block ids in 0"):
        bad = (pb.cache, pb.block_table + 100, *base[2:])
        cpu.decode_attention(q, PagedContext(*bad, **a.kwargs), out=torch.empty(3, 4, 64))  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="impl='fast' is not one of"):
        cpu.decode_attention(q, PagedContext(*base, **a.kwargs), out=torch.empty(3, 4, 64), impl="fast")  # type: ignore[arg-type]
    as_long = (pb.cache, pb.block_table, pb.num_tiles.long(), *base[3:])
    with pytest.raises(KernelArgumentError, match="num_tiles dtype"):
        cpu.decode_attention(q, PagedContext(*as_long, **a.kwargs), out=torch.empty(3, 4, 64))  # type: ignore[arg-type]


# --- dequantize of whole blocks (kvarn.kernels.cpu.dequant) against the reference codec ---------------------------


@pytest.mark.parametrize(("name", "d", "dtype"), STORE_CASES)
@pytest.mark.parametrize("built", [True, False], ids=["native", "reference"])
def test_dequantize_blocks_matches_the_reference_codec(
    name: str, d: int, dtype: torch.dtype, built: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks in any order from pages wider than a record -> [H, U, T, D] in the asked dtype: the
    reference's numbers to float32 rounding (relative 1e-6), then rounded once to the dtype."""
    from kvarn.kernels.cpu.dequant import dequantize_blocks

    if built and not HAS_COMPILER:
        pytest.skip("no C++ compiler: no native dequantize")
    if not built:
        monkeypatch.setattr(native, "extension", lambda: None)
    sc, pages, blocks, ref = records_in_pages(name, d, [6, 0, 3, 7, 2])
    assert_dequantized(dequantize_blocks(pages, blocks, sc, d, dtype), ref, dtype)
