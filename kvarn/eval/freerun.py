"""``kvarn eval --task freerun``: the text users see, generated freely through the quantized cache.

Every other accuracy figure is teacher-forced (the next-token distributions on a given text). Here
each shipped prompt (:data:`PROMPTS_FILE`: prose, code and chat, a few sentences or code lines
each) is continued for ``tokens`` tokens twice: greedily, and sampled (temperature
:data:`TEMPERATURE`, top-p :data:`TOP_P`, seed :data:`SEED`). The sampler takes the ``u``-quantile of the
top-p distribution, ``u`` the next of the prompt's own seeded uniform numbers, so every scheme (and
every batch holding the prompt) gets the same random numbers and a sampled run leaves fp16's only
where the distributions differ. Per prompt and mode:

- repetition: the share of the generated tokens' 4-grams that repeat an earlier one (:func:`repetition`);
- distinct-2: distinct 2-grams over all 2-grams (:func:`distinct`);
- divergence: generated tokens identical to fp16's before the first that differs (``tokens`` if none);
- ppl: the perplexity of the generated tokens under the model with an unquantized cache.

Each is reported as its mean over prompts with a 95% percentile-bootstrap interval over prompts
(:func:`mean_interval`, fixed seed); the repetition also as a ratio to fp16's on the same prompts,
with a paired interval (:func:`ratio_interval`).

Decode mode, batched without padding: all prompts and both modes are one batch of ``2 x prompts``
rows. The shortest prompt's length is fed in chunks; from there on every row takes one token per
forward pass, its prompt's next token while it has one, else the token it generates, so every row
has the same length at every step and every generated token goes through the cache one at a time.
A row that has generated ``tokens`` tokens runs on until the longest prompt's row has; what it
generates then is dropped.

Example:
    >>> ev = Evaluator("smollm2-135m", tokens=10**6)
    >>> r = FreerunTask(ev, prompts=3, tokens=32).evaluate("fp16")
    >>> r.scores["greedy"]["divergence"]
    [32.0, 32.0, 32.0]
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch

from kvarn.eval.bos import tokenize
from kvarn.eval.harness import Evaluator
from kvarn.eval.metrics import block_bootstrap_means, interval, leading_matches
from kvarn.eval.task import Task
from kvarn.hf.spec import BaselineLike, Spec
from kvarn.schemes import Scheme

PROMPTS_FILE = "freerun_prompts.json"
KINDS = ("prose", "code", "chat")
MODES = ("greedy", "sampled")
METRICS = ("repetition", "distinct2", "divergence", "ppl")
DEFAULT_TOKENS = 256
TEMPERATURE, TOP_P, SEED = 0.8, 0.95, 0
CONFIDENCE = 0.95
NUCLEUS_FIRST = 1024  # only these most likely tokens are sorted when they hold every row's nucleus
SCORE_BYTES = 2**28  # float32 logits held at once while scoring


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    text: str
    index: int  # in the shipped file: its sampled run's random numbers are seeded with SEED + index


def load_prompts(kinds: Sequence[str] | None = None, count: int | None = None) -> list[Prompt]:
    """The shipped prompts of ``kinds`` (default all), the kinds taken in turn (so the first six hold
    two of each), the first ``count`` of them (default all).

    Raises:
        ValueError: an unknown kind, or ``count`` below 1 or beyond the prompts of those kinds.
    """
    kinds = list(KINDS if kinds is None else kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"freerun: unknown prompt kinds {bad}; the kinds are {', '.join(KINDS)}")
    rows = json.loads(resources.files("kvarn").joinpath("data", PROMPTS_FILE).read_text(encoding="utf-8"))
    shipped = [Prompt(r["kind"], r["text"], i) for i, r in enumerate(rows)]
    by_kind = [[p for p in shipped if p.kind == k] for k in dict.fromkeys(kinds)]
    out = [p for i in range(max(map(len, by_kind))) for ps in by_kind for p in ps[i : i + 1]]
    if count is not None and not 1 <= count <= len(out):
        raise ValueError(f"freerun: {count} prompts asked for; {len(out)} of kinds {','.join(kinds)} are shipped")
    return out[:count]


def _ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    if len(tokens) < n:
        raise ValueError(f"{len(tokens)} tokens hold no {n}-gram")
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repetition(tokens: Sequence[int], n: int = 4) -> float:
    """The share of ``tokens``' ``n``-grams that repeat an earlier one: 0 without repeats, near 1 for a loop.

    >>> repetition([1, 2, 3, 1, 2, 3, 1, 2, 3], n=2)  # 8 2-grams, 3 distinct
    0.625
    """
    grams = _ngrams(tokens, n)
    return 1.0 - len(set(grams)) / len(grams)


def distinct(tokens: Sequence[int], n: int = 2) -> float:
    """Distinct ``n``-grams over all ``n``-grams of ``tokens``."""
    grams = _ngrams(tokens, n)
    return len(set(grams)) / len(grams)


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` (one per prompt) and its percentile-bootstrap
    interval over prompts (:func:`kvarn.eval.metrics.block_bootstrap_means` with blocks of one, fixed seed)."""
    v = torch.tensor(values, dtype=torch.float64)[:, None]
    lo, hi = interval(block_bootstrap_means(v, 1)[:, 0], confidence)
    return float(v.mean()), lo, hi


def ratio_interval(
    values: Sequence[float], ref: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """``(ratio, low, high)``: ``mean(values) / mean(ref)`` over the same prompts and its paired
    percentile-bootstrap interval (each draw takes the same prompts from both)."""
    v = torch.tensor([list(values), list(ref)], dtype=torch.float64).T  # [prompts, 2]
    draws = block_bootstrap_means(v, 1)
    lo, hi = interval(draws[:, 0] / draws[:, 1], confidence)
    return float(v[:, 0].mean() / v[:, 1].mean()), lo, hi


def top_p_sample(
    logits: torch.Tensor, u: torch.Tensor, temperature: float = TEMPERATURE, top_p: float = TOP_P
) -> torch.Tensor:
    """One token per row ``[R]`` int64 from ``logits`` ``[R, V]``: the ``u`` ``[R]`` (uniform in
    [0, 1)) quantile of the smallest set of most likely tokens holding ``top_p`` of the
    probability at ``temperature``, ordered most likely first."""
    probs = (logits.float() / temperature).softmax(-1)
    p, idx = probs.topk(min(NUCLEUS_FIRST, probs.shape[1]), -1)  # the nucleus, unless it is larger
    if bool((p.sum(-1) < top_p).any()):
        p, idx = probs.sort(-1, descending=True)
    p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0.0)
    c = p.cumsum(-1)
    k = torch.searchsorted(c, (u.to(c) * c[:, -1])[:, None], right=True).clamp(max=p.shape[1] - 1)
    return idx.gather(1, k)[:, 0]


@dataclass
class FreerunResult:
    """One scheme's free runs: ``scores[mode][metric]`` and ``texts[mode]`` hold one entry per prompt."""

    scheme: str
    bits_per_element: float  # after the generation
    tokens: int  # generated per prompt and mode
    kinds: list[str]  # each prompt's kind
    temperature: float
    top_p: float
    seed: int
    scores: dict[str, dict[str, list[float]]]
    texts: dict[str, list[str]]
    seconds: float

    def summary(self, mode: str, metric: str) -> tuple[float, float, float]:
        """``(mean, low, high)`` of a score over prompts (:func:`mean_interval`)."""
        return mean_interval(self.scores[mode][metric])

    def against(self, ref: FreerunResult, mode: str, metric: str = "repetition") -> tuple[float, float, float]:
        """``(ratio, low, high)`` of a score's mean to ``ref``'s on the same prompts (:func:`ratio_interval`)."""
        return ratio_interval(self.scores[mode][metric], ref.scores[mode][metric])

    def to_dict(self) -> dict[str, Any]:
        means = {f"{m}_{k}": list(self.summary(m, k)) for m in MODES for k in METRICS}
        return {**asdict(self), "mean_low_high": means}


class FreerunTask(Task[FreerunResult]):
    """Greedy and sampled free runs from the shipped prompts, scored against fp16's.

    Args:
        ev: the evaluator (model, tokenizer, chunk, device; its text is not used).
        prompts: how many prompts (default all of ``kinds``; see :func:`load_prompts`).
        tokens: tokens generated per prompt and mode.
        kinds: prompt kinds (default all of :data:`KINDS`).

    Raises:
        ValueError: fewer than 4 tokens; unknown kinds or too many prompts; the longest prompt and
            its generation beyond the model's context.
    """

    def __init__(
        self,
        ev: Evaluator,
        prompts: int | None = None,
        tokens: int = DEFAULT_TOKENS,
        kinds: Sequence[str] | None = None,
    ) -> None:
        if tokens < 4:
            raise ValueError(f"freerun: tokens={tokens}, must be at least 4 (repetition counts 4-grams)")
        self.ev, self.tokens = ev, tokens
        self.prompts = load_prompts(kinds, prompts)
        bos = "yes" if ev.bos else "no"
        ids = [tokenize(ev.tokenizer, p.text, bos)[0][0].tolist() for p in self.prompts]
        self.lens = torch.tensor([len(i) for i in ids] * len(MODES))  # [R]: rows greedy, then sampled
        self.lo, self.hi = int(self.lens.min()), int(self.lens.max())
        limit = getattr(ev.model.config, "max_position_embeddings", None)
        if limit is not None and self.hi + tokens > limit:
            raise ValueError(f"freerun: {self.hi} + {tokens} tokens exceed {ev.model_name}'s context of {limit}")
        self.ids = torch.tensor([i + [0] * (self.hi - len(i)) for i in ids] * len(MODES))  # [R, hi] int64
        seeds = [torch.Generator().manual_seed(SEED + p.index) for p in self.prompts]
        self.noise = torch.stack([torch.rand(tokens, generator=g) for g in seeds])  # [prompts, tokens]
        self._ref: list[list[int]] | None = None  # fp16's generated tokens per row

    def _check(self, scheme: str | Scheme | BaselineLike) -> Spec:
        return self.ev.check(scheme, self.lo + self.tokens, "Use more --freerun-tokens")

    def _score_rows(self) -> int:
        return max(1, SCORE_BYTES // (4 * (self.hi + self.tokens) * int(self.ev.model.config.vocab_size)))

    def _steps(self, spec: Spec) -> int:
        """Progress-bar steps: prompt chunks and decode steps of each free run (fp16's until it is
        kept, then ``spec``'s unless fp16), then the scoring batches."""
        runs = (0 if spec is None else 1) + (0 if self._ref else 1)
        run = -(-self.lo // self.ev.chunk) + self.hi - self.lo + self.tokens
        return runs * run + -(-len(self.ids) // self._score_rows())

    @torch.inference_mode()
    def _generate(self, spec: Spec, bar: Any) -> tuple[list[list[int]], float]:
        """Every row's ``tokens`` generated tokens through ``spec``'s cache, and its bits/element."""
        ev, model = self.ev, self.ev.model
        cache = ev.new_cache(spec)
        logits = torch.empty(0)
        for pos in range(0, self.lo, ev.chunk):
            x = self.ids[:, pos : min(self.lo, pos + ev.chunk)].to(ev.device)
            logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            bar.update(1)
        rows = len(self.ids)
        sampled = torch.arange(rows) >= rows // len(MODES)
        gen = torch.zeros(rows, self.tokens, dtype=torch.long)
        for t in range(self.lo, self.hi + self.tokens):  # logits: every row's distribution of token t
            lg = logits.float().cpu()
            step = t - self.lens  # [R] index of the generated token (negative: still the prompt)
            u = self.noise.gather(1, step[sampled].clamp(0, self.tokens - 1)[:, None])[:, 0]
            choice = lg.argmax(-1)
            choice[sampled] = top_p_sample(lg[sampled], u)
            keep = (step >= 0) & (step < self.tokens)
            gen[keep, step[keep]] = choice[keep]
            nxt = torch.where(step < 0, self.ids[:, min(t, self.hi - 1)], choice)
            bar.update(1)
            if t + 1 < self.hi + self.tokens:
                logits = model(input_ids=nxt[:, None].to(ev.device), past_key_values=cache, use_cache=True).logits[
                    :, -1
                ]
        bits = 16.0 if spec is None else cache.bits_per_element()
        return gen.tolist(), bits

    @torch.inference_mode()
    def _ppl(self, gen: list[list[int]], bar: Any) -> list[float]:
        """Each row's perplexity of its generated tokens under the model with an unquantized cache;
        rows right-padded into batches (causal attention never reads the padding)."""
        ev, n = self.ev, self.tokens
        seqs = torch.cat([self.ids, torch.zeros(len(gen), n, dtype=torch.long)], dim=1)  # [R, hi + n]
        for r, g in enumerate(gen):
            seqs[r, int(self.lens[r]) : int(self.lens[r]) + n] = torch.tensor(g)
        out: list[float] = []
        step = self._score_rows()
        for r0 in range(0, len(gen), step):
            lp = ev.model(input_ids=seqs[r0 : r0 + step].to(ev.device)).logits.float().log_softmax(-1).cpu()
            for j in range(lp.shape[0]):
                s = int(self.lens[r0 + j])
                nll = -lp[j, s - 1 : s - 1 + n].gather(1, seqs[r0 + j, s : s + n, None])
                out.append(float(nll.double().mean().exp()))
            bar.update(1)
        return out

    def _measure(self, spec: Spec, name: str, bar: Any, t0: float) -> FreerunResult:
        """Generate through ``spec``'s cache, score, and compare with fp16's run."""
        if self._ref is None:
            self._ref, _ = self._generate(None, bar)
        gen, bits = (self._ref, 16.0) if spec is None else self._generate(spec, bar)
        ppl = self._ppl(gen, bar)
        p = len(self.prompts)
        scores: dict[str, dict[str, list[float]]] = {}
        texts: dict[str, list[str]] = {}
        for m, mode in enumerate(MODES):
            rows = range(m * p, (m + 1) * p)
            scores[mode] = {
                "repetition": [repetition(gen[r]) for r in rows],
                "distinct2": [distinct(gen[r]) for r in rows],
                "divergence": [float(leading_matches(gen[r], self._ref[r])) for r in rows],
                "ppl": [ppl[r] for r in rows],
            }
            texts[mode] = list(self.ev.tokenizer.batch_decode([gen[r] for r in rows]))
        return FreerunResult(
            name,
            bits,
            self.tokens,
            [q.kind for q in self.prompts],
            TEMPERATURE,
            TOP_P,
            SEED,
            scores,
            texts,
            time.perf_counter() - t0,
        )
