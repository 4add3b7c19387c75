"""A fingerprint of a model's weights, so that KV records saved by one model are not read by another
under the same path (a folder whose weights were replaced, a re-download of another revision).

It hashes the model folder's ``config.json`` and, for each weight file (``*.safetensors``, ``*.bin``,
``*.pt``, ``*.gguf``, or the model file itself): its name and size, its safetensors header (every
tensor's name, dtype, shape and offsets) and :data:`SAMPLES` evenly spaced runs of
:data:`SAMPLE_BYTES` of its bytes. A few megabytes are read, whatever the model's size; a change of
any shape, of a file's length or of the sampled bytes changes it. Weights changed only between the
samples, at the same length, go unseen: the fingerprint is a guard against the operator's mistakes,
not a hash of every byte.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

logger = logging.getLogger("kvarn.vllm")

SAMPLES = 16  # runs of bytes read from each weight file
SAMPLE_BYTES = 1 << 16  # bytes per run
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
_MAX_HEADER = 1 << 26  # a safetensors header longer than this is sampled, not read whole


def _files(model: str, revision: str | None) -> list[Path]:
    """The config and weight files of ``model`` on this machine (a folder, a file, or a name in the
    Hugging Face cache); empty when none is found."""
    path = Path(model)
    if path.is_file():
        return [path]
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure to find a local copy means: none found
            return []
    weights = sorted({f for pattern in WEIGHTS for f in path.glob(pattern) if f.is_file()})
    return [f for f in (path / "config.json",) if f.is_file()] + weights


def _hash_file(h: hashlib._Hash, f: Path) -> None:
    size = f.stat().st_size
    h.update(f"{f.name}\0{size}\0".encode())
    with f.open("rb") as fh:
        if f.name == "config.json":
            h.update(fh.read())
            return
        if f.suffix == ".safetensors":
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, _MAX_HEADER)))
        for i in range(SAMPLES):
            fh.seek(max(0, size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1))
            h.update(fh.read(SAMPLE_BYTES))


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """16 hex digits that change when ``model``'s config or weights change (module docstring).

    A model whose files are not on this machine is fingerprinted by its name and revision alone (logged).
    """
    h = hashlib.sha256()
    files = _files(model, revision)
    if not files:
        logger.warning("kvarn: no local files of model %r to fingerprint; its KV records are keyed by name only", model)
        h.update(f"{model}\0{revision}".encode())
    for f in files:
        _hash_file(h, f)
    return h.hexdigest()[:16]
