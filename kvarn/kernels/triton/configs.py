"""Launch configurations: one function per kernel, candidates in preference order.

The launchers in :mod:`kvarn.kernels.triton.ops` use the first candidate unless a config is passed.
Each list is ordered so that the first candidate compiles without register spills for sm_80 and
sm_90 (``tools/compile_gate.py``); the compile-gate figures behind each choice are in
``docs/benchmarks.md`` ("Launch configurations")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvarn.schemes.scheme import Scheme


@dataclass(frozen=True)
class KernelConfig:
    """Triton launch options of one kernel."""

    num_warps: int = 4
    num_stages: int = 1
    block_m: int = 16  # query rows per program (prefill only)
    block_n: int = 32  # tile tokens unpacked per inner step (decode and prefill)
    # register cap per thread passed to ptxas; set, it also stops ptxas trading spills for occupancy
    maxnreg: int | None = None

    def launch_kwargs(self) -> dict[str, int]:
        kw = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return kw if self.maxnreg is None else {**kw, "maxnreg": self.maxnreg}


def store_configs(scheme: Scheme, head_dim: int, bits: int | None = None) -> list[KernelConfig]:
    """Store kernel: one program per tile, streaming it through its workspace in chunks.

    ``block_m`` is the tokens per row chunk (512 elements) and ``block_n`` the channels per
    column chunk (~2048 elements); the kernel reduces over tokens by row chunks and over channels
    by column chunks. The config is per side (``bits``: the side's code width; the two sides are
    separate launches): 4 warps first for 3-bit sides, and 4-bit sides of 64-token tiles, at
    head_dim 128 and 256; 8 warps first otherwise. No register cap (``maxnreg``).
    """
    t, d = scheme.group_size, head_dim
    rows, cols = min(t, max(1, 512 // d)), min(d, max(1, 2048 // t))
    sides = (scheme.key_bits, scheme.value_bits) if bits is None else (bits,)
    if head_dim in (128, 256) and (3 in sides or (t == 64 and 4 in sides)):
        return [KernelConfig(4, 1, rows, cols), KernelConfig(8, 1, rows, cols)]
    return [KernelConfig(8, 1, rows, cols), KernelConfig(4, 1, rows, cols)]


def decode_configs(scheme: Scheme, head_dim: int, group_q: int) -> list[KernelConfig]:
    """Decode attention: one program streams the tiles of one (sequence, KV head, split).

    ``block_n`` is the sub-block of tile tokens unpacked at once (``BT``): up to 64 at head_dim
    <= 64, 32 at 128 (4 warps, register cap 168); at 256 (4 warps, cap 255) BT 32 first, or BT 16
    first with one query head per KV head (``group_q == 1``).
    """
    bt = min(scheme.group_size, 32 if head_dim > 128 else 64)
    if head_dim <= 64:
        return [KernelConfig(4, 2, 16, bt, 168), KernelConfig(8, 2, 16, 2 * bt), KernelConfig(4, 1, 16, bt, 168)]
    if head_dim <= 128:
        return [KernelConfig(4, 2, 16, bt // 2, 168), KernelConfig(8, 1, 16, bt), KernelConfig(4, 1, 16, bt // 2, 168)]
    # one query head per KV head: the half sub-block first
    first, second = (bt // 2, bt) if group_q == 1 else (bt, bt // 2)
    return [KernelConfig(4, 2, 16, first, 255), KernelConfig(4, 2, 16, second, 255), KernelConfig(8, 1, 16, bt)]


def prefill_configs(head_dim: int) -> list[KernelConfig]:
    """Prefill: one program per block of query rows (new tokens x query heads of one KV head).

    ``block_m`` is rows per program (at least the group size rounded up to a power of two: the
    launcher raises it); ``block_n`` the tile sub-block ``BT``. First candidates: head_dim 64,
    8 warps, 64 rows; 128, 4 warps, 16 rows; 256, 8 warps, 16 rows, BT 16, 1 stage.
    """
    if head_dim <= 64:
        return [KernelConfig(8, 2, 64, 32, 255), KernelConfig(8, 2, 32, 32, 255), KernelConfig(4, 2, 16, 32, 255)]
    if head_dim <= 128:
        return [KernelConfig(4, 2, 16, 32, 255), KernelConfig(8, 2, 32, 16, 255)]
    return [KernelConfig(8, 1, 16, 16, 255), KernelConfig(4, 1, 16, 16, 255)]


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode call moves, by launch argument (see :func:`decode_bytes`)."""

    records: int  # packed tiles: every (sequence, KV head) reads each of its records once
    tails: int  # staged rows read (keys and values)
    sinks: int  # exact sink rows read
    metadata: int  # block-table entries, tile counts, lengths and slot ids, as loaded by every program
    query: int  # query rows: once per program, again in the splits that attend plain tokens
    partials: int  # split/rotation partials and (m, l): written by decode, read by the merge
    output: int  # the output, written once
    tables: int  # rotation matrix and log8 table, counted once (every program re-reads them from L2)

    @property
    def total(self) -> int:
        return (
            self.records + self.tails + self.sinks + self.metadata + self.query + self.partials
            + self.output + self.tables
        )  # fmt: skip

    @property
    def overhead(self) -> float:
        """``total / records``: how much more than the packed records one step moves (1.0 = nothing else)."""
        return self.total / max(self.records, 1)


def decode_bytes(
    scheme: Scheme,
    seq_lens: Sequence[int],
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    num_splits: int = 1,
    *,
    query_bytes: int = 2,
    staging_bytes: int = 2,
    pools: bool = True,
) -> DecodeBytes:
    """Bytes :func:`kvarn.kernels.triton.ops.decode_attention` moves for contexts of ``seq_lens`` tokens.

    Computed from the launch arguments and the kernels' loads, not measured: the packed records of
    every full tile, the staged tail and sink rows actually read (``tail_lens``/``sink_lens``
    rows, keys and values), the metadata every program loads, the query (``query_bytes`` per
    element; also the output's), partials when the scheme rotates or ``num_splits > 1`` (float32
    accumulators plus ``(m, l)``, written and read back), and the constant tables once.
    ``pools``: slot ids are read too (``tail_slot``/``sink_slot``).

    Example:
        >>> from kvarn.schemes import Scheme
        >>> b = decode_bytes(Scheme.from_name("kvarn_k4v2_g128"), [32 * 1024] * 32, 8, 32, 128)
        >>> round(b.overhead, 3)
        1.004
    """
    t, d, hkv = scheme.group_size, head_dim, num_kv_heads
    rotate = scheme.rotation != "none"
    records = tails = sinks = metadata = 0
    for n in seq_lens:
        sink = min(n, t) if scheme.sink_tile else 0
        tiles = (n - sink) // t
        tail = n - sink - tiles * t
        if scheme.sink_tokens:
            sink = min(n, scheme.sink_tokens) if tiles else 0
        records += tiles * hkv * scheme.tile_bytes(d)
        tails += tail * hkv * d * 2 * staging_bytes
        sinks += sink * hkv * d * 2 * staging_bytes
        every = 4 + (4 if scheme.sink_len else 0)  # each program: num_tiles, sink_lens
        once = 4 + (4 if pools else 0) + (4 if scheme.sink_len and pools else 0)  # tail_lens, slots
        metadata += hkv * (num_splits * every + once + tiles * 4)  # + the block-table entries
    rows = len(seq_lens) * num_q_heads
    plain_splits = min(num_splits, 2)  # the first split attends the sink, the last the tail
    partial = rotate or num_splits > 1
    acc = rows * (num_splits * (d + 2) + (plain_splits * d if rotate else 0)) * 4 if partial else 0
    tables = (d * d * 4 if rotate else 0) + (256 * 4 if scheme.scale_dtype == "log8" else 0)
    return DecodeBytes(
        records=records,
        tails=tails,
        sinks=sinks,
        metadata=metadata,
        query=rows * (num_splits + plain_splits) * d * query_bytes,
        partials=2 * acc,
        output=rows * d * query_bytes,
        tables=tables,
    )


# split-K heuristic: below ~2 programs per SM the GPU idles, so split long contexts until it is
# full, never into pieces of fewer than MIN_TILES_PER_SPLIT tiles (the partials cost a reduction)
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
_NOMINAL_SMS = 132  # an H100 SXM; used when no CUDA device is present (interpreter)


def choose_num_splits(batch: int, num_kv_heads: int, max_tiles: int, device: torch.device) -> int:
    """Split-K factor for decode: 1 when batch x KV heads already fills the GPU or contexts are short."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _NOMINAL_SMS
    programs = batch * num_kv_heads
    if programs >= sms or max_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
