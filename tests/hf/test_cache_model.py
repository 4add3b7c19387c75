"""KVarNCache on the real SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), short contexts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kvarn.hf import KVarNCache
from kvarn.schemes import Scheme

LAYERS, KV_HEADS, D = 30, 3, 64


@pytest.fixture(scope="module")
def model_and_ids() -> tuple[Any, torch.Tensor]:
    from kvarn.eval.harness import _loaded, default_text

    model, tok = _loaded("smollm2-135m", torch.device("cpu"), torch.float32)  # shared with tests/eval
    return model, tok(default_text(), return_tensors="pt").input_ids[:, :256]


@torch.inference_mode()
def chunked_logits(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> torch.Tensor:
    outs = [
        model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True).logits
        for s in range(0, ids.shape[1], chunk)
    ]
    return torch.cat(outs, dim=1)


def test_fp16_cache_reproduces_the_plain_model(model_and_ids: tuple[Any, torch.Tensor]) -> None:
    model, ids = model_and_ids
    plain = chunked_logits(model, ids, DynamicCache(), 64)
    ours = chunked_logits(model, ids, KVarNCache("fp16", model.config), 64)
    assert torch.equal(plain, ours)  # bit for bit: the same tensors reach attention
    with torch.inference_mode():
        one_shot = model(ids).logits
    torch.testing.assert_close(ours, one_shot, atol=1e-4, rtol=1e-4)


def test_quantized_cache_changes_the_logits_and_generates(model_and_ids: tuple[Any, torch.Tensor]) -> None:
    model, ids = model_and_ids
    plain = chunked_logits(model, ids, KVarNCache("fp16", model.config), 64)
    quant = chunked_logits(model, ids, KVarNCache("kvarn_k4v4_g64", model.config), 64)
    assert torch.equal(plain[:, :64], quant[:, :64])  # the first chunk reads nothing quantized
    assert not torch.allclose(plain[:, 64:], quant[:, 64:], atol=1e-3)  # later chunks read tiles
    cache = KVarNCache("kvarn_k4v2_g64_sink0", model.config)
    out = model.generate(ids[:, :100], past_key_values=cache, max_new_tokens=30, do_sample=False)
    assert out.shape == (1, 130)
    length = cache.get_seq_length()
    assert length == 129
    tiles, tail = divmod(length, 64)
    s = Scheme.from_name("kvarn_k4v2_g64_sink0")
    expected_q = s.tile_bytes(D) * tiles * KV_HEADS * LAYERS
    expected_u = tail * KV_HEADS * D * 2 * 4 * LAYERS  # keys and values, float32
    assert cache.nbytes_breakdown()["quantized"] == expected_q
    assert cache.nbytes() == expected_q + expected_u
