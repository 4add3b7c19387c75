"""Sliding-window layers of KVarNCache on synthetic keys/values, and the layer geometry of configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen3NextConfig,
)
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvarn.codec import dequantize_tiles
from kvarn.hf import KVarNCache, KVarNLayer, TileCommitter, cache_geometry
from kvarn.kernels.cpu import quantize_tiles_cpu
from kvarn.schemes import Scheme

from ._baselines import HalfGrid

B, H = 1, 2
SIZES = [5, 30, 1, 1, 70, 1, 40, 1]


def kv(s: int, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, s, d, generator=g), torch.randn(B, H, s, d, generator=g)


def gemma(window: int = 40, layers: int = 6, head_dim: int = 64) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=H, head_dim=head_dim, sliding_window=window,
    )  # fmt: skip


@pytest.mark.parametrize("window", [2, 7, 40])  # not 1: transformers keeps everything then ([-0:])
def test_exact_sliding_layer_is_transformers_sliding_layer(window: int) -> None:
    ours, theirs = KVarNLayer(None, sliding_window=window), DynamicSlidingWindowLayer(window)
    k, v = kv(sum(SIZES))
    start = 0
    for n in SIZES:
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n)
        a = ours.update(k[:, :, start : start + n], v[:, :, start : start + n])
        b = theirs.update(k[:, :, start : start + n], v[:, :, start : start + n])
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        start += n
        assert ours.get_seq_length() == theirs.get_seq_length() == start
        assert ours.held_tokens() == theirs.keys.shape[-2]
    assert ours.get_max_length() == theirs.get_max_length() == window and ours.is_sliding


def test_quantized_sliding_layer_drops_whole_tiles_behind_the_window() -> None:
    scheme, window, g = Scheme.from_name("kvarn_k4v2_g32"), 40, 32
    cache = KVarNCache(scheme, gemma(window), quantize_sliding=True)
    k, v = kv(sum(SIZES), seed=1)
    start = 0
    for n in SIZES:
        k_all, v_all = cache.update(k[:, :, start : start + n], v[:, :, start : start + n], 0)
        start += n
    layer = cache.kv_layers[0]
    first = ((start - window + 1) // g) * g  # tiles that still hold a token the next query reads
    assert layer.offset == first and layer.get_mask_sizes(1) == (start - first + 1, first)
    assert isinstance(layer.committer, TileCommitter) and layer.committer.records is not None
    tiles = start // g - first // g
    assert layer.committer.records.shape[2] == tiles
    rec = quantize_tiles_cpu(  # the committer's CPU encoder
        k[:, :, first : first + tiles * g].reshape(-1, g, 64),
        v[:, :, first : first + tiles * g].reshape(-1, g, 64),
        scheme,
    )
    assert torch.equal(layer.committer.records.reshape(-1, rec.shape[-1]), rec)  # the same bytes as the encoder's
    kd, _ = dequantize_tiles(rec, scheme, 64)
    assert torch.equal(layer.done_k, kd.reshape(B, H, tiles * g, 64))
    tail = start - (start // g) * g
    assert cache.nbytes_breakdown()["quantized"] == B * H * tiles * scheme.tile_bytes(64)  # only layer 0 was fed
    assert cache.nbytes_breakdown()["unquantized"] == B * H * tail * 64 * 2 * 4


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_full_layers_store_codec_records_at_every_head_dim(head_dim: int) -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_sink0")
    cache = KVarNCache(scheme, gemma(head_dim=head_dim))
    k, v = kv(130, head_dim, seed=2)
    cache.update(k[:, :, :100], v[:, :, :100], 5)  # layer 5: full attention
    k_all, v_all = cache.update(k[:, :, 100:], v[:, :, 100:], 5)
    rec = quantize_tiles_cpu(k[:, :, :128].reshape(-1, 64, head_dim), v[:, :, :128].reshape(-1, 64, head_dim), scheme)
    kd, vd = dequantize_tiles(rec, scheme, head_dim)
    assert torch.equal(k_all[:, :, :64], kd.reshape(B, H, 128, head_dim)[:, :, :64])  # committed before the 2nd update
    assert torch.equal(k_all[:, :, 64:], k[:, :, 64:])
    records = cache.kv_layers[5].committer.records  # type: ignore[union-attr]
    assert records is not None and torch.equal(records.reshape(-1, rec.shape[-1]), rec)
    assert cache.by_layer_type()["full_attention"]["bits_per_element"] < 16


def test_geometry_follows_transformers() -> None:
    g = cache_geometry(gemma(window=512, layers=12, head_dim=256))
    assert g.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert g.windows[0] == 512 and g.windows[5] is None and g.head_dim == 256 and g.num_kv_heads == H
    mistral = cache_geometry(MistralConfig(num_hidden_layers=2, sliding_window=64))
    assert mistral.layer_types == ("sliding_attention",) * 2  # every layer windowed, as transformers builds it
    assert cache_geometry(LlamaConfig(num_hidden_layers=3)).count("full_attention") == 3


def test_bits_formula_by_layer_type() -> None:
    s = Scheme.from_name("kvarn_k4v2_g128_sink1")
    full_only = cache_geometry(LlamaConfig(num_hidden_layers=4, head_dim=128, num_attention_heads=2, hidden_size=256))
    assert full_only.bits_per_element(s, 2048) == pytest.approx(s.bits_per_element(128, 4, 2048))
    g = cache_geometry(gemma(window=512, layers=6, head_dim=256))
    full, ctx = s.bits_per_element(256, context=4096), 4096
    assert g.bits_per_element(s, ctx) == pytest.approx((5 * 512 * 16 + ctx * full) / (5 * 512 + ctx))
    tiles = Scheme.from_name("kvarn_k4v2_g128").bits_per_element(256)  # sliding tiles carry no sink
    mixed = (5 * 512 * tiles + ctx * full) / (5 * 512 + ctx)
    assert g.bits_per_element(s, ctx, quantize_sliding=True) == pytest.approx(mixed)
    assert g.bits_per_element(None, ctx) == 16.0
    with pytest.raises(ValueError, match="context=0"):
        g.bits_per_element(s, 0)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="keeps its 40 newest tokens unquantized, not fewer than the window"):
        KVarNCache(HalfGrid(name="windowed", commit_tokens=8, window=40), gemma(window=40), quantize_sliding=True)
    KVarNCache(
        HalfGrid(name="windowed", commit_tokens=8, window=40), gemma(window=40)
    )  # exact sliding layers: nothing to commit there
    with pytest.raises(ValueError, match="keeps no sink"):
        KVarNLayer(None, sink_tokens=4, sliding_window=8)
    base = dict(num_hidden_layers=2, num_attention_heads=2, head_dim=64, hidden_size=128)
    with pytest.raises(ValueError, match="sliding_window of at least 1"):
        cache_geometry(SimpleNamespace(**base, layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match=r"\(kv_heads, head_dim\) \[\(8, 256\), \(8, 512\)\]"):
        cache_geometry(Gemma4TextConfig(num_hidden_layers=6, num_key_value_heads=8))  # full layers: head_dim 512
    with pytest.raises(ValueError, match="latent attention"):
        cache_geometry(DeepseekV3Config(num_hidden_layers=2))
    hybrid = cache_geometry(Qwen3NextConfig(num_hidden_layers=4))  # hybrid: recurrent layers hold no tokens
    assert hybrid.attention_layers == (3,) and hybrid.held_tokens(0, 1000) == 0 and hybrid.held_tokens(3, 1000) == 1000
