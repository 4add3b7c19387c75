"""Launch configurations: one function per kernel, candidates in preference order.

The launchers in :mod:`kvarn.kernels.ops` use the first candidate unless a config is passed;
``tools/bench_kernels.py --sweep`` times every candidate on a GPU so the order can be revised from
measurements. No figure here has been measured yet (no GPU was available when these were written):
the defaults follow the register footprint of each kernel (a 128 x 128 float32 tile is 64 KiB,
spread over 8 warps).
"""

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
    # (measured: decode at head_dim 64 on sm_80 got 128 registers and 24-40 bytes of spills without it)
    maxnreg: int | None = None

    def launch_kwargs(self) -> dict[str, int]:
        kw = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return kw if self.maxnreg is None else {**kw, "maxnreg": self.maxnreg}


def store_configs(scheme: Scheme, head_dim: int, bits: int | None = None) -> list[KernelConfig]:
    """Store kernel: one program per tile, streaming it through its workspace in chunks.

    ``block_m`` is the tokens per row chunk (512 elements) and ``block_n`` the channels per
    column chunk (~2048 elements); the kernel reduces over tokens by row chunks and over channels
    by column chunks. Measured with ``tools/compile_gate.py`` (k4v2_g128, 8 warps): row chunks of
    1024 elements spilled 8-28 bytes on sm_90 at head_dim 64 and sm_80 at 256 (ptxas stops at 128
    registers), of 2048 about 700 bytes; 512 compiles to ~100-128 registers without spills.
    The full matrix (``--full --only '^store'``, 2026-12-01; 8 warps) passed on sm_90 (97-102
    registers) and on sm_80 but for a 3-bit side at head_dim 128 (k3v2_g128): ptxas kept it to 80
    registers and spilled 68 bytes. With 4 warps it takes 128 registers and no spills on both archs.
    Triton 3.6.0 (the GPU machines') spilled 8 bytes at 8 warps on sm_90 at head_dim 256 for 3-bit
    sides (g128) and 4-bit sides of 64-token tiles; 4 warps compile them to 128 registers (168 on
    sm_80) without spills on Triton 3.6.0 and 3.9.0. But 4 warps for *both* sides of
    ``kvarn_k3v2_g128`` at 256 spilled 8 bytes on the 2-bit side (fp16, sm_90, Triton 3.9.0), which
    passes at 8 warps on both: so the config is per side (``bits``: the side's code width; the
    two sides are separate launches), 4 warps only for the sides that need them.
    A register cap does not help: ``maxnreg`` 128 or 168 at 8 warps, or 4 warps elsewhere, spilled
    8-48 bytes on sm_90 (head_dim 64 and 256) where the uncapped 8-warp kernels did not.
    """
    t, d = scheme.group_size, head_dim
    rows, cols = min(t, max(1, 512 // d)), min(d, max(1, 2048 // t))
    sides = (scheme.key_bits, scheme.value_bits) if bits is None else (bits,)
    if (head_dim in (128, 256) and 3 in sides) or (head_dim == 256 and t == 64 and 4 in sides):
        return [KernelConfig(4, 1, rows, cols), KernelConfig(8, 1, rows, cols)]
    return [KernelConfig(8, 1, rows, cols), KernelConfig(4, 1, rows, cols)]


def decode_configs(scheme: Scheme, head_dim: int, group_q: int) -> list[KernelConfig]:
    """Decode attention: one program streams the tiles of one (sequence, KV head, split).

    ``block_n`` is the sub-block of tile tokens unpacked at once (``BT``). Measured with
    ``python tools/compile_gate.py --only decode`` (k4v2_g128, with and without a sink token,
    Triton 3.9 and 3.6), no spills: sm_90 head_dim 64, 4 warps, BT 64, cap 168: 154-164
    registers, 3 programs/SM; 128, 4 warps, BT 32, cap 168: 166, 3 programs/SM; 256, 4 warps, BT
    32: 254, 2 programs/SM. 8 warps spilled at 128 with Triton 3.6, and reach no lower at 256.
    One query head per KV head at 256 takes BT 16: at BT 32 Triton 3.6 spilled 8 bytes on sm_90
    (k4v2_g128, fp16, split-K 4; the full matrix, 2026-12-01); BT 16 compiles to 252-255 registers
    and 2 programs/SM without spills.
    Unmeasured on a GPU: the alternatives follow for ``bench_kernels --sweep``.
    """
    bt = min(scheme.group_size, 32 if head_dim > 128 else 64)
    if head_dim <= 64:
        return [KernelConfig(4, 2, 16, bt, 168), KernelConfig(8, 2, 16, 2 * bt), KernelConfig(4, 1, 16, bt, 168)]
    if head_dim <= 128:
        return [KernelConfig(4, 2, 16, bt // 2, 168), KernelConfig(8, 1, 16, bt), KernelConfig(4, 1, 16, bt // 2, 168)]
    # one query head per KV head: the half sub-block first (Triton 3.6.0 spilled 8 bytes at BT 32, sm_90)
    first, second = (bt // 2, bt) if group_q == 1 else (bt, bt // 2)
    return [KernelConfig(4, 2, 16, first, 255), KernelConfig(4, 2, 16, second, 255), KernelConfig(8, 1, 16, bt)]


def dequant_configs(scheme: Scheme, head_dim: int) -> list[KernelConfig]:
    """Unused since prefill dequantizes inside its attention loop; kept for its importers (see prefill_configs)."""
    return prefill_configs(head_dim)


def prefill_configs(head_dim: int) -> list[KernelConfig]:
    """Prefill: one program per block of query rows (new tokens x query heads of one KV head).

    ``block_m`` is rows per program (at least the group size rounded up to a power of two: the
    launcher raises it); ``block_n`` the tile sub-block ``BT``. Compiled for sm_90 (k4v2_g128,
    with and without a sink token) with Triton 3.9 and 3.6, no spills: head_dim 64, 8 warps, 64
    rows: 191-218 registers, 1 program/SM; 128, 4 warps, 16 rows: 198-212, 2 programs/SM (8 warps
    and 32 rows spilled 8 bytes with a sink); 256, 8 warps, 16 rows, BT 16, 1 stage: 254-255, 1
    program/SM (4 warps spilled 20 bytes with bf16 queries and 4 query heads per KV head).
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
    """Bytes :func:`kvarn.kernels.ops.decode_attention` moves for contexts of ``seq_lens`` tokens.

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


def split_lengths(seq_lens: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Context lengths ``[B]`` -> ``(num_tiles, tail_lens, sink_lens)`` ``[B]`` int32 for this layout.

    With ``scheme.sink_tile`` the first ``group_size`` tokens are sink tokens and every full tile
    after them is packed. With ``scheme.sink_tokens = S`` every full tile is packed and
    ``sink_lens`` is ``min(len, S)`` once the first tile is packed, else 0 (the tokens are still in
    the tail). Otherwise ``sink_lens`` is None. The rest is the tail.

    Example:
        >>> lens = torch.tensor([1, 40, 64])
        >>> [x.tolist() for x in split_lengths(lens, Scheme.from_name("kvarn_k4v2_g32_sink2"))]
        [[0, 1, 2], [1, 8, 0], [0, 2, 2]]
    """
    lens = seq_lens.to(torch.int32)
    t = scheme.group_size
    sink = torch.clamp(lens, max=t) if scheme.sink_tile else None
    rest = lens - sink if sink is not None else lens
    tiles = torch.div(rest, t, rounding_mode="floor")
    if scheme.sink_tokens:
        sink = torch.where(tiles > 0, torch.clamp(lens, max=scheme.sink_tokens), 0)
    return tiles.to(torch.int32), (rest - tiles * t).to(torch.int32), None if sink is None else sink.to(torch.int32)


def choose_num_splits(batch: int, num_kv_heads: int, max_tiles: int, device: torch.device) -> int:
    """Split-K factor for decode: 1 when batch x KV heads already fills the GPU or contexts are short."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _NOMINAL_SMS
    programs = batch * num_kv_heads
    if programs >= sms or max_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
