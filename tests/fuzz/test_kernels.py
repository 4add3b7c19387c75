"""Random tensors for every entry point of the CPU kernels: the native decode, the torch path's
decode, the native store and the dequantize of whole blocks.

A case is a valid call (shapes, dtypes, strided views, NaN/Inf in the inputs) or a valid call with
one thing broken (an index out of range, a wrong dtype or shape, a duplicate block id). A valid
call must give the reference's result (decode: float64 attention over the reference codec's
dequantized context, SQNR; store: every tile side's reconstruction error within the store's
tolerance of the reference codec's; dequantize: the reference codec's numbers); a broken one must
raise ``KernelArgumentError`` (or the codec's ``ValueError`` for inf/NaN it refuses) naming the
argument. A crash, a hang or another exception fails.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kvarn.codec import decode_records, dequantize_tiles, quantize_tiles
from kvarn.kernels import KernelArgumentError, PagedContext
from kvarn.kernels.cpu import native
from kvarn.kernels.cpu import ops as cpu
from kvarn.kernels.cpu.dequant import dequantize_blocks
from kvarn.kernels.cpu.store import store_tiles
from kvarn.schemes import Scheme
from tests.kernels._reference import attention, sqnr_db

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_native = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no native kernels")


def assert_native_built() -> None:
    """Where a C++ compiler is present the extension must build: a failed build would leave the
    ``auto`` paths fuzzing the torch fallback under the native tests' names."""
    if HAS_COMPILER:
        assert native.extension() is not None, "a C++ compiler is present but the native CPU kernels did not build"


SCHEMES = (
    "kvarn_k4v2_g32_sink0",
    "kvarn_k4v2_g32",
    "kvarn_k3v4_g32_rot-rh_s8_sink2",
    "kvarn_k2v3_g32_rot-none_it0_sink0",
    "kvarn_k8v8_g32_s8_sink",
    "kvarn_k4v2_g64_it3",
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POOL_TILES = 6  # quantized tiles per (scheme, head_dim, kv heads), drawn from by every case


@functools.lru_cache(maxsize=64)
def tile_pool(name: str, d: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Records ``[P, H, tile_bytes]`` of the reference codec, their dequantized keys and values
    ``[P, H, T, D]`` and the exact keys (to check exact sink rows against) ``[P, H, T, D]``."""
    sc = Scheme.from_name(name)
    t = sc.group_size
    g = torch.Generator().manual_seed(d + hkv + len(name))
    k = torch.randn(POOL_TILES * hkv, t, d, generator=g) * torch.exp(torch.randn(POOL_TILES * hkv, 1, 1, generator=g))
    k[:, :, 3] = k[:, :, 3] * 6 + 3
    v = torch.randn(POOL_TILES * hkv, t, d, generator=g)
    recs = quantize_tiles(k, v, sc)
    dk, dv = dequantize_tiles(recs, sc, d)
    shape = (POOL_TILES, hkv, t, d)
    return recs.view(POOL_TILES, hkv, -1), dk.view(shape), dv.view(shape), k.view(shape)


BREAKS = ("block_table", "num_tiles", "tail_lens", "tail_slot", "sink_slot", "block_table dtype", "cache shape")


@dataclasses.dataclass
class DecodeCase:
    scheme: Scheme
    query: torch.Tensor
    ctx: PagedContext
    context_k: list[torch.Tensor]  # per sequence [H, L, D] float32: what attention must see
    context_v: list[torch.Tensor]
    broken: str | None


@st.composite
def decode_cases(draw: st.DrawFn) -> DecodeCase:
    sc = Scheme.from_name(draw(st.sampled_from(SCHEMES)))
    t = sc.group_size
    d = draw(st.sampled_from((64, 128)))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(DTYPES))
    lens = draw(st.lists(st.integers(0, 3 * t + t // 2), min_size=1, max_size=3))
    pooled = draw(st.booleans())
    broken = draw(st.sampled_from((None, None, None, *BREAKS)))
    recs, dk, dv, exact_k = tile_pool(sc.name, d, hkv)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    sink_lens = [min(n, t) for n in lens] if sc.sink_tile else [0] * bsz
    tiles = [(n - s) // t for n, s in zip(lens, sink_lens, strict=True)]
    tails = [n - s - k * t for n, s, k in zip(lens, sink_lens, tiles, strict=True)]
    if sc.sink_tokens:
        sink_lens = [min(n, sc.sink_tokens) if k else 0 for n, k in zip(lens, tiles, strict=True)]
    num_blocks = sum(tiles) + draw(st.integers(0, 3))
    pad = draw(st.integers(0, 16))  # pages wider than a record: a page view
    pages = torch.randint(0, 256, (max(num_blocks, 1), hkv, recs.shape[2] + pad), generator=g, dtype=torch.uint8)
    cache = pages[:num_blocks, :, : recs.shape[2]]
    perm = torch.randperm(num_blocks, generator=g)
    width = max(tiles) + draw(st.integers(0, 2))
    table = torch.full((bsz, width), -1, dtype=torch.int32)
    rows = max(t, sc.sink_len)
    tail_k = (torch.randn(bsz, hkv, rows + 3, d, generator=g) * 3).to(dtype)[:, :, :t]  # strided rows
    tail_v = torch.randn(bsz, hkv, rows + 3, d, generator=g).to(dtype)[:, :, :t]
    sink_k = (torch.randn(bsz, hkv, rows, d, generator=g) * 2).to(dtype)[:, :, : max(sc.sink_len, 1)]
    sink_v = torch.randn(bsz, hkv, rows, d, generator=g).to(dtype)[:, :, : max(sc.sink_len, 1)]
    ctx_k, ctx_v, used = [], [], 0
    for b in range(bsz):
        parts_k, parts_v = [sink_k[b, :, : sink_lens[b]].float()], [sink_v[b, :, : sink_lens[b]].float()]
        if sc.sink_tokens:
            parts_k, parts_v = [], []
        if tiles[b]:
            pick = torch.randint(0, POOL_TILES, (tiles[b],), generator=g)
            blocks = perm[used : used + tiles[b]]
            used += tiles[b]
            cache[blocks] = recs[pick]
            table[b, : tiles[b]] = blocks.to(torch.int32)
            tk, tv = dk[pick].clone(), dv[pick].clone()  # [n, H, T, D]
            if sc.sink_tokens:  # tile 0's first rows read exactly from the sink
                s0 = sink_lens[b]
                sink_k[b, :, :s0] = exact_k[pick[0], :, :s0].to(dtype)
                tk[0, :, :s0] = sink_k[b, :, :s0].float()
                tv[0, :, :s0] = sink_v[b, :, :s0].float()
            parts_k.append(tk.permute(1, 0, 2, 3).reshape(hkv, -1, d))
            parts_v.append(tv.permute(1, 0, 2, 3).reshape(hkv, -1, d))
        parts_k.append(tail_k[b, :, : tails[b]].float())
        parts_v.append(tail_v[b, :, : tails[b]].float())
        ctx_k.append(torch.cat(parts_k, dim=1))
        ctx_v.append(torch.cat(parts_v, dim=1))
    kw: dict[str, Any] = {}
    if sc.sink_len:
        kw = {"sink_k": sink_k, "sink_v": sink_v, "sink_lens": torch.tensor(sink_lens, dtype=torch.int32)}
    if pooled:  # rows in pools of spare slots, read at a permutation of slot ids
        spare = draw(st.integers(0, 3))
        slot = torch.randperm(bsz + spare, generator=g)[:bsz]
        tail_pool = torch.randn(bsz + spare, hkv, t, d, generator=g).to(dtype) * 100
        tail_pool_v = tail_pool.clone()
        tail_pool[slot], tail_pool_v[slot] = tail_k, tail_v
        tail_k, tail_v = tail_pool, tail_pool_v
        kw["tail_slot"] = slot.to(draw(st.sampled_from((torch.int32, torch.int64))))
        if sc.sink_len:
            sink_pool = torch.zeros(bsz + spare, *sink_k.shape[1:], dtype=dtype)
            sink_pool_v = sink_pool.clone()
            sink_pool[slot], sink_pool_v[slot] = sink_k, sink_v
            kw.update(sink_k=sink_pool, sink_v=sink_pool_v, sink_slot=kw["tail_slot"].clone())
    q_full = torch.randn(bsz, hkv * group + 1, d, generator=g).to(dtype)
    query = q_full[:, : hkv * group] if draw(st.booleans()) else q_full[:, : hkv * group].contiguous()
    if draw(st.integers(0, 8)) == 0:  # NaN / Inf in a query: served, that sequence's output non-finite
        query[0, 0, draw(st.integers(0, d - 1))] = draw(st.sampled_from((float("nan"), float("inf"))))
    num_tiles = torch.tensor(tiles, dtype=torch.int32)
    tail_lens = torch.tensor(tails, dtype=torch.int32)
    b = draw(st.integers(0, bsz - 1))
    huge = draw(st.sampled_from((-1, -(2**31), 2**31 - 1, 1, 7)))

    def past(limit: int) -> int:
        """An index out of ``0..limit-1``: negative, or at or past ``limit`` (within int32)."""
        return huge if huge < 0 else min(limit - 1 + huge, 2**31 - 1)

    if broken == "block_table":
        assume(tiles[b] > 0)
        table[b, draw(st.integers(0, tiles[b] - 1))] = past(num_blocks)
    elif broken == "num_tiles":
        num_tiles[b] = past(width + 1)
    elif broken == "tail_lens":
        tail_lens[b] = past(t + 1)
    elif broken == "tail_slot":
        assume(pooled)
        kw["tail_slot"][b] = past(tail_k.shape[0])
    elif broken == "sink_slot":
        assume(pooled and sc.sink_len > 0)
        kw["sink_slot"][b] = past(kw["sink_k"].shape[0])
    elif broken == "block_table dtype":
        table = table.to(torch.int64)
    elif broken == "cache shape":
        cache = cache[:, :, :-1]
    ctx = PagedContext(cache, table, num_tiles, tail_k, tail_v, tail_lens, sc, **kw)
    return DecodeCase(sc, query, ctx, ctx_k, ctx_v, broken)


def _check_decode(case: DecodeCase, impl: str) -> None:
    if case.broken is not None:
        name = case.broken.split()[0]
        with pytest.raises(KernelArgumentError, match=name):
            cpu.decode_attention(case.query, case.ctx, impl=impl)
        return
    out = cpu.decode_attention(case.query, case.ctx, impl=impl)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    q = case.query
    for b in range(q.shape[0]):
        ref = attention(q[b : b + 1].float(), case.context_k[b], case.context_v[b])[0]  # [Hq, D]
        mine = out[b].double()
        if not case.context_k[b].shape[1]:
            assert not mine.any(), "a sequence without tokens gets zeros"
            continue
        finite = torch.isfinite(q[b]).all(-1)  # [Hq]
        # NaN/Inf in a query head: a non-finite output row, or zeros where every score is -inf or NaN
        # (both paths take such a row as one with no token to attend; docs/reliability.md)
        bad = mine[~finite]
        assert bool((~torch.isfinite(bad).all(-1) | (bad == 0).all(-1)).all()), bad
        if finite.any():
            floor = 60.0 if q.dtype == torch.float32 else 40.0  # the output's own rounding: bf16 ~ 50 dB
            got = sqnr_db(ref[finite].float(), mine[finite].float())
            assert got >= floor, (b, got)


@needs_native
@given(decode_cases())
def test_native_decode(case: DecodeCase) -> None:
    assert_native_built()
    _check_decode(case, "native")  # the cases' tails and sinks take the query's dtype: the kernel takes them


@given(decode_cases())
def test_torch_path_decode(case: DecodeCase) -> None:
    _check_decode(case, "torch")


@st.composite
def store_cases(draw: st.DrawFn) -> tuple[Scheme, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str | None]:
    """``(scheme, keys, values, cache, block_ids, broken)``: keys/values ``[N, H, T, D]`` (maybe strided
    views, magnitudes over 12 decades within the dtype's range, one per tile or one per token, constant
    or zero tiles, maybe NaN/Inf)."""
    sc = dataclasses.replace(Scheme.from_name(draw(st.sampled_from(SCHEMES))), sink_tile=False, sink_tokens=0)
    t = sc.group_size
    d = draw(st.sampled_from((64, 128)))
    n, h = draw(st.integers(0, 4)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    top = 3.0 if dtype == torch.float16 else 8.0  # fp16 holds up to 65504

    def magnitudes() -> torch.Tensor:
        """One magnitude per tile (a tile of ordinary spread) or per token (a spread over decades)."""
        rows = draw(st.sampled_from((1, t)))
        return 10 ** (torch.rand(n, h, rows, 1, generator=g) * (top + 6) - 6)

    k = torch.randn(n, h, t, d + 5, generator=g) * magnitudes()
    v = torch.randn(n, h, t, d + 5, generator=g) * magnitudes()
    if n and draw(st.booleans()):
        k[0, 0], v[-1, -1] = 0.0, float(draw(st.sampled_from((0.0, 0.5, -3.0))))
    keys, values = k.to(dtype)[..., :d], v.to(dtype)[..., :d]  # strided views, head_dim contiguous
    if draw(st.booleans()):
        keys, values = keys.contiguous(), values.contiguous()
    spare = draw(st.integers(0, 3))
    pad = draw(st.integers(0, 16))
    pages = torch.zeros(n + spare, h, sc.tile_bytes(d) + pad, dtype=torch.uint8)
    cache = pages[:, :, : sc.tile_bytes(d)]
    ids = torch.randperm(n + spare, generator=g)[:n].to(draw(st.sampled_from((torch.int32, torch.int64))))
    broken = draw(st.sampled_from((None, None, None, "block_ids", "distinct", "keys", "NaN", "cache")))
    if broken == "block_ids":
        assume(n > 0)
        ids[draw(st.integers(0, n - 1))] = draw(st.sampled_from((-1, n + spare, 2**31 - 1)))
    elif broken == "distinct":
        assume(n > 1)
        ids[1] = ids[0]
    elif broken == "keys":
        keys = keys[:, :, : t - 1]
    elif broken == "NaN":
        assume(n > 0)
        keys[draw(st.integers(0, n - 1)), 0, 0, 0] = draw(st.sampled_from((float("nan"), float("inf"))))
    elif broken == "cache":
        cache = pages[:, :, : sc.tile_bytes(d) - 1]
    return sc, keys, values, cache, ids, broken


@needs_native
@given(store_cases(), st.booleans())
def test_native_store(case: tuple[Any, ...], check_finite: bool) -> None:
    assert_native_built()
    sc, keys, values, cache, ids, broken = case
    if broken == "NaN" and not check_finite:  # served: no crash; the other tiles are stored as usual
        keep = torch.isfinite(keys).flatten(1).all(1) & torch.isfinite(values).flatten(1).all(1)
        store_tiles(keys, values, cache, ids, sc, impl="native")
        _assert_records_close(sc, keys[keep], values[keep], cache[ids[keep].long()])
        return
    if broken is not None:
        name = "inf or NaN" if broken == "NaN" else broken
        with pytest.raises(ValueError, match=name):
            store_tiles(keys, values, cache, ids, sc, check_finite=check_finite, impl="native")
        return
    before = cache.clone()
    store_tiles(keys, values, cache, ids, sc, check_finite=check_finite, impl="native")
    _assert_records_close(sc, keys, values, cache[ids.long()])
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[ids.long()] = False
    assert torch.equal(cache[untouched], before[untouched])


# A tile side whose token magnitudes (row norms, zero rows aside) span more than this many decades
# has its reconstruction error on a few dominant tokens: the store's wider bound applies to it.
WIDE_DECADES = 2.0


def _token_decades(x: torch.Tensor) -> torch.Tensor:
    """``log10(max / min)`` of the nonzero row norms of each tile ``[N, T, D]`` -> ``[N]`` (0 for a zero tile)."""
    norms = x.double().square().sum(2).sqrt()  # [N, T]
    low = torch.where(norms > 0, norms, torch.inf).amin(1)
    return torch.where(low.isfinite(), (norms.amax(1) / low).log10(), torch.zeros_like(low))


def _assert_records_close(sc: Scheme, keys: torch.Tensor, values: torch.Tensor, recs: torch.Tensor) -> None:
    """Every tile side's squared reconstruction error within the store's stated tolerance of the
    reference codec's (:mod:`kvarn.kernels.cpu.store`): 0.2% on a tile of ordinary spread, 2% where
    its token magnitudes span more than :data:`WIDE_DECADES` decades.

    Why 2% there: the reference's error of such a side sits on its dominant tokens. Its effective
    number of elements, ``(sum e)^2 / sum e^2`` over the elements' squared errors ``e``, has a median
    of 90 (6-330) where an ordinary side's has 1,300 (590-2,750; 43,200 sides of the six schemes at
    head_dim 64 and 128), so one rounding difference on a dominant token (a code, or its scale or
    zero point one fp16 step or log8 code apart) weighs an order of magnitude more than on an
    ordinary tile: the ordinary 0.2% scaled by ten. The worst of the full runs was +1.44%
    (``docs/reliability.md``).

    With log8 storage a Sinkhorn factor that falls on a rounding boundary within float32 rounding
    rounds the other way in the store's order of operations; the factor is then a whole code (9%)
    apart, that iterate and the ones after it differ from the reference's, and the store keeps
    another iterate (+0.63% on a tile of ordinary spread, ``kvarn_k8v8_g32_s8_sink``). Its pick is
    still the best of its iterates, whose iterate 0 (no normalization, nothing to round apart) is
    the reference's: where a side's log8 factors differ from the reference's, its error is bounded
    by the same tolerance of the reference's error without normalization (``norm_iters=0``)."""
    if not keys.shape[0]:
        return
    n, h, t, d = keys.shape
    nb = sc.tile_bytes(d)
    x = (keys.reshape(n * h, t, d), values.reshape(n * h, t, d))
    ref = quantize_tiles(*x, sc)
    mine, theirs = dequantize_tiles(recs.reshape(n * h, nb), sc, d), dequantize_tiles(ref, sc, d)
    plain = dequantize_tiles(quantize_tiles(*x, dataclasses.replace(sc, norm_iters=0)), sc, d)
    a, b = decode_records(recs.reshape(n * h, nb), sc, d), decode_records(ref, sc, d)
    for side, name in enumerate(("key", "value")):
        exact = x[side].double()
        err, ref_err, plain_err = ((y[side].double() - exact).square().sum((1, 2)) for y in (mine, theirs, plain))
        rel = torch.where(_token_decades(exact) > WIDE_DECADES, 0.02, 0.002).double()
        if sc.scale_dtype == "log8":
            tied = (getattr(a, f"{name}_factor") != getattr(b, f"{name}_factor")).any(1)
            ref_err = torch.where(tied, torch.maximum(ref_err, plain_err), ref_err)
        # float32 dequantization rounds each element by ~1e-7 of its value: 1e-9 of the energy covers it
        bound = ref_err * (1 + rel) + 1e-9 * exact.square().sum((1, 2)) + 1e-30
        assert bool((err <= bound).all()), (name, float((err / bound).max()), float((err / ref_err).max() - 1))


@st.composite
def dequant_cases(draw: st.DrawFn) -> tuple[Scheme, torch.Tensor, torch.Tensor, int, torch.dtype, str | None]:
    sc = dataclasses.replace(Scheme.from_name(draw(st.sampled_from(SCHEMES))), sink_tile=False, sink_tokens=0)
    d = draw(st.sampled_from((64, 128)))
    h = draw(st.integers(1, 2))
    recs = tile_pool(sc.name, d, h)[0]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    num_blocks = draw(st.integers(1, 8))
    pad = draw(st.integers(0, 16))
    pages = torch.randint(0, 256, (num_blocks, h, recs.shape[2] + pad), generator=g, dtype=torch.uint8)
    pages[:, :, : recs.shape[2]] = recs[torch.randint(0, POOL_TILES, (num_blocks,), generator=g)]
    u = draw(st.integers(0, 5))
    blocks = torch.randint(0, num_blocks, (u,), generator=g)
    broken = draw(st.sampled_from((None, None, None, "blocks", "blocks dtype", "cache", "dtype")))
    dtype = draw(st.sampled_from(DTYPES))
    cache = pages[:, :, : recs.shape[2]]
    if broken == "blocks":
        assume(u > 0)
        blocks[draw(st.integers(0, u - 1))] = draw(st.sampled_from((-1, num_blocks, 2**40)))
    elif broken == "blocks dtype":
        blocks = blocks.to(torch.float32)
    elif broken == "cache":
        cache = pages[:, :, : recs.shape[2] - 1]
    elif broken == "dtype":
        dtype = torch.int8
    return sc, cache, blocks, d, dtype, broken


@given(dequant_cases(), st.booleans())
def test_dequantize_blocks(case: tuple[Any, ...], built: bool) -> None:
    sc, cache, blocks, d, dtype, broken = case
    run = functools.partial(dequantize_blocks, cache, blocks, sc, d, dtype)
    with pytest.MonkeyPatch.context() as mp:
        if built:
            assert_native_built()
        else:
            mp.setattr(native, "extension", lambda: None)
        if broken is not None:
            with pytest.raises(KernelArgumentError, match=broken.split()[0]):
                run()
            return
        out = run()
    u, h, t, nb = blocks.shape[0], cache.shape[1], sc.group_size, sc.tile_bytes(d)
    assert all(x.shape == (h, u, t, d) and x.dtype == dtype for x in out)
    if not u:
        return
    ref = [x.view(u, h, t, d).transpose(0, 1) for x in dequantize_tiles(cache[blocks].reshape(u * h, nb), sc, d)]
    for mine, theirs in zip(out, ref, strict=True):
        assert mine.shape == (h, u, t, d) and mine.dtype == dtype
        scale = theirs.abs().amax((2, 3), keepdim=True).clamp_min(1e-30)
        atol = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(mine.float() / scale, theirs.to(dtype).float() / scale, rtol=0, atol=atol)


@st.composite
def prefill_cases(
    draw: st.DrawFn,
) -> tuple[DecodeCase, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str | None]:
    """A decode case's context with 0..T+5 new tokens per sequence after it: ``(case, query [N, Hq, D],
    key and value [N, H, D], cu_seqlens_q [B + 1] int32, broken)``; broken adds ``cu_seqlens_q`` (not
    rising from 0 to N) to the decode case's breaks."""
    case = draw(decode_cases())
    bsz, hq, d = case.query.shape
    hkv, t = case.ctx.cache.shape[1], case.scheme.group_size
    q_lens = draw(st.lists(st.integers(0, t + 5), min_size=bsz, max_size=bsz))
    total = sum(q_lens)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = case.query.dtype
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k, v = torch.randn(total, hkv, d, generator=g).to(dtype), torch.randn(total, hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    broken = case.broken
    if broken is None and draw(st.integers(0, 5)) == 0:
        assume(total > 0)
        cu[-1] = total + draw(st.sampled_from((-total - 1, 1, 2**31 - 1 - total)))
        broken = "cu_seqlens_q"
    return case, q, k, v, cu, broken


@given(prefill_cases())
def test_prefill(drawn: tuple[Any, ...]) -> None:
    """``prefill_attention``: causal attention of the new tokens after each sequence's context."""
    assert_native_built()  # short segments are decoded by the native kernel
    case, q, k, v, cu, broken = drawn
    if broken is not None:
        with pytest.raises(KernelArgumentError, match=broken.split()[0]):
            cpu.prefill_attention(q, k, v, cu, case.ctx)
        return
    out = cpu.prefill_attention(q, k, v, cu, case.ctx)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b in range(cu.shape[0] - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        if s == e:
            continue
        kk = torch.cat([case.context_k[b], k[s:e].float().transpose(0, 1)], 1)
        vv = torch.cat([case.context_v[b], v[s:e].float().transpose(0, 1)], 1)
        if q.dtype == torch.bfloat16:  # bfloat16 attends keys and values rounded to it, as a 16-bit cache
            kk, vv = kk.to(q.dtype).float(), vv.to(q.dtype).float()
        ref = attention(q[s:e].float(), kk, vv, causal_offset=case.context_k[b].shape[1])
        # fp16: the output's own rounding; bf16: also bfloat16 attention's products over large keys
        # (35.7 and 38.2 dB were drawn; tests/kernels/test_cpu.py asserts 40 dB on its fixed cases)
        floor = {torch.float32: 60.0, torch.float16: 40.0}.get(q.dtype, 30.0)
        got = sqnr_db(ref.float(), out[s:e].float())
        assert got >= floor, (b, got)
