"""KVarNCache inside small random models: every layer against the reference codec, masks, generate.

The Gemma-like model has five sliding-window layers (window 48) per full-attention layer at
head_dim 256 with one KV head; the Llama-like one is full attention only (GQA); the hybrid one has
Mamba2 layers between its attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kvarn.codec import dequantize_tiles
from kvarn.hf import KVarNCache
from kvarn.kernels.cpu import quantize_tiles_cpu
from kvarn.schemes import Scheme
from kvarn.testing.builders import other_sliding_models
from tests.models.conftest import WINDOW

SCHEME = "kvarn_k4v2_g32_sink0"  # reads compared with the codec alone: no exact first token (tests/hf covers it)
G = 32
SIZES = [40, 1, 30, 64, 1, 1, 50, 1]  # prefill, decode steps and chunks crossing tile and window edges


class RecordingCache(KVarNCache):
    """Records, per layer, every update's new keys/values and what the cache returned for it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kw: Any
    ) -> Any:
        offset = self.kv_layers[layer_idx].get_mask_sizes(key_states.shape[-2])[1]
        k, v = super().update(key_states, value_states, layer_idx, *args, **kw)
        self.log.setdefault(layer_idx, []).append((key_states, value_states, k, v, torch.tensor(offset)))
        return k, v


@torch.inference_mode()
def run(model: Any, cache: Any, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Feed ``ids`` in chunks of ``sizes``; return the logits ``[1, tokens, vocab]``."""
    out, start = [], 0
    for n in sizes:
        out.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, dim=1)


def ids_for(model: Any, n: int = sum(SIZES), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g)


def roundtrip(k: torch.Tensor, v: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's CPU encoder (the native store, within its tolerance of the reference codec:
    tests/kernels/test_cpu.py) over ``[B, H, n*G, D]``: each tile quantized and decoded on its own."""
    b, h, s, d = k.shape
    g = scheme.group_size
    rec = quantize_tiles_cpu(k.reshape(-1, g, d), v.reshape(-1, g, d), scheme)
    kd, vd = dequantize_tiles(rec, scheme, d, dtype=k.dtype)
    return kd.reshape(b, h, s, d), vd.reshape(b, h, s, d)


def expected(
    raw: torch.Tensor, stored: torch.Tensor, past: int, new: int, window: int | None, quantized: bool
) -> torch.Tensor:
    """What a layer must return for an update of ``new`` tokens after ``past`` ones.

    ``raw``: ``[B, H, tokens, D]`` keys (or values) fed so far; ``stored``: what the reference
    codec decodes its full tiles to. Committed tiles read as stored, everything else exact; a
    sliding layer starts at its offset (whole tiles when quantized).
    """
    keep_from = 0 if window is None else max(0, past - window + 1)
    committed = (past // G) * G if quantized else 0
    start = (keep_from // G) * G if quantized else keep_from
    tiles = stored[:, :, start:committed]
    return torch.cat([tiles, raw[:, :, max(start, committed) : past + new]], dim=-2)


@dataclass(frozen=True)
class Case:
    arch: str
    quantize_sliding: bool


CASES = [Case("gemma", False), Case("gemma", True), Case("llama", False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.arch}-{'qsliding' if c.quantize_sliding else 'exact'}")
def test_every_layer_reads_what_the_reference_codec_stores(case: Case, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(case.arch)
    cache = RecordingCache(SCHEME, model.config, quantize_sliding=case.quantize_sliding)
    run(model, cache, ids_for(model), SIZES)
    windows = cache.geometry.windows
    assert (None in windows) and (case.arch == "llama" or WINDOW in windows)
    for layer, log in cache.log.items():
        window = windows[layer]
        quantized = window is None or case.quantize_sliding
        raw_k = torch.cat([e[0] for e in log], dim=-2)
        raw_v = torch.cat([e[1] for e in log], dim=-2)
        full = (raw_k.shape[-2] // G) * G
        stored_k, stored_v = roundtrip(raw_k[:, :, :full], raw_v[:, :, :full], Scheme.from_name(SCHEME))
        past = 0
        for new_k, _, k, v, offset in log:
            new = new_k.shape[-2]
            # the same records dequantized in batches of other shapes may differ in float32's last bits
            # on some CPUs (measured 1.4e-5 on an AVX-512/AMX Xeon); a wrong tile or row is off by ~0.1
            close = {"rtol": 0.0, "atol": 1e-4, "msg": f"layer {layer}, past {past}"}
            torch.testing.assert_close(k, expected(raw_k, stored_k, past, new, window, quantized), **close)
            torch.testing.assert_close(v, expected(raw_v, stored_v, past, new, window, quantized), **close)
            keep_from = 0 if window is None else max(0, past - window + 1)
            assert int(offset) == ((keep_from // G) * G if quantized else keep_from)
            past += new
    layer = cache.kv_layers[-1]  # full attention: packed records of every full tile
    assert layer.committer is not None and layer.committer.records is not None
    assert layer.committer.records.shape[2] == sum(SIZES) // G


def test_fp16_cache_is_transformers_dynamic_cache(gemma: Any, llama: Any) -> None:
    for model in (gemma, llama):
        ids = ids_for(model)
        ours = run(model, KVarNCache("fp16", model.config), ids, SIZES)
        assert torch.equal(ours, run(model, DynamicCache(config=model.config), ids, SIZES))


def test_hybrid_model_quantizes_its_attention_layers_only(hybrid: Any) -> None:
    """GraniteMoeHybrid-like (Mamba2, attention, Mamba2, attention): the Mamba layers keep
    transformers' own ``LinearAttentionLayer`` (fp16 is bit-equal to ``DynamicCache(config=...)``),
    the two attention layers hold packed tiles, and bits count the attention layers only."""
    from transformers.cache_utils import LinearAttentionLayer

    ids = ids_for(hybrid)
    reference = run(hybrid, DynamicCache(config=hybrid.config), ids, SIZES)
    assert torch.equal(run(hybrid, KVarNCache("fp16", hybrid.config), ids, SIZES), reference)
    cache = KVarNCache(SCHEME, hybrid.config)
    logits = run(hybrid, cache, ids, SIZES)
    assert [type(layer) is LinearAttentionLayer for layer in cache.layers] == [True, False, True, False]
    assert cache.layer_types == ("full_attention", "full_attention") and len(cache.kv_layers) == 2
    tiles, tail = divmod(sum(SIZES), G)
    d = 64
    expected = (8 * tiles * Scheme.from_name(SCHEME).tile_bytes(d) + 16 * 2 * d * tail) / (2 * d * sum(SIZES))
    assert cache.bits_per_element() == pytest.approx(expected)
    assert set(cache.by_layer_type()) == {"full_attention", "all"}
    assert cache.kv_layers[0].committer.records.shape[2] == tiles  # type: ignore[union-attr]
    assert torch.isfinite(logits).all() and not torch.equal(logits, reference)  # quantized tiles were read


@dataclass(frozen=True)
class Identity:
    """A baseline that stores tokens unchanged in groups of 32: only the dropping differs from fp16."""

    name: str = "identity"
    commit_tokens: int = G
    window: int = 0

    def bits_per_element(self, head_dim: int) -> float:
        return 16.0

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


def test_tile_aligned_sliding_layers_line_up_with_the_mask(gemma: Any) -> None:
    """Sliding layers that drop whole groups hold more keys than the window; the mask must hide them."""
    ids = ids_for(gemma)
    cache = KVarNCache(Identity(), gemma.config, quantize_sliding=True)
    ours = run(gemma, cache, ids, SIZES)
    ref = run(gemma, DynamicCache(config=gemma.config), ids, SIZES)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    n = sum(SIZES)
    sliding = cache.kv_layers[0]
    assert sliding.is_sliding and sliding.held_tokens() == n - ((n - WINDOW + 1) // G) * G > WINDOW - 1


def test_generate_and_bytes_per_layer_type(gemma: Any) -> None:
    ids = ids_for(gemma, 40)
    kw: dict[str, Any] = {"max_new_tokens": 40, "do_sample": False}
    plain = gemma.generate(ids, **kw)  # transformers' own DynamicCache(config=...)
    assert torch.equal(gemma.generate(ids, past_key_values=KVarNCache("fp16", gemma.config), **kw), plain)
    for quantize_sliding in (False, True):
        cache = KVarNCache(SCHEME, gemma.config, quantize_sliding=quantize_sliding)
        out = gemma.generate(ids, past_key_values=cache, **kw)
        assert out.shape == (1, 80)
        n = cache.get_seq_length()
        assert n == 79
        s, d = Scheme.from_name(SCHEME), 256
        full_bytes = (n // G) * s.tile_bytes(d) + (n % G) * d * 2 * 4  # one KV head; float32 tail
        if quantize_sliding:
            start = ((n - WINDOW + 1) // G) * G
            slide_bytes = ((n // G) * G - start) // G * s.tile_bytes(d) + (n % G) * d * 2 * 4
        else:
            slide_bytes = (WINDOW - 1) * d * 2 * 4
        assert cache.nbytes() == full_bytes + 5 * slide_bytes
        by_type = cache.by_layer_type()
        assert by_type["full_attention"]["layers"] == 1 and by_type["sliding_attention"]["layers"] == 5
        assert by_type["all"]["context"] == n
        if not quantize_sliding:
            assert by_type["sliding_attention"]["bits_per_element"] == 16.0
            assert by_type["sliding_attention"]["held_tokens"] == 5 * (WINDOW - 1)
        assert by_type["full_attention"]["bits_per_element"] < 16.0
        total = sum(by_type[t]["bytes"] for t in ("full_attention", "sliding_attention"))
        assert by_type["all"]["bytes"] == pytest.approx(total)
        assert cache.bits_per_element() == pytest.approx(by_type["all"]["bits_per_element"])


@pytest.mark.parametrize("index", [0, 1], ids=["gemma2-alternating", "mistral-all-sliding"])
def test_other_sliding_layouts(index: int) -> None:
    model = other_sliding_models()[index]
    ids = ids_for(model, 150)
    sizes = [30] * 5
    ref = run(model, DynamicCache(config=model.config), ids, sizes)
    assert torch.equal(run(model, KVarNCache("fp16", model.config), ids, sizes), ref)
    torch.testing.assert_close(
        run(model, KVarNCache(Identity(), model.config, quantize_sliding=True), ids, sizes), ref, atol=1e-5, rtol=1e-5
    )
    cache = KVarNCache(SCHEME, model.config)
    run(model, cache, ids, sizes)
    types = cache.by_layer_type()
    assert types["sliding_attention"]["bits_per_element"] == 16.0
    assert ("full_attention" in types) == (index == 0)  # Mistral-like: nothing quantized by default
