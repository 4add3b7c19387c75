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
    block_n: int = 32  # keys per inner step (prefill only)

    def launch_kwargs(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def store_configs(scheme: Scheme, head_dim: int) -> list[KernelConfig]:
    """Store kernel: one program holds a whole ``[group_size, head_dim]`` float32 tile."""
    elems = scheme.group_size * head_dim
    warps = 4 if elems <= 64 * 64 else 8 if elems <= 128 * 128 else 16
    return [KernelConfig(warps, 1), KernelConfig(max(4, warps // 2), 1), KernelConfig(min(16, warps * 2), 1)]


def decode_configs(scheme: Scheme, head_dim: int, group_q: int) -> list[KernelConfig]:
    """Decode attention: one program streams the tiles of one (sequence, KV head, split)."""
    warps = 4 if scheme.group_size * head_dim <= 64 * 128 else 8
    return [KernelConfig(warps, 2), KernelConfig(warps, 3), KernelConfig(max(4, warps // 2), 2)]


def dequant_configs(scheme: Scheme, head_dim: int) -> list[KernelConfig]:
    """Workspace dequantization for prefill: one program per (tile, KV head)."""
    warps = 4 if scheme.group_size * head_dim <= 64 * 128 else 8
    return [KernelConfig(warps, 1), KernelConfig(max(4, warps // 2), 1)]


def prefill_configs(head_dim: int) -> list[KernelConfig]:
    """Prefill attention over the dense workspace: one program per (query block, query head)."""
    warps = 4 if head_dim <= 64 else 8
    return [KernelConfig(warps, 2, 64, 64), KernelConfig(4, 3, 32, 64), KernelConfig(warps, 2, 16, 32)]
