"""A directory of kvarn KV records, addressed by the tokens they hold.

Three kinds of record, each one file of per-layer tensors (safetensors, keyed by layer name):

* a **tile**: tile ``j`` of a sequence, every kvarn layer's packed record ``[H, tile_bytes]`` uint8,
  keyed by the chain hash of tokens ``0 .. (j + 1) * T - 1`` (as vLLM's block hashes: a tile's
  record depends on every token before it);
* a **tail**: the ``rem < T`` rows of the partial tile after ``n`` whole tiles,
  ``[rem, H, row_bytes]`` uint8 (keys then values of each row in the model dtype, as in the tail
  pages of :mod:`kvarn.vllm.tail`), keyed by the chain hash of the ``n`` tiles and the hash of the
  ``rem`` tokens, which it holds too (``tokens``): a prompt sharing only its first rows loads those;
* a **sink**: the exact first ``capacity`` rows of a sequence, ``[2, H, capacity, D]`` in the
  model dtype (keys, values; :mod:`kvarn.vllm.sinks`), keyed by the hash of those tokens.

The store's folder is ``root / namespace``: the namespace names the model, the scheme and the row
dtype, so two engines share records only when their records mean the same thing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT_KEY = "root"  # the chain hash of zero tiles
TOKENS = "tokens"  # a tail record's token ids (int64), beside its layers' rows


def token_hash(tokens: Sequence[int], parent: str = "") -> str:
    """A hex digest of ``parent`` and the token ids ``tokens`` (little-endian int64)."""
    h = hashlib.sha256(parent.encode())
    h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:32]


def tile_keys(tokens: Sequence[int], group_size: int) -> list[str]:
    """The chain hash of every whole tile of ``tokens``: ``keys[j]`` covers tokens ``0 .. (j + 1) * T - 1``."""
    keys, parent = [], ROOT_KEY
    for j in range(len(tokens) // group_size):
        parent = token_hash(tokens[j * group_size : (j + 1) * group_size], parent)
        keys.append(parent)
    return keys


def namespace(*parts: object) -> str:
    """A folder name for records that ``parts`` (model, scheme name, row dtype, ...) describe."""
    return token_hash([], "|".join(map(str, parts)))


class RecordStore:
    """The records of one namespace under ``root``; counts the bytes it wrote (``bytes_written``)."""

    def __init__(self, root: str | Path, space: str) -> None:
        self.path = Path(root) / space
        self.bytes_written = 0

    def _file(self, kind: str, key: str) -> Path:
        return self.path / f"{kind}-{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        """Whether a record of ``kind`` (``tile``, ``tail``, ``sink``) is stored under ``key``."""
        return self._file(kind, key).is_file()

    def read(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        """The record's tensors by layer name.

        Raises:
            FileNotFoundError: no such record.
        """
        return load_file(str(self._file(kind, key)))

    def write(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Store a record (written to a temporary name, then renamed: readers never see half a file)."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self._file(kind, key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        self.bytes_written += tmp.stat().st_size
        os.replace(tmp, path)

    @staticmethod
    def tail_key(prefix: str, tokens: Sequence[int]) -> str:
        """The key of the tail rows of ``tokens`` after the tiles whose chain hash is ``prefix``."""
        return f"{prefix}-{token_hash(tokens)}"

    def write_tail(self, prefix: str, tokens: Sequence[int], rows: dict[str, torch.Tensor]) -> None:
        """Store the tail rows (``[len(tokens), H, row_bytes]`` uint8 per layer) of ``tokens`` after the
        tiles ``prefix``, with the tokens themselves (a later prompt may share only their first rows)."""
        self.write("tail", self.tail_key(prefix, tokens), {**rows, TOKENS: torch.tensor(list(tokens))})

    def longest_tail(self, prefix: str, tokens: Sequence[int]) -> tuple[int, str]:
        """The most leading rows of ``tokens`` (after the tiles ``prefix``) that a stored tail holds, and
        that tail's key: ``(0, "")`` if none. A tail's row ``r`` depends on its tokens ``0 .. r`` only,
        so a tail of more rows serves any prefix of its tokens."""
        best, key = 0, ""
        for path in sorted(self.path.glob(f"tail-{prefix}-*.safetensors")) if tokens else []:
            with safe_open(str(path), "pt") as f:
                stored = f.get_tensor(TOKENS).tolist()
            same = next((i for i, (a, b) in enumerate(zip(stored, tokens, strict=False)) if a != b), None)
            rows = min(len(stored), len(tokens)) if same is None else same
            if rows > best:
                best, key = rows, path.name[len("tail-") : -len(".safetensors")]
        return best, key
