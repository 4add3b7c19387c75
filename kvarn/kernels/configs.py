"""Launch configurations: one function per kernel, candidates in preference order.

The launchers in :mod:`kvarn.kernels.ops` use the first candidate unless a config is passed;
``tools/bench_kernels.py --sweep`` times every candidate on a GPU so the order can be revised from
measurements. No figure here has been measured yet (no GPU was available when these were written):
the defaults follow the register footprint of each kernel (a 128 x 128 float32 tile is 64 KiB,
spread over 8 warps).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvarn.schemes.scheme import Scheme


@dataclass(frozen=True)
class KernelConfig:
    """Triton launch options of one kernel."""

    num_warps: int = 4
    num_stages: int = 1
    block_m: int = 16  # query rows per program (prefill only)
    block_n: int = 32  # tile tokens unpacked per inner step (decode and prefill)

    def launch_kwargs(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def store_configs(scheme: Scheme, head_dim: int) -> list[KernelConfig]:
    """Store kernel: one program per tile, streaming it in chunks of ~4096 elements.

    ``block_m`` is the tokens per row chunk and ``block_n`` the channels per column chunk (the
    kernel reduces over tokens by row chunks and over channels by column chunks); at least 16 each,
    the smallest ``tl.dot`` operand. Compile gate (sm_90, ``tools/compile_gate.py``): see
    docs/benchmarks.md for the registers and shared memory of these choices.
    """
    t, d = scheme.group_size, head_dim
    rows, cols = min(t, max(16, 4096 // d)), min(d, max(16, 4096 // t))
    return [KernelConfig(8, 1, rows, cols), KernelConfig(4, 1, rows, cols), KernelConfig(8, 1, max(16, rows // 2), cols)]


def decode_configs(scheme: Scheme, head_dim: int, group_q: int) -> list[KernelConfig]:
    """Decode attention: one program streams the tiles of one (sequence, KV head, split).

    ``block_n`` is the sub-block of tile tokens unpacked at once (``BT``): 64 up to head_dim 128,
    32 at 256, so the bf16 code block ``[BT, D]`` stays at 16 KiB and two or more programs fit on
    an SM at head_dim 128 (the compile gate's table has the measured registers and occupancy).
    """
    bt = min(scheme.group_size, 64 if head_dim <= 128 else 32)
    return [KernelConfig(4, 2, 16, bt), KernelConfig(4, 3, 16, bt), KernelConfig(8, 2, 16, bt)]


def dequant_configs(scheme: Scheme, head_dim: int) -> list[KernelConfig]:
    """Unused since prefill dequantizes inside its attention loop; kept for its importers (see prefill_configs)."""
    return prefill_configs(head_dim)


def prefill_configs(head_dim: int) -> list[KernelConfig]:
    """Prefill: one program per (block of query rows = tokens x query heads of one KV head).

    ``block_m`` is rows per program (at least the group size, rounded up to a power of two, by the
    launcher); ``block_n`` the tile sub-block ``BT`` as in decode. Rows shrink as head_dim grows
    so the rotated query and two ``[block_m, D]`` float32 accumulators fit in registers.
    """
    if head_dim <= 64:
        return [KernelConfig(4, 2, 64, 64), KernelConfig(4, 2, 32, 64)]
    if head_dim <= 128:
        return [KernelConfig(4, 2, 32, 64), KernelConfig(8, 2, 64, 64)]
    return [KernelConfig(8, 2, 16, 32), KernelConfig(8, 2, 32, 32)]
