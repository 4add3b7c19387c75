"""resolve_model(alias, dtype=...): the serving copy of the converted folder, the float32 one untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvarn.models import ALIASES, resolve_model

FOLDER = ALIASES["smollm2-135m"].folder


def _converted(cache: Path) -> Path:
    """A stand-in for the converted float32 folder (so no GGUF is read)."""
    folder = cache / "models" / FOLDER
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    (folder / "tokenizer.json").write_text("{}")
    w = torch.tensor([1.0, 1.0 + 2**-10, -3.14159], dtype=torch.float32)  # not all bfloat16-exact
    save_file({"model.w": w}, folder / "model.safetensors")
    return folder


def test_bfloat16_copy_says_bfloat16_and_the_float32_folder_is_unchanged(tmp_path: Path) -> None:
    src = _converted(tmp_path)
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    assert resolve_model("smollm2-135m", tmp_path) == resolve_model("smollm2-135m", tmp_path, "float32") == src
    cast = resolve_model("smollm2-135m", tmp_path, dtype="bfloat16")
    assert cast == src.with_name(f"{FOLDER}-bfloat16")
    assert json.loads((cast / "config.json").read_text())["dtype"] == "bfloat16"
    w = load_file(cast / "model.safetensors")["model.w"]
    ref = load_file(src / "model.safetensors")["model.w"]
    assert w.dtype == torch.bfloat16 and torch.equal(w, ref.to(torch.bfloat16))  # vLLM's own cast
    assert (cast / "tokenizer.json").read_text() == "{}"
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before
    assert not cast.with_name(cast.name + ".part").exists()
    (cast / "model.safetensors").unlink()  # a half-removed copy is made again
    assert resolve_model("smollm2-135m", tmp_path, dtype="bfloat16") == cast
    assert (cast / "model.safetensors").is_file()


def test_local_folder_is_returned_as_is_and_bad_dtype_fails(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), dtype="bfloat16") == tmp_path
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        resolve_model(str(tmp_path), dtype="int8")
