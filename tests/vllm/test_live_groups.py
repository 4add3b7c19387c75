"""Bookkeeping over several KV-cache groups (issue 13): live blocks per group, vLLM's KV capacity.

A model with sliding-window layers is served with those layers on vLLM's own cache, in groups of
their own (often 32-token blocks, their own block ids); only the kvarn groups' blocks key the
staging and sink pools. No engine: stand-ins for the model runner and ``vllm.LLM``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def _runner(groups: list[tuple[int, list[str]]] | None, requests: dict[str, Any]) -> Any:
    from kvarn.vllm.backend import KvarnAttentionImpl

    kvarn = object.__new__(KvarnAttentionImpl)
    layers = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(impl=kvarn if i == 5 else object()) for i in range(6)}
    config = None
    if groups is not None:
        config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=b), layer_names=names) for b, names in groups
            ]
        )
    return SimpleNamespace(
        requests=requests,
        kv_cache_config=config,
        cache_config=SimpleNamespace(block_size=128),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def test_publish_reads_kvarn_groups_at_their_own_block_size() -> None:
    """Gemma-3-like: group 0 the five sliding layers (32-token blocks, blocks outside the window
    replaced by the null block 0), group 1 the kvarn layer (128-token tiles). A request whose kvarn
    blocks are [5, 6] has first block 5; its sliding blocks are no sink keys."""
    from kvarn.vllm import live
    from kvarn.vllm.context import EngineState

    state = EngineState(spec=None, vllm_config=None)  # type: ignore[arg-type]  # its live blocks only
    published = state.live

    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    req = SimpleNamespace(num_computed_tokens=150, block_ids=([0, 0, 0, 17, 18], [5, 6]))
    runner = _runner([(32, names[:5]), (128, names[5:])], {"a": req})
    live.publish(runner, SimpleNamespace(), state)
    assert live.kvarn_groups(runner, state) == [(1, 128, 128, 1)]
    assert published.first == {5}
    # one group (every layer full attention): the same as before
    runner = _runner([(128, names)], {"a": SimpleNamespace(num_computed_tokens=300, block_ids=([4, 9, 2],))})
    live.publish(runner, SimpleNamespace(), state)
    assert published.first == {4}
    # no KV cache yet: group 0 at the configured block size
    runner = _runner(None, {"a": SimpleNamespace(num_computed_tokens=10, block_ids=([7],))})
    live.publish(runner, SimpleNamespace(), state)
    assert published.first == {7}


def test_publish_names_kernel_blocks_of_a_hybrid_model() -> None:
    """A hybrid model's attention blocks hold several tiles (here 640 tokens = 5 tiles); vLLM hands
    kvarn kernel blocks of one tile, kernel block ``j`` of block ``b`` being ``b * stride + j``
    (stride 5, or vLLM's ``kernel_block_stride`` when pages of other layers sit between blocks).
    A request of blocks [3, 9] has first kernel block 3 x stride."""
    from kvarn.vllm import live
    from kvarn.vllm.context import EngineState

    state = EngineState(spec=None, vllm_config=None)  # type: ignore[arg-type]  # its live blocks only
    published = state.live

    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    for stride in (0, 7):
        req = SimpleNamespace(num_computed_tokens=900, block_ids=([3, 9],))
        runner = _runner([(640, names)], {"a": req})
        runner.attn_groups = [[SimpleNamespace(layer_names=names, kernel_block_size=128, kernel_block_stride=stride)]]
        live.publish(runner, SimpleNamespace(), state)
        assert live.kvarn_groups(runner, state) == [(0, 640, 128, stride or 5)]
        assert published.first == {3 * (stride or 5)}


def test_kv_tokens_is_vllms_group_aware_capacity_or_the_packed_tokens() -> None:
    """vLLM's own figure (``kv_cache_size_tokens``), not blocks x block size, which overstates the
    capacity when sliding-window groups draw on the same block pool; where vLLM's figure counts kvarn's
    tails (a kvarn model of full-attention layers only), blocks x block size: the packed tokens."""
    from kvarn.vllm.engine import kv_tokens, logged_kv_tokens

    def llm(dtype: str = "auto", skip: tuple[str, ...] = (), **cache: Any) -> Any:
        config = SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=dtype, kv_cache_dtype_skip_layers=list(skip), **cache),
            model_config=SimpleNamespace(is_hybrid=False),
        )
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))

    assert kv_tokens(llm(num_gpu_blocks=1000, block_size=128, kv_cache_size_tokens=40_000)) == 40_000
    assert kv_tokens(llm(num_gpu_blocks=1000, block_size=128, kv_cache_size_tokens=None)) == 128_000
    kvarn = llm("kvarn_k4v2_g128", num_gpu_blocks=1000, block_size=128, kv_cache_size_tokens=120_000)
    assert kv_tokens(kvarn) == 128_000 and logged_kv_tokens(kvarn) == 120_000
    windowed = llm("kvarn_k4v2_g128", ("sliding_window",), num_gpu_blocks=1000, block_size=128,
                   kv_cache_size_tokens=40_000)  # fmt: skip
    assert kv_tokens(windowed) == logged_kv_tokens(windowed) == 40_000
