"""A prefix-cache hit never reads tile 0 without its exact first rows (``kvarn/vllm/lost_sinks.py``).

A running server sees more sequences than it has sink slots (``max_num_seqs``), so the slot of a
sequence that ended is reclaimed while its first block may still sit in vLLM's prefix cache. A later
request with the same first tokens must then compute them, not read that block as a hit: its greedy
tokens equal those it got when it was computed first. One engine (vLLM's default worker process,
as ``vllm serve`` runs it), float32, two sink slots: the check prompt, the same prompt again (a hit
on its surviving slot), six other prompts (each takes a slot), the check prompt once more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm.engines import ENGINE_DTYPE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_prefix_whose_sink_rows_were_reclaimed_is_computed_again() -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from kvarn.models import resolve_model
    from kvarn.testing.greedy import TOP, greedy
    from kvarn.vllm.engine import cpu_engine

    model = str(resolve_model("smollm2-135m"))
    text = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids: list[int] = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    check, others = ids[:300], [ids[1000 + 400 * i : 1200 + 400 * i] for i in range(6)]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=TOP)
    with cpu_engine(model, "kvarn_k4v2_g128", dtype=ENGINE_DTYPE, max_num_seqs=2, enable_prefix_caching=True) as llm:

        def serve(prompt: list[int]) -> tuple[list[int], int]:
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            return greedy([out])[0].tokens, int(out.num_cached_tokens or 0)

        first, _ = serve(check)
        hit, cached = serve(check)
        for prompt in others:
            serve(prompt)
        again, recomputed = serve(check)
    assert cached == 256 and hit == first  # its slot survives: a hit on both tiles
    assert recomputed == 0, "the reclaimed sequence's first block was served as a prefix-cache hit"
    assert again == first
