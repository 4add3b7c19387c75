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
    replaced by the null block 0), group 1 the kvarn layer (128-token tiles). A request that computed
    150 tokens fills kvarn block 6 (tile 1); its sliding blocks are no staging keys."""
    from kvarn.vllm import live
    from kvarn.vllm.staging import LIVE_BLOCKS

    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    req = SimpleNamespace(num_computed_tokens=150, block_ids=([0, 0, 0, 17, 18], [5, 6]))
    runner = _runner([(32, names[:5]), (128, names[5:])], {"a": req})
    live.publish(runner, SimpleNamespace())
    assert live.kvarn_groups(runner) == [(1, 128)]
    assert LIVE_BLOCKS["blocks"] == {6} and LIVE_BLOCKS["first"] == {5}
    # one group (every layer full attention): the same as before
    runner = _runner([(128, names)], {"a": SimpleNamespace(num_computed_tokens=300, block_ids=([4, 9, 2],))})
    live.publish(runner, SimpleNamespace())
    assert LIVE_BLOCKS["blocks"] == {2} and LIVE_BLOCKS["first"] == {4}
    # no KV cache yet: group 0 at the configured block size
    runner = _runner(None, {"a": SimpleNamespace(num_computed_tokens=10, block_ids=([7],))})
    live.publish(runner, SimpleNamespace())
    assert LIVE_BLOCKS["blocks"] == {7} and LIVE_BLOCKS["first"] == {7}


def test_kv_tokens_is_vllms_group_aware_capacity() -> None:
    """vLLM's own figure (``kv_cache_size_tokens``), not blocks x block size, which overstates the
    capacity when sliding-window groups draw on the same block pool."""
    from kvarn.vllm.engine import kv_tokens

    def llm(**cache: Any) -> Any:
        return SimpleNamespace(
            llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(**cache)))
        )

    assert kv_tokens(llm(num_gpu_blocks=1000, block_size=128, kv_cache_size_tokens=40_000)) == 40_000
    assert kv_tokens(llm(num_gpu_blocks=1000, block_size=128, kv_cache_size_tokens=None)) == 128_000
