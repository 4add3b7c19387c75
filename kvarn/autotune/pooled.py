"""One measurement over several documents: the decode-mode harness on each, positions pooled.

Each document is fed from its own beginning through its own cache (as separate requests on a
server), and every scored position of every document goes into one
:class:`~kvarn.eval.metrics.MetricSums`. Means (perplexity increase, KL, top-1) are over all
positions, and the 90% interval is the same chunk bootstrap the single-text harness uses, over the
pooled chunks, so a kind of text that is harder than the others widens it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvarn.autotune.budget import BudgetError
from kvarn.eval.harness import EvalResult, Evaluator
from kvarn.eval.metrics import MetricSums, nll
from kvarn.hf import FP16, KVarNCache
from kvarn.hf.spec import BaselineLike, Spec
from kvarn.schemes import Scheme


@dataclass
class Measured:
    """One scheme on one document: its metric sums, fp16 negative log-likelihood sum and bits."""

    sums: MetricSums
    ref_nll: float
    bits: float
    tokens: int
    seconds: float


class _NoBar:
    """The progress bar :meth:`Evaluator.feed` updates, shown nowhere."""

    def update(self, n: int = 1) -> None:
        pass


def quiet_prefix(spec: Spec, chunk: int) -> int:
    """Tokens at the start of a sequence fed in chunks that read nothing quantized (0 for a
    baseline or fp16): decode mode reads a tile quantized only from the chunk after the one that
    filled it, so these chunks compute exactly what the fp16 cache computes."""
    if not isinstance(spec, Scheme):
        return 0
    first_tile_end = spec.group_size * (2 if spec.sink_tile else 1)
    return -(-first_tile_end // chunk) * chunk


@dataclass
class _Progress:
    """A measurement stopped after a prefix, kept so a longer one continues it (successive halving)."""

    cache: KVarNCache
    sums: MetricSums
    fed: int  # tokens fed through ``cache``
    last: torch.Tensor  # [vocab] log-probs at position ``fed - 1``, not scored yet
    seconds: float


class Replay:
    """The fp16 keys and values of a text's first chunks, replayed into a new cache in place of
    running the model over chunks that read nothing quantized (:func:`quiet_prefix`).

    Only for caches of attention layers whose window holds a whole chunk (a recurrent layer's state
    cannot be replayed): :meth:`usable` says whether ``ev``'s model is one.
    """

    def __init__(self, ev: Evaluator) -> None:
        self.ev = ev
        self.chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # [chunk][layer] (k, v) [1, H, L, D]

    def usable(self) -> bool:
        cache = self.ev.new_cache(None)
        windows = [w for w in cache.geometry.windows if w is not None]
        return len(cache.kv_layers) == len(cache.layers) and all(w > self.ev.chunk for w in windows)

    def _extend(self, chunks: int) -> None:
        if len(self.chunks) >= chunks:
            return
        ev = self.ev
        cache = ev.new_cache(None)
        self.chunks = []
        for start, _ in ev.feed(cache, ev.ids[:, : chunks * ev.chunk], _NoBar(), last_only=True):
            new = min(ev.chunk, ev.tokens - start)
            self.chunks.append(
                [(x.tail_k[:, :, -new:].clone(), x.tail_v[:, :, -new:].clone()) for x in cache.kv_layers]
            )

    def cache(self, spec: Spec, tokens: int) -> KVarNCache:
        """A new cache for ``spec`` that holds the text's first ``tokens`` (a multiple of the chunk)
        as if they had been fed chunk by chunk."""
        chunks = tokens // self.ev.chunk
        self._extend(chunks)
        cache = self.ev.new_cache(spec)
        for kv in self.chunks[:chunks]:
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
        return cache


def measure(
    ev: Evaluator,
    scheme: str | Scheme | BaselineLike,
    max_tokens: int | None = None,
    progress: bool = False,
    replay: Replay | None = None,
    resume: _Progress | None = None,
) -> tuple[Measured, _Progress | None]:
    """``scheme`` on the first ``max_tokens`` (default all) tokens of ``ev``'s text, in decode mode,
    with the per-position differences kept (``sums.per_position``); the fp16 cache scores zero.

    ``progress``: a bar while the fp16 reference is computed (once per evaluator). ``replay``:
    the chunks that read nothing quantized are replayed from fp16 and scored as fp16 (which they
    equal), not run. ``resume``: a shorter measurement of the same scheme to continue from. Also
    returns where this one stopped, to continue it in turn (None for fp16 or the whole text).
    """
    spec = ev.check(scheme, max_tokens)
    n = ev.tokens if max_tokens is None else min(max_tokens, ev.tokens)
    ev.evaluate(FP16, greedy=False, progress=progress)  # computes and keeps the reference once
    ref = ev.reference()
    targets = ev.ids[0, 1:n]
    ref_nll = float(nll(ref[: n - 1], targets).double().sum())
    t0 = time.perf_counter()
    if spec is None:
        sums = MetricSums()
        sums.add(ref[: n - 1], ref[: n - 1], targets)
        return Measured(sums, ref_nll, 16.0, n, 0.0), None
    resume = resume if resume is not None and resume.fed <= n else None
    if resume is not None:
        cache, sums, fed, spent = resume.cache, resume.sums, resume.fed, resume.seconds
        if fed < n:  # the prefix's last position is scored once its target is in the text
            sums.add(ref[fed - 1 : fed], resume.last[None], ev.ids[0, fed : fed + 1])
    else:
        sums, spent = MetricSums(), 0.0
        fed = min(quiet_prefix(spec, ev.chunk), n - 1) if replay is not None else 0
        fed -= fed % ev.chunk
        cache = replay.cache(spec, fed) if replay is not None and fed else ev.new_cache(spec)
        for start in range(0, fed, ev.chunk):  # chunk by chunk, as the fed chunks would add
            sums.add(
                ref[start : start + ev.chunk],
                ref[start : start + ev.chunk],
                ev.ids[0, start + 1 : start + ev.chunk + 1],
            )
    last = resume.last if resume is not None else torch.empty(0)
    for start, lp in ev.feed(cache, ev.ids[:, :n], _NoBar(), start=fed):
        stop = min(n - 1, start + lp.shape[0])
        if stop > start:
            sums.add(ref[start:stop], lp[: stop - start], ev.ids[0, start + 1 : stop + 1])
        last = lp[-1]
    seconds = spent + time.perf_counter() - t0
    done = Measured(sums, ref_nll, cache.bits_per_element(), n, seconds)
    if n >= ev.tokens or n % ev.chunk:
        return done, None
    return done, _Progress(cache, copy_sums(sums), n, last, seconds)


def copy_sums(s: MetricSums) -> MetricSums:
    """A copy of ``s`` that a continued measurement can add to without changing ``s``."""
    return MetricSums(s.nll, s.kl, s.top1, s.count, list(s.per_position))


def pool(name: str, parts: Sequence[Measured], block: int) -> EvalResult:
    """The pooled result of one scheme measured on several documents (chunks of ``block`` positions
    for the interval)."""
    sums = MetricSums()
    ref_nll = 0.0
    for m in parts:
        sums.nll += m.sums.nll
        sums.kl += m.sums.kl
        sums.top1 += m.sums.top1
        sums.count += m.sums.count
        sums.per_position += m.sums.per_position
        ref_nll += m.ref_nll
    ppl_ci, kl_ci = sums.intervals(block=block)
    return EvalResult(
        scheme=name,
        bits_per_element=max(m.bits for m in parts),
        ppl=sums.ppl,
        delta_ppl_pct=100.0 * math.expm1((sums.nll - ref_nll) / sums.count),
        kl=sums.mean_kl,
        top1_agreement=sums.top1_agreement,
        greedy_agreement_tokens=None,
        tokens=sum(m.tokens for m in parts),
        seconds=sum(m.seconds for m in parts),
        delta_ppl_pct_ci=list(ppl_ci),
        kl_ci=list(kl_ci),
    )


class PooledEvaluator:
    """The tuner's evaluator over several documents (``EvaluatorLike``): ``tokens`` of each.

    Two shortcuts, neither of which changes a measurement: the chunks at the start of a document
    that read nothing quantized are replayed from the fp16 pass and scored as fp16
    (:class:`Replay`); and a scheme measured on a prefix (``max_tokens``) is continued, not
    restarted, when it is next measured on more tokens (:attr:`resumes`), so a prefix that decides
    nothing costs nothing extra.

    Args:
        model: model alias or folder.
        texts: the documents' texts.
        tokens: tokens of each document (fewer if a document is shorter).
        chunk, device, dtype: as :class:`kvarn.eval.harness.Evaluator`.
    """

    resumes = True  # a prefix measurement followed by a longer one costs the longer one alone

    def __init__(
        self,
        model: str,
        texts: Sequence[str],
        tokens: int,
        chunk: int = 128,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        if not texts:
            raise ValueError("a pooled evaluation needs at least one document")
        self.parts = [
            Evaluator(model, text=t, tokens=tokens, chunk=chunk, greedy_tokens=0, device=device, dtype=dtype)
            for t in texts
        ]
        self.model = self.parts[0].model
        self.chunk = chunk
        self.tokens = sum(p.tokens for p in self.parts)
        replays = [Replay(p) for p in self.parts]
        self.replays: list[Replay | None] = [r if r.usable() else None for r in replays]
        self._pending: tuple[str, list[_Progress | None]] | None = None  # the last prefix measured

    def evaluate(
        self,
        scheme: str | Scheme | BaselineLike,
        *,
        greedy: bool = True,
        max_tokens: int | None = None,
        progress: bool = True,
    ) -> EvalResult:
        """``scheme`` on every document (its first ``max_tokens`` tokens each), pooled.

        ``greedy`` is ignored: greedy agreement is one continuation of one text, which pooling has
        no meaning for (a greedy budget tunes on one ``--text``).
        """
        del greedy
        for p in self.parts:
            p.check(scheme, max_tokens)
        name = scheme if isinstance(scheme, str) else scheme.name
        pending = self._pending[1] if self._pending is not None and self._pending[0] == name else None
        self._pending = None
        parts, kept = [], []
        for i, p in enumerate(self.parts):
            resume = pending[i] if pending is not None else None
            m, left = measure(p, scheme, max_tokens, progress, self.replays[i], resume)
            parts.append(m)
            kept.append(left)
        if any(k is not None for k in kept):
            self._pending = (name, kept)
        return pool(name, parts, self.chunk)


def check_metric(metric: str) -> None:
    """Raises BudgetError for a greedy budget, which needs a single text."""
    if metric == "greedy":
        raise BudgetError("a greedy budget is measured on one text: pass --text FILE with it")
