"""How a layer of :class:`kvarn.hf.KVarNCache` stores the tokens it commits.

A committer takes the oldest tokens out of a layer's unquantized tail once enough have arrived and
returns what they read back as. Two kinds:

* :class:`TileCommitter`: a kvarn :class:`~kvarn.schemes.Scheme`; whole tiles of ``group_size``
  tokens become packed records of the reference codec (real ``uint8`` bytes).
* :class:`BaselineCommitter`: a baseline of :mod:`kvarn.baselines`, fake-quantized
  ``commit_tokens`` at a time, its ``window`` newest tokens left unquantized.

A sliding-window layer drops committed tokens that left its window (:meth:`drop`), whole tiles or
commit groups at a time, as a server frees the blocks behind a window.
"""

from __future__ import annotations

from typing import Any

import torch

from kvarn.codec import dequantize_tiles, quantize_tiles
from kvarn.hf.spec import BaselineLike
from kvarn.kernels.cpu.store import quantize_tiles_cpu
from kvarn.schemes import Scheme


class TileCommitter:
    """Commits whole tiles of a kvarn :class:`Scheme` as packed records (real uint8 bytes).

    ``records``: ``[batch, kv_heads, tiles, tile_bytes]`` uint8, in token order.
    """

    def __init__(self, scheme: Scheme, head_dim: int) -> None:
        self.scheme = scheme
        self.head_dim = head_dim
        self.commit_tokens = scheme.group_size
        self.window = 0
        self.tile_bytes = scheme.tile_bytes(head_dim)
        self.records: torch.Tensor | None = None

    def commit(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[B, H, n*G, D]`` keys/values as ``n`` tiles per head; return what they decode to."""
        b, h, s, d = k.shape
        g = self.commit_tokens
        n = s // g
        kt = k.reshape(b * h * n, g, d)  # [B, H, n*G, D] -> [B*H*n, G, D]: tiles in token order
        vt = v.reshape(b * h * n, g, d)
        encode = quantize_tiles_cpu if kt.device.type == "cpu" else quantize_tiles  # CPU: the native store kernel
        rec = encode(kt, vt, self.scheme)
        new = rec.view(b, h, n, self.tile_bytes)
        self.records = new if self.records is None else torch.cat([self.records, new], dim=2)
        kd, vd = dequantize_tiles(rec, self.scheme, d, dtype=k.dtype)
        return kd.view(b, h, s, d), vd.view(b, h, s, d)

    def drop(self, tokens: int, elements: int) -> None:
        """Forget the oldest ``tokens`` committed tokens (a multiple of ``group_size``: whole tiles)."""
        if self.records is not None and tokens:
            self.records = self.records[:, :, tokens // self.commit_tokens :]

    def quantized_bytes(self) -> float:
        """Bytes of the stored records."""
        return 0.0 if self.records is None else float(self.records.numel())

    def reset(self) -> None:
        self.records = None


class BaselineCommitter:
    """Commits ``commit_tokens`` tokens at a time through a baseline's fake quantization."""

    def __init__(self, baseline: BaselineLike, head_dim: int) -> None:
        self.baseline = baseline
        self.head_dim = head_dim
        self.commit_tokens = int(baseline.commit_tokens)
        self.window = int(baseline.window)
        self.bits = float(baseline.bits_per_element(head_dim))
        self.state: dict[str, Any] = {}
        self.committed_elements = 0  # keys and values together, still held

    def commit(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round-trip ``[B, H, n*c, D]`` keys/values (all due groups in one call, oldest first).

        One call per update, not one per group: a baseline's state is set by the first batch it
        sees, as vLLM's ``calculate_kv_scales`` sets the fp8 scales from the first forward pass.
        """
        kq, vq = self.baseline.roundtrip(k.float(), v.float(), self.state)
        self.committed_elements += 2 * k.numel()
        return kq.to(k.dtype), vq.to(v.dtype)

    def drop(self, tokens: int, elements: int) -> None:
        """Forget the oldest committed tokens: ``elements`` numbers, keys and values together."""
        self.committed_elements -= elements

    def quantized_bytes(self) -> float:
        """Bytes a server would hold for the committed tokens, at the baseline's honest bits/element."""
        return self.committed_elements * self.bits / 8.0

    def reset(self) -> None:
        self.state = {}
        self.committed_elements = 0


Committer = TileCommitter | BaselineCommitter
