"""GPU benchmark of kvarn's Triton kernels: decode attention vs 16-bit attention, and the store kernel.

Usage::

    python tools/bench_kernels.py            # batch 1/32/128 x context 4K/32K/128K (a few minutes)
    python tools/bench_kernels.py --quick    # batch 1/32 x context 4K/32K
    python tools/bench_kernels.py --batches 32 --contexts 32768 --out bench.md

Model shape of one attention layer: 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B-like).
For each (scheme, batch, context) it times, with ``triton.testing.do_bench``: kvarn decode attention
over the packed paged cache, torch SDPA over a 16-bit cache (fastest of its backends), and
FlashAttention's ``flash_attn_with_kvcache`` if installed. It prints microseconds, bytes moved,
achieved GB/s and the fraction of the copy bandwidth measured in the same run (kvarn: every byte
its decode call moves, by ``kvarn.kernels.triton.configs.decode_bytes``; 16-bit: keys and values). Without
a CUDA GPU it says so and exits 0. Shapes that do not fit in free GPU memory are skipped and reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SCHEMES = ("kvarn_k4v2_g128", "kvarn_k4v4_g128")
Bench = Callable[[Callable[[], Any]], float]  # times a function, returns milliseconds


@dataclass
class Row:
    """One timed kernel at one shape."""

    scheme: str
    batch: int
    context: int
    kernel: str
    us: float
    bytes_read: int
    copy_gbs: float

    @property
    def gbs(self) -> float:
        return self.bytes_read / self.us / 1e3

    def cells(self, sdpa_us: float | None) -> list[str]:
        speed = f"{sdpa_us / self.us:.2f}x" if sdpa_us else "-"
        return [
            self.scheme, str(self.batch), f"{self.context // 1024}K", self.kernel, f"{self.us:.1f}",
            f"{self.bytes_read / 1e6:.1f}", f"{self.gbs:.0f}", f"{100 * self.gbs / self.copy_gbs:.0f}%", speed,
        ]  # fmt: skip


def copy_bandwidth(bench: Bench, gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src)) * 1e3
    return 2 * n / us / 1e3


def sdpa_us(bench: Bench, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, str]:
    """Fastest torch SDPA backend for q ``[B, Hq, 1, D]`` over k/v ``[B, Hkv, L, D]``: (us, name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best: tuple[float, str] = (float("inf"), "none")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):

        def run(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel([b]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        try:
            run()
        except (RuntimeError, NotImplementedError, ValueError):  # backend unavailable for this shape or build
            continue
        us = bench(run) * 1e3
        if us < best[0]:
            best = (us, backend.name.lower())
    return best


def flash_us(bench: Bench, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float | None:
    """FlashAttention decode over a dense 16-bit cache, or None when flash_attn is not installed."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    qf, kf, vf = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, L, H, D]
    lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    return float(bench(lambda: flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=lens))) * 1e3


def _kvarn_row(
    bench: Bench, name: str, batch: int, context: int, hq: int, hkv: int, d: int, copy_gbs: float, dev: str
) -> Row:
    """Time kvarn decode over a packed paged cache of ``context`` tokens per sequence.

    Schemes that keep exact first tokens (every built-in, by default) or a sink tile read them from a
    per-sequence sink, as served: a sink tile replaces the first packed tile.
    """
    from kvarn.codec import quantize_tiles
    from kvarn.kernels import PagedContext
    from kvarn.kernels.triton import choose_num_splits, decode_attention, decode_bytes
    from kvarn.schemes import get_scheme

    scheme = get_scheme(name)
    t, tb = scheme.group_size, scheme.tile_bytes(d)
    tiles = context // t - (1 if scheme.sink_tile else 0)  # packed tiles
    # a few valid records repeated over the whole cache (timing does not depend on the values)
    seed_k, seed_v = torch.randn(2, 16, t, d).unbind(0)
    recs = quantize_tiles(seed_k, seed_v, scheme).to(dev)
    cache = recs[torch.arange(batch * tiles * hkv, device=dev) % 16].view(batch * tiles, hkv, tb)
    table = torch.randperm(batch * tiles, device=dev).to(torch.int32).view(batch, tiles)
    num_tiles = torch.full((batch,), tiles, dtype=torch.int32, device=dev)
    tail = torch.randn(batch, hkv, t, d, dtype=torch.float16, device=dev)
    tail_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
    sink_k = sink_lens = None
    if scheme.sink_len:
        sink_k = torch.randn(batch, hkv, scheme.sink_len, d, dtype=torch.float16, device=dev)
        sink_lens = torch.full((batch,), scheme.sink_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, dtype=torch.float16, device=dev)
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, hkv, tiles, torch.device(dev))
    us = bench(
        lambda: decode_attention(
            q,
            PagedContext(
                cache,
                table,
                num_tiles,
                tail,
                tail,
                tail_lens,
                scheme,
                sink_k=sink_k,
                sink_v=sink_k,
                sink_lens=sink_lens,
            ),
            num_splits=splits,
            out=out,
        )
    )
    # every byte the call moves (records, query, output, split partials, metadata), from its arguments
    moved = decode_bytes(scheme, [context // t * t] * batch, hkv, hq, d, splits, pools=False).total
    return Row(name, batch, context, "kvarn", us * 1e3, moved, copy_gbs)


def bench_shape(
    bench: Bench, name: str, batch: int, context: int, hq: int, hkv: int, d: int, copy_gbs: float, dev: str = "cuda"
) -> list[Row]:
    """Time kvarn decode and the 16-bit baselines at one shape; [] when it does not fit in memory."""
    from kvarn.schemes import get_scheme

    scheme = get_scheme(name)
    need = batch * (context // scheme.group_size) * hkv * scheme.tile_bytes(d) + 2 * batch * hkv * context * d * 2
    if dev == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if need > 0.85 * free:
            print(f"skip {name} batch {batch} context {context}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            return []
    rows = [_kvarn_row(bench, name, batch, context, hq, hkv, d, copy_gbs, dev)]
    q = torch.randn(batch, hq, 1, d, dtype=torch.float16, device=dev)
    k = torch.randn(batch, hkv, context, d, dtype=torch.float16, device=dev)
    v = torch.randn_like(k)
    fp16_bytes = 2 * k.numel() * 2
    us, backend = sdpa_us(bench, q, k, v)
    rows.append(Row(name, batch, context, f"sdpa-fp16 ({backend})", us, fp16_bytes, copy_gbs))
    fa = flash_us(bench, q, k, v)
    if fa is not None:
        rows.append(Row(name, batch, context, "flash-attn-fp16", fa, fp16_bytes, copy_gbs))
    return rows


def bench_store(
    bench: Bench, name: str, batch: int, hkv: int, d: int, decode_us: float | None, dev: str = "cuda"
) -> str:
    """Cost of storing one full tile per sequence (every sequence filling a tile in the same step)."""
    from kvarn.kernels.triton import store_tiles
    from kvarn.schemes import get_scheme

    scheme = get_scheme(name)
    k = torch.randn(batch, hkv, scheme.group_size, d, dtype=torch.float16, device=dev)
    v = torch.randn_like(k)
    cache = torch.empty(batch, hkv, scheme.tile_bytes(d), dtype=torch.uint8, device=dev)
    ids = torch.arange(batch, dtype=torch.int32, device=dev)
    us = bench(lambda: store_tiles(k, v, cache, ids, scheme)) * 1e3
    line = f"store {name} batch {batch}: {us:.1f} us for {batch * hkv} tiles"
    if decode_us:
        amortized = us / scheme.group_size  # a sequence fills one tile every group_size steps
        line += (
            f"; {100 * us / decode_us:.1f}% of a decode step if all fill at once, "
            f"{100 * amortized / decode_us:.2f}% amortized over {scheme.group_size} steps"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 1/32, context 4K/32K")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU on this machine; nothing measured (the CPU tests prove correctness only).")
        return 0
    import triton.testing

    def bench(fn: Callable[[], Any]) -> float:  # milliseconds
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))

    batches = args.batches or ([1, 32] if args.quick else [1, 32, 128])
    contexts = args.contexts or ([4096, 32768] if args.quick else [4096, 32768, 131072])
    gpu = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(bench)
    header = ["scheme", "batch", "context", "kernel", "us", "MB read", "GB/s", "of copy BW", "vs SDPA"]
    lines = [
        f"GPU: {gpu}; torch {torch.__version__}; triton {triton.__version__}; copy bandwidth {copy_gbs:.0f} GB/s",
        f"shape: {args.q_heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, fp16 queries",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    print("\n".join(lines), flush=True)
    store_lines = []
    for name in args.schemes:
        step_us = None  # kvarn decode at batch 32, 32K context: the step the store cost is compared with
        for batch in batches:
            for context in contexts:
                rows = bench_shape(bench, name, batch, context, args.q_heads, args.kv_heads, args.head_dim, copy_gbs)
                sdpa = next((r.us for r in rows if r.kernel.startswith("sdpa")), None)
                for r in rows:
                    line = "| " + " | ".join(r.cells(sdpa)) + " |"
                    lines.append(line)
                    print(line, flush=True)
                    if (r.kernel, r.batch, r.context) == ("kvarn", 32, 32768):
                        step_us = r.us
                torch.cuda.empty_cache()
        store_lines.append(bench_store(bench, name, 32, args.kv_heads, args.head_dim, step_us))
        torch.cuda.empty_cache()
    lines += ["", *store_lines]
    print("\n".join(["", *store_lines]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0
