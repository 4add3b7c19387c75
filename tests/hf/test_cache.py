"""KVarNCache on synthetic keys/values and a tiny random Llama: storage, read-back, bytes, errors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvarn.codec import dequantize_tiles
from kvarn.hf import KVarNCache, KVarNLayer, TileCommitter
from kvarn.kernels.cpu import quantize_tiles_cpu
from kvarn.schemes import Scheme, SchemeError, UnknownSchemeError

from ._baselines import HalfGrid

B, H, D = 2, 2, 64


def tiny_config(layers: int = 2, head_dim: int = D) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=2 * head_dim,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1 if head_dim == D and layers > 2 else H,
        head_dim=head_dim,
        num_hidden_layers=layers,
        vocab_size=97,
        max_position_embeddings=512,
    )


def feed(cache: KVarNCache, k: torch.Tensor, v: torch.Tensor, sizes: list[int], layer: int = 0) -> list[Any]:
    """Feed ``[B, H, S, D]`` keys/values in chunks of ``sizes``; return what each update returned."""
    out, start = [], 0
    for n in sizes:
        out.append(cache.update(k[:, :, start : start + n], v[:, :, start : start + n], layer))
        start += n
    return out


def roundtrip_tiles(x_k: torch.Tensor, x_v: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache must read: ``[B, H, n*G, D]`` quantized as tiles by the committer's CPU encoder
    (the native store; its tolerance against the reference codec: tests/kernels/test_cpu.py) and
    decoded, same shape."""
    b, h, s, d = x_k.shape
    rec = quantize_tiles_cpu(x_k.reshape(-1, scheme.group_size, d), x_v.reshape(-1, scheme.group_size, d), scheme)
    k, v = dequantize_tiles(rec, scheme, d)
    return k.reshape(b, h, s, d), v.reshape(b, h, s, d)


def kv(s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, s, D, generator=g), torch.randn(B, H, s, D, generator=g) * 3


def test_full_tiles_are_packed_records_and_read_back_from_them() -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_sink0")
    cache = KVarNCache(scheme, tiny_config())
    k, v = kv(141)
    outs = feed(cache, k, v, [50, 30, 60, 1])
    layer = cache.kv_layers[0]
    assert isinstance(layer.committer, TileCommitter)
    records = layer.committer.records
    assert records is not None and records.dtype == torch.uint8
    assert list(records.shape) == [B, H, 2, scheme.tile_bytes(D)]
    ref_k, ref_v = roundtrip_tiles(k[:, :, :128], v[:, :, :128], scheme)
    k_all, v_all = outs[-1]
    assert torch.equal(k_all[:, :, :128], ref_k) and torch.equal(v_all[:, :, :128], ref_v)
    assert torch.equal(k_all[:, :, 128:], k[:, :, 128:141]) and torch.equal(v_all[:, :, 128:], v[:, :, 128:141])
    # what the records decode to, record by record, is what attention read
    dk, _ = dequantize_tiles(records.reshape(-1, records.shape[-1]), scheme, D)
    assert torch.equal(dk.reshape(B, H, 128, D), k_all[:, :, :128])
    # the update that completed tile 1 read its own new tokens unquantized, the older ones as stored
    k3, _ = outs[2]
    assert torch.equal(k3[:, :, :64], ref_k[:, :, :64])
    assert torch.equal(k3[:, :, 64:], k[:, :, 64:140])
    assert cache.get_seq_length(0) == 141


def test_quantize_before_read_reads_own_tile_quantized() -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_sink0")
    cache = KVarNCache(scheme, tiny_config(), quantize_before_read=True)
    k, v = kv(128, seed=1)
    (k_all, _), (k2, _) = feed(cache, k, v, [60, 68])
    ref_k, _ = roundtrip_tiles(k, v, scheme)
    assert torch.equal(k_all, k[:, :, :60])  # nothing committed yet
    assert torch.equal(k2, ref_k)


def test_nbytes_equals_the_scheme_formula() -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_sink0")
    cache = KVarNCache(scheme, tiny_config(layers=3))
    for layer in range(3):
        k, v = kv(150, seed=layer)
        feed(cache, k, v, [100, 50], layer)
    tail = 150 - 128
    b = cache.nbytes_breakdown()
    assert b["quantized"] == scheme.tile_bytes(D) * 2 * B * H * 3
    assert b["unquantized"] == tail * B * H * D * 2 * 4 * 3  # keys and values, float32
    assert cache.nbytes() == b["quantized"] + b["unquantized"]
    bits = (8 * b["quantized"] + 16 * tail * B * H * D * 2 * 3) / (150 * B * H * D * 2 * 3)
    assert cache.bits_per_element() == pytest.approx(bits)
    assert KVarNCache(scheme, tiny_config()).nbytes() == 0


def test_sink_tile_stays_unquantized() -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_sink")
    cache = KVarNCache(scheme, tiny_config())
    k, v = kv(201, seed=2)
    (k_all, v_all) = feed(cache, k, v, [200, 1])[-1]
    ref_k, ref_v = roundtrip_tiles(k[:, :, 64:192], v[:, :, 64:192], scheme)
    assert torch.equal(k_all[:, :, :64], k[:, :, :64])
    assert torch.equal(k_all[:, :, 64:192], ref_k) and torch.equal(v_all[:, :, 64:192], ref_v)
    assert torch.equal(k_all[:, :, 192:], k[:, :, 192:])
    layer = cache.kv_layers[0]
    assert layer.committer is not None and layer.committer.records is not None
    assert layer.committer.records.shape[2] == 2
    assert cache.nbytes() == 2 * B * H * scheme.tile_bytes(D) + (64 + 9) * B * H * D * 2 * 4


@pytest.mark.parametrize("sizes", [[3, 100, 40, 1], [1, 1, 1, 200, 1], [143, 1]])
def test_sink_tokens_are_read_exactly_inside_packed_tile_zero(sizes: list[int]) -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_sink2")
    cache = KVarNCache(scheme, tiny_config())
    k, v = kv(sum(sizes), seed=3)
    (k_all, v_all) = feed(cache, k, v, sizes)[-1]
    ref_k, ref_v = roundtrip_tiles(k[:, :, :128], v[:, :, :128], scheme)  # tile 0 packed with its sink tokens
    assert torch.equal(k_all[:, :, :2], k[:, :, :2]) and torch.equal(v_all[:, :, :2], v[:, :, :2])
    assert torch.equal(k_all[:, :, 2:128], ref_k[:, :, 2:]) and torch.equal(v_all[:, :, 2:128], ref_v[:, :, 2:])
    assert not torch.equal(ref_v[:, :, :2], v[:, :, :2])  # without the copies tile 0 reads differently
    layer = cache.kv_layers[0]
    assert layer.committer is not None and layer.committer.records is not None
    tiles = sum(sizes) // 64
    assert layer.committer.records.shape[2] == tiles  # the same records as without sink tokens
    tail = sum(sizes) - 64 * tiles
    copies = 2 * B * H * D * 2  # two tokens, keys and values
    assert cache.nbytes_breakdown()["copy_elements"] == copies  # only layer 0 was fed
    assert cache.nbytes() == tiles * B * H * scheme.tile_bytes(D) + (tail * B * H * D * 2 + copies) * 4


def test_sink_tokens_before_tile_zero_fills_read_the_tail_once() -> None:
    cache = KVarNCache("kvarn_k4v2_g64_sink4", tiny_config())
    k, v = kv(40, seed=4)
    (k_all, v_all) = feed(cache, k, v, [2, 38])[-1]
    assert k_all.shape[2] == 40 and torch.equal(k_all, k) and torch.equal(v_all, v)


def test_per_layer_overrides() -> None:
    scheme = Scheme.from_name("kvarn_k4v2_g64_L0fp16_L2k4v4")
    cache = KVarNCache(scheme, tiny_config(layers=3))
    for layer in range(3):
        k, v = kv(64, seed=layer)
        k_all, _ = feed(cache, k, v, [64, 1], layer)[-1]
        if layer == 0:
            assert torch.equal(k_all[:, :, :64], k)  # unquantized layer
        else:
            assert not torch.equal(k_all[:, :, :64], k)
    layers = cache.kv_layers
    assert layers[0].committer is None
    assert isinstance(layers[2].committer, TileCommitter) and layers[2].committer.scheme.value_bits == 4
    k4v2, k4v4 = Scheme(4, 2, 64).tile_bytes(D), Scheme(4, 4, 64).tile_bytes(D)
    assert cache.nbytes_breakdown()["quantized"] == B * H * (k4v2 + k4v4)


def test_baseline_commits_oldest_groups_outside_the_window() -> None:
    cache = KVarNCache(HalfGrid(), tiny_config())
    k, v = kv(31, seed=3)
    k_all, v_all = feed(cache, k, v, [7, 7, 7, 7, 2, 1])[-1]
    committed = (30 - 8) // 4 * 4  # 20 tokens committed before the last update, 10 in the tail
    assert torch.equal(k_all[:, :, :committed], torch.round(k[:, :, :committed] * 2) / 2)
    assert torch.equal(v_all[:, :, :committed], torch.round(v[:, :, :committed] * 2) / 2)
    assert torch.equal(k_all[:, :, committed:], k[:, :, committed:])
    layer: KVarNLayer = cache.kv_layers[0]
    assert layer.tail_k.shape[2] == 31 - committed
    b = cache.nbytes_breakdown()
    assert b["quantized"] == round(20 * B * H * D * 2 * 5 / 8)
    assert b["unquantized"] == 11 * B * H * D * 2 * 4


def test_fp16_generate_matches_dynamic_cache_and_quantized_generate_runs() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(layers=2)).eval()
    ids = torch.randint(0, 97, (1, 20))
    kw: dict[str, Any] = {"max_new_tokens": 30, "do_sample": False}
    a = model.generate(ids, past_key_values=DynamicCache(), **kw)
    b = model.generate(ids, past_key_values=KVarNCache("fp16", model.config), **kw)
    assert torch.equal(a, b)
    cache = KVarNCache("kvarn_k4v2_g32_sink0", model.config)
    c = model.generate(ids, past_key_values=cache, **kw)
    assert c.shape == (1, 50)
    length = 49  # the last generated token is never fed back
    assert cache.get_seq_length() == length
    s = Scheme.from_name("kvarn_k4v2_g32_sink0")
    heads = model.config.num_key_value_heads
    layers, tiles, tail = 2, length // 32, length % 32
    assert cache.nbytes() == layers * heads * (tiles * s.tile_bytes(D) + tail * D * 2 * 4)


def test_errors_name_the_problem() -> None:
    with pytest.raises(UnknownSchemeError) as e:
        KVarNCache("kvarn_k5v2_g128", tiny_config())
    assert "fp16" in str(e.value) and "kvarn_k4v2_g128" in str(e.value)
    with pytest.raises(SchemeError, match="head_dim"):
        KVarNCache("kvarn_k4v2_g128", tiny_config(head_dim=32))
    hybrid = SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    hybrid.hidden_size, hybrid.layer_types = 128, ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="linear_attention, conv .*; this model also has chunked_attention"):
        KVarNCache("kvarn_k4v2_g128", hybrid)
    hybrid.layer_types = ["linear_attention", "conv"]
    with pytest.raises(ValueError, match="no attention layer"):
        KVarNCache("kvarn_k4v2_g128", hybrid)
    cache = KVarNCache("kvarn_k4v2_g128", tiny_config())
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))
