"""One engine, one :class:`~kvarn.vllm.context.EngineState`: created by its first kvarn impl, found
through the engine's own layers, never through another engine's, never guessed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.vllm.context import EngineSpec, EngineState, current_config, engine_state  # noqa: E402

pytestmark = pytest.mark.vllm
NAME = "kvarn_k4v2_g128"


def _config(layers: dict[str, Any] | None = None) -> Any:
    """A stand-in engine configuration (what :meth:`EngineSpec.from_config` reads) with its layers."""
    model = SimpleNamespace(dtype=torch.float32, use_mla=False, is_hybrid=False, get_head_size=lambda: 64,
                            get_num_layers=lambda p: 2, get_num_kv_heads=lambda p: 3)  # fmt: skip
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=NAME, block_size=128, kv_cache_memory_bytes=None),
        model_config=model, parallel_config=None, speculative_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=4), device_config=SimpleNamespace(device="cpu"),
        compilation_config=SimpleNamespace(static_forward_context=dict(layers or {})),
    )  # fmt: skip


def test_the_first_impl_creates_the_state_and_the_others_find_it() -> None:
    config = _config({"model.layers.0.mlp": SimpleNamespace()})  # not an attention layer: no impl
    with pytest.raises(RuntimeError, match="no kvarn attention layer of this engine was built yet"):
        engine_state(config)  # a builder before any kvarn layer: refused, not a fresh orphan state
    first = engine_state(config, create=True)
    assert first.spec.scheme.name == NAME and first.spec.num_kv_heads == 3
    config.compilation_config.static_forward_context["model.layers.0.attn"] = SimpleNamespace(
        impl=SimpleNamespace(state=first)
    )
    assert engine_state(config) is first and engine_state(config, create=True) is first
    other = _config()  # another engine with the same settings: its own state
    assert engine_state(other, create=True) is not first


def test_reserve_counts_pools_against_an_explicit_kv_memory() -> None:
    config = _config()
    config.cache_config.kv_cache_memory_bytes = 1000
    state = EngineState.from_config(config)
    state.reserve(400)
    assert (config.cache_config.kv_cache_memory_bytes, state.pools.bytes, state.pools.layers) == (600, 400, 1)
    with pytest.raises(ValueError, match="more than the KV cache memory left"):
        state.reserve(600)


def test_the_spec_is_frozen_and_rebuilt_alike() -> None:
    a, b = EngineSpec.from_config(_config()), EngineSpec.from_config(_config())
    assert (a.scheme, a.slots, a.sink_capacity, a.tile_bytes) == (b.scheme, b.slots, b.sink_capacity, b.tile_bytes)
    with pytest.raises(AttributeError):
        a.slots = 1  # type: ignore[misc]


def test_no_engine_being_set_up_is_an_error_not_a_guess() -> None:
    from vllm.config import set_current_vllm_config

    with pytest.raises(RuntimeError, match="no kvarn engine is"):
        current_config()
    config = _config()
    with set_current_vllm_config(config):  # type: ignore[arg-type]
        assert current_config() is config
