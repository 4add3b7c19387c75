"""``kvarn eval --task drift``: how long free-running greedy text stays fp16's, and how far it drifts.

Each prompt (``prompt_tokens`` tokens of the evaluator's text from a line start; the prompts are
spread evenly over the text) goes through the cache in chunks, then ``tokens`` greedy tokens are
generated one at a time through the same cache (decode mode: they fill tiles too), whatever they
are (an end-of-sequence token does not stop it). Per prompt:

- divergence: the generated tokens identical to fp16's before the first that differs
  (``tokens`` if none does);
- KL: the mean over the generated positions of KL(fp16 || scheme) between the next-token
  distributions given the scheme's *own* text so far. fp16 reads that text through an exact cache
  (the prompt's, then the scheme's tokens in chunks), so the KL measures the cache, not the
  difference of two texts.

The fp16 row is fp16's own free run; its KL compares that run's one-token-at-a-time distributions
with the chunked reading of the same text (a check of the measurement: about 1e-9).

Example:
    >>> ev = Evaluator("smollm2-135m", tokens=10**6)
    >>> r = DriftTask(ev, prompts=1, tokens=64).evaluate("kvarn_k4v4_g128")
    >>> 0 <= r.divergence[0] <= 64
    True
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvarn.eval.harness import Evaluator, make_cache
from kvarn.eval.metrics import kl_per_position, leading_matches
from kvarn.eval.task import Task
from kvarn.hf import KVarNCache
from kvarn.hf.spec import BaselineLike, Spec
from kvarn.schemes import Scheme

DEFAULT_PROMPTS = 4
DEFAULT_PROMPT_TOKENS = 256
DEFAULT_TOKENS = 512


@dataclass
class DriftResult:
    """One scheme's free runs, one entry per prompt in ``divergence`` and ``kl``."""

    scheme: str
    bits_per_element: float  # after the last prompt and its generated tokens
    prompt_tokens: int
    tokens: int  # generated per prompt
    divergence: list[int]  # leading generated tokens identical to fp16's
    kl: list[float]  # mean KL(fp16 || scheme) along the scheme's own text, nats
    seconds: float

    @property
    def mean_divergence(self) -> float:
        return sum(self.divergence) / len(self.divergence)

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_divergence": self.mean_divergence, "mean_kl": self.mean_kl}


@dataclass
class _Reference:
    tokens: list[int]  # fp16's free run
    prompt_cache: KVarNCache  # fp16 cache after the prompt (copied before use)
    last: torch.Tensor  # [vocab] log-probs after the prompt
    kl: float  # fp16's run against its own chunked reading


def prompt_starts(ids: Sequence[int], newline: Sequence[bool], count: int, length: int) -> list[int]:
    """``count`` start positions spread evenly over ``ids``, each moved back to a line start
    (a token after one ending in a newline, or 0), each leaving ``length`` tokens.

    Raises:
        ValueError: the text is shorter than ``length``.
    """
    last = len(ids) - length
    if last < 0:
        raise ValueError(f"drift: the text has {len(ids)} tokens, fewer than --prompt-tokens {length}")
    out = []
    for i in range(count):
        p = round(i * last / max(count - 1, 1))
        while p > 0 and not newline[p - 1]:
            p -= 1
        out.append(p)
    return out


class DriftTask(Task[DriftResult]):
    """Free-running greedy generation from several prompts of an :class:`Evaluator`'s text.

    Args:
        ev: the evaluator (model, tokenizer, text, chunk, device); give it the whole text.
        prompts: how many prompts.
        prompt_tokens: tokens per prompt (a BOS token included when the evaluator prepends one).
        tokens: tokens generated from each.

    Raises:
        ValueError: fewer than 1 prompt, prompt or generated token; the text shorter than a
            prompt; prompt and generation beyond the model's context.
    """

    def __init__(
        self,
        ev: Evaluator,
        prompts: int = DEFAULT_PROMPTS,
        prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        tokens: int = DEFAULT_TOKENS,
    ) -> None:
        for what, v in (("prompts", prompts), ("prompt_tokens", prompt_tokens), ("tokens", tokens)):
            if v < 1:
                raise ValueError(f"drift: {what}={v}, must be at least 1")
        limit = getattr(ev.model.config, "max_position_embeddings", None)
        if limit is not None and prompt_tokens + tokens > limit:
            raise ValueError(
                f"drift: {prompt_tokens} prompt + {tokens} generated tokens exceed {ev.model_name}'s "
                f"context of {limit} tokens"
            )
        self.ev, self.prompt_tokens, self.tokens = ev, prompt_tokens, tokens
        text = ev.ids[0].tolist()
        prefix = text[:1] if ev.bos else []
        text = text[len(prefix) :]
        n = prompt_tokens - len(prefix)
        newline = [t.endswith("\n") for t in ev.tokenizer.batch_decode([[t] for t in text])]
        self.prompts = [torch.tensor([prefix + text[s : s + n]]) for s in prompt_starts(text, newline, prompts, n)]
        self._refs: list[_Reference] = []

    def _check(self, scheme: str | Scheme | BaselineLike) -> Spec:
        return self.ev.check(scheme, self.prompt_tokens + self.tokens, "Use more --prompt-tokens or --drift-tokens")

    def _steps(self, spec: Spec) -> int:
        """Progress-bar steps of ``spec``'s free runs (none for fp16) and fp16's (until they are kept):
        prompt chunks, generated tokens, fp16's reading."""
        runs = (0 if spec is None else 1) + (0 if self._refs else 1)
        c = self.ev.chunk
        return runs * len(self.prompts) * (-(-self.prompt_tokens // c) + self.tokens + -(-(self.tokens - 1) // c))

    def _prompt(self, cache: KVarNCache, prompt: torch.Tensor, bar: Any) -> torch.Tensor:
        """Feed ``prompt`` ``[1, n]`` in chunks; the ``[vocab]`` log-probs after it."""
        last = torch.empty(0)
        for _, lp in self.ev.feed(cache, prompt, bar, last_only=True):
            last = lp[-1]
        return last

    def _kl(self, ref: _Reference, tokens: list[int], logps: list[torch.Tensor], bar: Any) -> float:
        """Mean KL(fp16 || ``logps``) along ``tokens``: fp16 reads them after the prompt, chunked."""
        cache = copy.deepcopy(ref.prompt_cache)
        total = float(kl_per_position(ref.last[None], logps[0][None]).double().sum())
        ids = torch.tensor([tokens[:-1]])
        for start, lp in self.ev.feed(cache, ids, bar):
            own = torch.stack(logps[start + 1 : start + 1 + lp.shape[0]])
            total += float(kl_per_position(lp, own).double().sum())
        return total / len(tokens)

    def _reference(self, bar: Any) -> list[_Reference]:
        if not self._refs:
            for prompt in self.prompts:
                cache = make_cache(None, self.ev.model.config)
                last = self._prompt(cache, prompt, bar)
                snapshot = copy.deepcopy(cache)
                logps: list[torch.Tensor] = []
                tokens = self.ev.greedy(cache, last, self.tokens, bar, logps=logps)
                ref = _Reference(tokens, snapshot, last, 0.0)
                ref.kl = self._kl(ref, tokens, logps, bar)
                self._refs.append(ref)
        return self._refs

    def _measure(self, spec: Spec, name: str, bar: Any, t0: float) -> DriftResult:
        """Generate from every prompt through ``spec``'s cache and compare with fp16."""
        ev = self.ev
        refs = self._reference(bar)
        if spec is None:
            return DriftResult(
                name,
                16.0,
                self.prompt_tokens,
                self.tokens,
                [self.tokens] * len(refs),
                [r.kl for r in refs],
                time.perf_counter() - t0,
            )
        divergence, kls, bits = [], [], 16.0
        for prompt, ref in zip(self.prompts, refs, strict=True):
            cache = ev.new_cache(spec)
            logps: list[torch.Tensor] = []
            tokens = ev.greedy(cache, self._prompt(cache, prompt, bar), self.tokens, bar, logps=logps)
            bits = cache.bits_per_element()
            divergence.append(leading_matches(tokens, ref.tokens))
            kls.append(self._kl(ref, tokens, logps, bar))
        return DriftResult(name, bits, self.prompt_tokens, self.tokens, divergence, kls, time.perf_counter() - t0)
