"""Greedy completions of a vLLM engine and the rule by which two of them agree.

Where two runs compute a token with the same kernels, their greedy tokens must be *identical*.
Where one run computes it with the decode kernel and the other with the prefill kernel (a batch vs
alone, preempted and recomputed vs not, speculative verification vs decode) the two round float32
differently, and a bfloat16 model turns that into drift of the logprobs, so the tokens must be
identical or first differ at a near-tie: both runs rank the two tokens within :data:`NEAR_TIE`
nats of each other there, and every logprob before it agrees within :data:`MAX_DRIFT`.

Where the logits' magnitudes are known, a bfloat16 run is held to a bound derived from bfloat16's
precision instead (:func:`bf16_tolerance`, docs/reliability.md): a bfloat16 value ``z`` lies on a
grid of step ``2^(floor(log2|z|) - 7)`` (8 significant bits), at most ``|z| / 128``. vLLM computes
the logits in the model's dtype and a logprob from them in float32, ``lp_t = z_t - logsumexp(z)``.
Two runs of one request that differ only in summation order (another chunking, batch, worker count,
a speculative verification) round some sum the other way, and that reaches each logit as at most
:data:`ROUNDINGS` of its steps. A logprob then moves by at most ``ROUNDINGS`` steps of ``z_t`` plus
``ROUNDINGS`` steps of the logits that carry the probability (``logsumexp`` moves by their
probability-weighted mean): ``|d lp| <= 2 * ROUNDINGS * Z / 128``, ``Z`` the largest ``|z|`` among
them. Where the greedy tokens first differ, ``x`` in one run and ``y`` in the other, the gap
``z_x - z_y`` changed sign, moving by at most the same bound, so the two runs' gaps sum within it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NEAR_TIE = 0.5  # each of the two gaps: half of bf16_tolerance(32), SmolLM2's largest logits (docs/reliability.md)
MAX_DRIFT = 1.0  # below the nats a wrong tile, slot or sink read moves a logprob (docs/testing.md)
TOP = 5  # candidates returned per position, to see the gap at a difference
BF16_STEP = 1 / 128  # bfloat16 keeps 8 significant bits: values near z are at most |z| * 2^-7 apart
ROUNDINGS = 2  # bfloat16 steps a logit moves between two summation orders (docs/reliability.md)


def bf16_tolerance(scale: float) -> float:
    """The most a logprob of a bfloat16 model moves between two runs of one request that differ only
    in summation order, and the most the two runs' gaps between two tokens sum to where their greedy
    tokens first differ: ``2 * ROUNDINGS * scale / 128``, ``scale`` the largest ``|z|`` of the logits
    that carry the probability at that position (float32, :func:`kvarn.testing.logits.forced`;
    ``|z| / 128``, not the step itself, covers a bfloat16 logit a little larger than float32's).

    Example:
        >>> bf16_tolerance(20.0)
        0.625
    """
    return 2 * ROUNDINGS * scale * BF16_STEP


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


def drifts(a: Greedy, b: Greedy) -> list[float]:
    """Per position while the tokens agree, ``|lp_a - lp_b|`` of the token; where they first differ
    (the list's last entry), the two runs' gaps between the two tokens summed (``inf`` where a run's
    top candidates lack one of them)."""
    out = []
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        if x == y:
            out.append(abs(a.top[i][x] - b.top[i][y]))
            continue
        gaps = [run.top[i][x] - run.top[i][y] for run in (a, b) if x in run.top[i] and y in run.top[i]]
        out.append(sum(map(abs, gaps)) if len(gaps) == 2 else math.inf)
        break
    return out


def agree(a: Greedy, b: Greedy, tolerance: Sequence[float] | None = None) -> str | None:
    """None when ``a`` and ``b`` are identical or first differ at a near-tie, else why not.

    ``tolerance``: per position, the bound of both the logprob drift and the summed gaps at the first
    difference (:func:`bf16_tolerance`, :func:`drifts`); without it every drift within
    :data:`MAX_DRIFT` and each gap within :data:`NEAR_TIE`."""
    if tolerance is not None:
        over = [(i, d, t) for i, (d, t) in enumerate(zip(drifts(a, b), tolerance, strict=False)) if d > t]
        if not over:
            return None
        i, d, t = over[0]
        what = "drift" if a.tokens[i] == b.tokens[i] else f"gaps summed ({a.tokens[i]} vs {b.tokens[i]})"
        return f"token {i}: {what} {d:.4f} > {t:.4f} (top {a.top[i]} / {b.top[i]})"
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
