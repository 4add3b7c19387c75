"""A directory of kvarn KV records, addressed by the tokens they hold, each checked before it is used.

Three kinds of record, each one file of per-layer tensors (safetensors, keyed by layer name):

* a **tile**: tile ``j`` of a sequence, every kvarn layer's packed record ``[H, tile_bytes]`` uint8,
  keyed by the chain hash of tokens ``0 .. (j + 1) * T - 1`` (as vLLM's block hashes: a tile's
  record depends on every token before it);
* a **tail**: the ``rem < T`` rows of the partial tile after ``n`` whole tiles,
  ``[rem, H, row_bytes]`` uint8 (keys then values of each row in the model dtype, as in the tail
  pages of :mod:`kvarn.vllm.tail`), keyed by the chain hash of the ``n`` tiles and the hash of the
  ``rem`` tokens, which its header holds too: a prompt sharing only its first rows loads those;
* a **sink**: the exact first ``capacity`` rows of a sequence, ``[2, H, capacity, D]`` in the
  model dtype (keys, values; :mod:`kvarn.vllm.sinks`), keyed by the hash of those tokens.

The store's folder is ``root / Identity.namespace``: model (its path and a fingerprint of its
weights), scheme, row dtype and head size, so two engines share records only when their records
mean the same thing. Every record's header (safetensors metadata) repeats that identity with the
record format, its kind and key, and a CRC-32 of its tensors; :meth:`RecordStore.read` raises
:class:`RecordError` for a record that is truncated, damaged, or says anything else, and
:meth:`RecordStore.check` moves such a file aside (``<name>.rejected-<id>``, logged with why), so
that its tokens are computed and saved again. The CRC catches damage (a disk, a partial copy), not
tampering: the store is as trusted as the folder it lives in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

logger = logging.getLogger("kvarn.vllm")

FORMAT = "kvarn-kv-record/2"  # a record's header and bytes; a change that alters their meaning bumps it
ROOT_KEY = "root"  # the chain hash of zero tiles
KINDS = ("tile", "tail", "sink")
_MAX_HEADER = 1 << 24  # bytes of a safetensors header kvarn reads before giving up on a file


class RecordError(ValueError):
    """A stored record that must not be loaded; ``path`` names its file and ``why`` says what is wrong."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"record {path}: {why}")
        self.path, self.why = path, why


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


@dataclass(frozen=True)
class Identity:
    """What every record of a store says it is: made by ``model`` (path or name) whose weights have
    the fingerprint ``weights`` (:func:`kvarn.vllm.connectors.fingerprint.model_fingerprint`), with
    the scheme of canonical name ``scheme``, rows of ``dtype`` and heads of ``head_size``."""

    model: str
    weights: str
    scheme: str
    dtype: str
    head_size: int

    @property
    def namespace(self) -> str:
        """The store's folder name for these records."""
        return token_hash([], "|".join(map(str, (self.model, self.weights, self.scheme, self.dtype, self.head_size))))

    def header(self) -> dict[str, str]:
        """The fields a record's header must hold to be this identity's."""
        return {"format": FORMAT, "model": self.weights, "scheme": self.scheme, "dtype": self.dtype,
                "head_size": str(self.head_size)}  # fmt: skip


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 of the names and bytes of ``tensors``, in name order (8 hex digits)."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


def read_header(path: Path) -> dict[str, str]:
    """The metadata of the safetensors file ``path`` (its tensors unread).

    Raises:
        FileNotFoundError: no such file.
        RecordError: the file does not start with a readable safetensors header.
    """
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= _MAX_HEADER:
            raise RecordError(path, f"no safetensors header (header length {size})")
        raw = f.read(size)
    if len(raw) < size:
        raise RecordError(path, f"truncated in its header ({len(raw)} of {size} bytes)")
    try:
        meta = json.loads(raw).get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise RecordError(path, f"unreadable header ({e})") from e
    if not isinstance(meta, dict):
        raise RecordError(path, "unreadable header (metadata is not a mapping)")
    return {str(k): str(v) for k, v in meta.items()}


class RecordStore:
    """The records of ``identity`` under ``root``; counts the bytes it wrote (``bytes_written``)."""

    def __init__(self, root: str | Path, identity: Identity) -> None:
        self.identity = identity
        self.path = Path(root) / identity.namespace
        self.bytes_written = 0
        self._checked: dict[Path, tuple[int, int, int]] = {}  # file -> (inode, size, mtime) found valid

    def _file(self, kind: str, key: str) -> Path:
        return self.path / f"{kind}-{key}.safetensors"

    def _verify(self, path: Path, kind: str, key: str, data: bytes) -> dict[str, torch.Tensor]:
        """The tensors of the record file ``path`` whose bytes are ``data``, if it is a whole record of
        this store's identity, kind and key; else :class:`RecordError`."""
        if len(data) < 8:
            raise RecordError(path, f"truncated ({len(data)} bytes)")
        size = int.from_bytes(data[:8], "little")
        if not 2 <= size <= min(_MAX_HEADER, len(data) - 8):
            raise RecordError(
                path, f"truncated or not a safetensors file (header of {size} bytes, file of {len(data)})"
            )
        try:
            meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
            tensors = load(data)
        except (ValueError, AttributeError, SafetensorError) as e:
            raise RecordError(path, f"truncated or damaged ({e})") from e
        want = {**self.identity.header(), "kind": kind, "key": key}
        wrong = [f"{k} {meta.get(k)!r}, expected {v!r}" for k, v in want.items() if meta.get(k) != v]
        if wrong:
            raise RecordError(path, "it is another store's record: " + "; ".join(wrong))
        crc = checksum(tensors)
        if crc != meta.get("crc32"):
            raise RecordError(path, f"damaged: CRC-32 {crc} of its tensors, header says {meta.get('crc32')}")
        return tensors

    def read(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        """The record's tensors by layer name, checked (header, length, CRC).

        Raises:
            FileNotFoundError: no such record.
            RecordError: it is truncated, damaged or another store's record.
        """
        path = self._file(kind, key)
        tensors = self._verify(path, kind, key, path.read_bytes())
        tensors.pop(_TOKENS, None)
        return tensors

    def check(self, kind: str, key: str) -> bool:
        """Whether a valid record of ``kind`` and ``key`` is stored. A file that fails the checks of
        :meth:`read` is moved aside (logged with why), so that the tokens it held are computed and
        saved again; a file already found valid is not read again until it changes."""
        path = self._file(kind, key)
        try:
            st = path.stat()
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._checked.get(path) != stamp:
                self._verify(path, kind, key, path.read_bytes())
                self._checked[path] = stamp
            return True
        except FileNotFoundError:
            return False
        except RecordError as e:
            self.reject(e)
            return False

    def reject(self, error: RecordError) -> None:
        """Move the file of a record that failed its checks aside and log it (the file may be gone)."""
        self._checked.pop(error.path, None)
        aside = error.path.with_name(f"{error.path.name}.rejected-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(error.path, aside)
        except OSError:
            aside = error.path  # removed or replaced by another engine meanwhile
        logger.warning("kvarn: %s: rejected, its tokens are computed (file now %s)", error, aside.name)

    def write(
        self, kind: str, key: str, tensors: dict[str, torch.Tensor], header: dict[str, str] | None = None
    ) -> None:
        """Store a record, with its header (plus ``header``). It is written to a name of its own, then
        renamed: readers never see half a file, and engines writing the same record at once each
        rename a whole one.

        Raises:
            OSError: the folder cannot be made or written (the temporary file is removed).
        """
        self.path.mkdir(parents=True, exist_ok=True)
        path = self._file(kind, key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        meta = {**self.identity.header(), **(header or {}), "kind": kind, "key": key, "crc32": checksum(tensors)}
        try:
            save_file(tensors, str(tmp), metadata=meta)
            st = tmp.stat()
            self.bytes_written += st.st_size
            os.replace(tmp, path)
            self._checked[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except SafetensorError as e:  # safetensors reports I/O errors as its own
            raise OSError(f"writing {path}: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def tail_key(prefix: str, tokens: Sequence[int]) -> str:
        """The key of the tail rows of ``tokens`` after the tiles whose chain hash is ``prefix``."""
        return f"{prefix}-{token_hash(tokens)}"

    def write_tail(self, prefix: str, tokens: Sequence[int], rows: dict[str, torch.Tensor]) -> None:
        """Store the tail rows (``[len(tokens), H, row_bytes]`` uint8 per layer) of ``tokens`` after the
        tiles ``prefix``, with the tokens themselves (a later prompt may share only their first rows)."""
        self.write(
            "tail",
            self.tail_key(prefix, tokens),
            {**rows, _TOKENS: torch.tensor(list(tokens), dtype=torch.int64)},
            {"tokens": ",".join(map(str, tokens))},
        )

    def longest_tail(self, prefix: str, tokens: Sequence[int]) -> tuple[int, str]:
        """The most leading rows of ``tokens`` (after the tiles ``prefix``) that a valid stored tail
        holds, and that tail's key: ``(0, "")`` if none. A tail's row ``r`` depends on its tokens
        ``0 .. r`` only, so a tail of more rows serves any prefix of its tokens. Tails are ranked by
        the tokens in their headers; the best is then checked whole (:meth:`check`)."""
        found: list[tuple[int, str]] = []
        for path in sorted(self.path.glob(f"tail-{prefix}-*.safetensors")) if tokens else []:
            key = path.name[len("tail-") : -len(".safetensors")]
            try:
                stored = [int(t) for t in read_header(path).get("tokens", "").split(",") if t]
            except RecordError as e:
                self.reject(e)
                continue
            except (FileNotFoundError, ValueError):
                continue  # gone meanwhile, or a header another check rejects
            same = next((i for i, (a, b) in enumerate(zip(stored, tokens, strict=False)) if a != b), None)
            rows = min(len(stored), len(tokens)) if same is None else same
            if rows:
                found.append((rows, key))
        for rows, key in sorted(found, key=lambda f: -f[0]):
            if self.check("tail", key):
                return rows, key
        return 0, ""


_TOKENS = "tokens"  # a tail record's token ids (int64), beside its layers' rows: checked by the CRC
