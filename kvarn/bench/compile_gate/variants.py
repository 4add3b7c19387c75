"""The kernel variants the compile gate (:mod:`kvarn.bench.compile_gate`) builds, and how it launches each.

A variant is one call of a real launcher in :mod:`kvarn.kernels.triton.ops` with small CPU tensors shaped
like a serving step (8 KV heads, 2 sequences of 3 packed tiles and a partial tail, plus the exact
first tokens or sink tile when the scheme keeps them, as every built-in does); under the
gate's stand-in driver every kernel that call launches is compiled instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvarn.kernels import PagedContext
from kvarn.kernels.triton import ops
from kvarn.schemes import BUILTINS, get_scheme

HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 7, 8)  # query heads per KV head; 7 is not a power of two
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# the store's block ids: int64 from vLLM's step plan, int32 from quantize_tiles_triton; the pointer's
# element type is part of the kernel's signature, so each compiles a kernel of its own
BLOCK_IDS = {"i64": torch.int64, "i32": torch.int32}
KV_HEADS = 8
# Every built-in keeps exact first tokens (the kernels' HAS_SINK specialization); this opt-out keeps
# the specialization without a sink compiled too.
NO_SINK = "kvarn_k4v2_g128_sink0"


@dataclass(frozen=True)
class Variant:
    """One launcher call to compile: arch, op (store, decode, prefill), scheme, head_dim, query dtype.

    ``pool``: decode/prefill read the staging tail from a slot-indexed pool (``tail_slot``, the
    vLLM path, a kernel specialization of its own) rather than per sequence. ``ids``: the store's
    block id dtype (:data:`BLOCK_IDS`).
    """

    arch: int
    op: str
    scheme: str
    head_dim: int
    dtype: str = "bf16"
    group: int = 1  # decode/prefill: query heads per KV head
    splits: int = 1  # decode: split-K factor
    pool: bool = True
    ids: str = "i64"  # store: block id dtype

    @property
    def name(self) -> str:
        short = self.scheme.removeprefix("kvarn_")
        extra = f" {self.ids}" if self.op == "store" else ""
        if self.op != "store":
            extra = f" g{self.group}" + (f" s{self.splits}" if self.op == "decode" else "")
            extra += "" if self.pool else " per-seq"
        return f"{self.op} {short} d{self.head_dim} {self.dtype}{extra}"


def full_variants(archs: tuple[int, ...] = (90, 80)) -> list[Variant]:
    """Every built-in preset (and :data:`NO_SINK`) x head_dim 64/128/256 x query groups 1/4/7/8 x fp16/bf16 x arch.

    The store with int64 and int32 block ids; decode with and without split-K; decode and prefill read the tail pool by slot (the vLLM path)
    at every group, and per sequence at group 1.
    """
    out = []
    for arch in archs:
        for name in (*BUILTINS, NO_SINK):
            for d in HEAD_DIMS:
                for dt in DTYPES:
                    out += [Variant(arch, "store", name, d, dt, ids=ids) for ids in BLOCK_IDS]
                    for g in GROUPS:
                        out += [Variant(arch, "decode", name, d, dt, g, s) for s in (1, 4)]
                        out.append(Variant(arch, "prefill", name, d, dt, g))
                    out.append(Variant(arch, "decode", name, d, dt, 1, 1, pool=False))
                    out.append(Variant(arch, "prefill", name, d, dt, 1, pool=False))
    return out


def quick_variants(archs: tuple[int, ...] = (90, 80)) -> list[Variant]:
    """Each kernel at each head_dim on each arch (the subset ``make test`` runs), with the default
    exact first token; decode and prefill also without a sink (:data:`NO_SINK`) at head_dim 128,
    decode with one query head per KV head at 256, the store of a scheme with a 3-bit side at
    head_dim 128, and the store of 64-token tiles at head_dim 128 with int64 and int32 block ids."""
    out = []
    for arch in archs:
        for d in HEAD_DIMS:
            out += [
                Variant(arch, "store", "kvarn_k4v2_g128", d, "bf16"),
                Variant(arch, "decode", "kvarn_k4v2_g128", d, "bf16", 7, 1),
                Variant(arch, "decode", "kvarn_k4v2_g128", d, "fp16", 4, 4, pool=False),
                Variant(arch, "prefill", "kvarn_k4v2_g128", d, "bf16", 4),
            ]
        out += [Variant(arch, "decode", NO_SINK, 128, "bf16", 7, 1), Variant(arch, "prefill", NO_SINK, 128, "bf16", 4)]
        # one query head per KV head at 256 has a config of its own
        out.append(Variant(arch, "decode", "kvarn_k4v2_g128", 256, "fp16", 1, 4))
        # a 3-bit side is packed differently and has a config of its own at head_dim 128
        out.append(Variant(arch, "store", "kvarn_k3v2_g128", 128, "bf16"))
        # a 4-bit side of 64-token tiles has a config of its own at head_dim 128
        out += [Variant(arch, "store", "kvarn_k4v2_g64", 128, "bf16", ids=ids) for ids in BLOCK_IDS]
    return out


def launch(v: Variant) -> None:
    """Call the launcher of ``v.op`` with small CPU tensors shaped like a serving step."""
    scheme, d, dt, h = get_scheme(v.scheme), v.head_dim, DTYPES[v.dtype], KV_HEADS
    t, bsz, tiles = scheme.group_size, 2, 3
    i32 = torch.int32
    if v.op == "store":
        x = torch.zeros(bsz, h, t, d, dtype=dt)
        cache = torch.zeros(bsz, h, scheme.tile_bytes(d), dtype=torch.uint8)
        ops.store_tiles(x, x, cache, torch.arange(bsz, dtype=BLOCK_IDS[v.ids]), scheme)
        return
    cache = torch.zeros(bsz * tiles, h, scheme.tile_bytes(d), dtype=torch.uint8)
    table = torch.arange(bsz * tiles, dtype=i32).view(bsz, tiles)
    num_tiles = torch.full((bsz,), tiles, dtype=i32)
    tail = torch.zeros(bsz + 1 if v.pool else bsz, h, t, d, dtype=dt)
    tail_lens = torch.full((bsz,), 5, dtype=i32)
    kw: dict[str, Any] = {"tail_slot": torch.arange(1, bsz + 1, dtype=i32)} if v.pool else {}
    if scheme.sink_len:  # exact first tokens (the default) or a sink tile: the sink pool, read like the tail
        sink = torch.zeros(bsz + 1 if v.pool else bsz, h, scheme.sink_len, d, dtype=dt)
        kw.update(sink_k=sink, sink_v=sink, sink_lens=torch.full((bsz,), scheme.sink_len, dtype=i32))
        if v.pool:
            kw["sink_slot"] = torch.arange(1, bsz + 1, dtype=i32)
    hq = h * v.group
    if v.op == "decode":
        q = torch.zeros(bsz, hq, d, dtype=dt)
        ctx = PagedContext(cache, table, num_tiles, tail, tail, tail_lens, scheme, **kw)
        ops.decode_attention(q, ctx, num_splits=v.splits)
    elif v.op == "prefill":
        n = 3
        q = torch.zeros(bsz * n, hq, d, dtype=dt)
        k = torch.zeros(bsz * n, h, d, dtype=dt)
        cu = torch.arange(0, bsz * n + 1, n, dtype=i32)
        ops.prefill_attention(q, k, k, cu, PagedContext(cache, table, num_tiles, tail, tail, tail_lens, scheme, **kw))
    else:
        raise ValueError(f"unknown op {v.op!r}; allowed: store, decode, prefill")
