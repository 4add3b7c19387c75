"""Greedy completions of a vLLM engine and the rule by which two of them agree.

Where two runs compute a token with the same kernels, their greedy tokens must be *identical*.
Where one run computes it with the decode kernel and the other with the prefill kernel (a batch vs
alone, preempted and recomputed vs not, speculative verification vs decode) the two round float32
differently, and a bfloat16 model turns that into drift of the logprobs, so the tokens must be
identical or first differ at a near-tie: both runs rank the two tokens within :data:`NEAR_TIE`
nats of each other there, and every logprob before it agrees within :data:`MAX_DRIFT`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NEAR_TIE = 0.5  # a bfloat16 logit step is 0.125; measured gaps at a moved tie: docs/testing.md
MAX_DRIFT = 1.0  # below the nats a wrong tile, slot or sink read moves a logprob (docs/testing.md)
TOP = 5  # candidates returned per position, to see the gap at a difference


@dataclass(frozen=True)
class Greedy:
    """A greedy completion: its tokens and, per position, the top candidates' logprobs."""

    tokens: list[int]
    top: list[dict[int, float]]


def greedy(outputs: list[Any]) -> list[Greedy]:
    """The first completion of each of vLLM's ``RequestOutput``s (sampled with ``logprobs=TOP``)."""
    return [
        Greedy(list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
        for c in (o.outputs[0] for o in outputs)
    ]


def agree(a: Greedy, b: Greedy) -> str | None:
    """None when ``a`` and ``b`` are identical or first differ at a near-tie, else why not."""
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        if x == y:
            drift = abs(a.top[i][x] - b.top[i][y])
            if drift > MAX_DRIFT:
                return f"token {i} ({x}): logprobs {a.top[i][x]:.4f} vs {b.top[i][y]:.4f} drift > {MAX_DRIFT}"
            continue
        gaps = [run.top[i][x] - run.top[i][y] for run in (a, b) if x in run.top[i] and y in run.top[i]]
        if len(gaps) == 2 and all(abs(g) <= NEAR_TIE for g in gaps):
            return None
        return f"first differ at token {i}: {x} vs {y}, logprob gaps {gaps} (top {a.top[i]} / {b.top[i]})"
    return None


def first_difference(a: Greedy, b: Greedy) -> int | None:
    """The first position where the tokens differ, None when they are identical."""
    return next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), None)
