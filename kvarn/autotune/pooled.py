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

from kvarn.autotune.budget import BudgetError
from kvarn.eval.harness import EvalResult, Evaluator
from kvarn.eval.metrics import MetricSums, nll
from kvarn.hf import FP16
from kvarn.hf.spec import BaselineLike
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


def measure(
    ev: Evaluator, scheme: str | Scheme | BaselineLike, max_tokens: int | None = None, progress: bool = False
) -> Measured:
    """``scheme`` on the first ``max_tokens`` (default all) tokens of ``ev``'s text, in decode mode,
    with the per-position differences kept (``sums.per_position``); the fp16 cache scores zero.
    ``progress``: a bar while the fp16 reference is computed (once per evaluator)."""
    spec = ev.check(scheme, max_tokens)
    n = ev.tokens if max_tokens is None else min(max_tokens, ev.tokens)
    ev.evaluate(FP16, greedy=False, progress=progress)  # computes and keeps the reference once
    ref = ev.reference()
    targets = ev.ids[0, 1:n]
    ref_nll = float(nll(ref[: n - 1], targets).double().sum())
    t0 = time.perf_counter()
    sums = MetricSums()
    if spec is None:
        sums.add(ref[: n - 1], ref[: n - 1], targets)
        return Measured(sums, ref_nll, 16.0, n, 0.0)
    cache = ev.new_cache(spec)
    for start, lp in ev.feed(cache, ev.ids[:, :n], _NoBar()):
        stop = min(n - 1, start + lp.shape[0])
        if stop > start:
            sums.add(ref[start:stop], lp[: stop - start], ev.ids[0, start + 1 : stop + 1])
    return Measured(sums, ref_nll, cache.bits_per_element(), n, time.perf_counter() - t0)


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

    Args:
        model: model alias or folder.
        texts: the documents' texts.
        tokens: tokens of each document (fewer if a document is shorter).
        chunk, device, dtype: as :class:`kvarn.eval.harness.Evaluator`.
    """

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
        parts = [measure(p, scheme, max_tokens, progress) for p in self.parts]
        return pool(scheme if isinstance(scheme, str) else scheme.name, parts, self.chunk)


def check_metric(metric: str) -> None:
    """Raises BudgetError for a greedy budget, which needs a single text."""
    if metric == "greedy":
        raise BudgetError("a greedy budget is measured on one text: pass --text FILE with it")
