"""A fake evaluator for the tuner's unit tests: same interface as ``kvarn.eval.harness.Evaluator``,
a deterministic synthetic metric (as an ``EvalResult``), no model. It tests the search machinery, not accuracy."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pytest

from kvarn.eval.harness import EvalResult
from kvarn.schemes import Scheme

NUM_LAYERS, HEAD_DIM = 30, 64
# Layers 0, 1 and 29 are the sensitive ones; the rest vary a little.
SENS = [0.012 + 0.004 * (i % 5) + (0.14 if i in (0, 1, 29) else 0.0) for i in range(NUM_LAYERS)]


class FakeEvaluator:
    """delta_ppl_pct = sum over quantized layers of SENS * bit/tile/scale factors (k4v2_g128 ~ +1.2%)."""

    def __init__(
        self, text: str, tokens: int = 1024, interrupt_after: int | None = None, ci_halfwidth: float | None = None
    ) -> None:
        self.text = text
        self.ci_halfwidth = ci_halfwidth  # relative half-width of a symmetric interval; None: no intervals
        self.tokens = tokens
        self.calls: list[tuple[str, int | None]] = []
        self.interrupt_after = interrupt_after
        # held-out text measures a little worse than calibration, deterministically
        self.text_factor = 1.0 + int(hashlib.sha256(text.encode()).hexdigest()[:2], 16) / 255 * 0.06

    def _layer_error(self, s: Scheme, sens: float) -> float:
        bits = 0.6 * 2.0 ** (4 - s.key_bits) + 0.4 * 2.0 ** (2 - s.value_bits)
        g = (s.group_size / 128) ** 0.3
        scale = 1.1 if s.scale_dtype == "log8" else 1.0
        rot = {"hadamard": 1.0, "rhadamard": 0.97, "none": 3.0}[s.rotation]
        it = 1.6 if s.norm_iters == 0 else 1.0 + 0.02 * abs(s.norm_iters - 8) / 8
        sink = 0.95 if s.sink_tile else (0.97 if s.sink_tokens else 1.0)
        return sens * bits * g * scale * rot * it * sink

    def evaluate(
        self, scheme: str | Scheme, *, greedy: bool = True, max_tokens: int | None = None, progress: bool = True
    ) -> EvalResult:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        s = Scheme.from_name(scheme) if isinstance(scheme, str) else scheme
        self.calls.append((s.name, max_tokens))
        err = 0.0
        for layer in range(NUM_LAYERS):
            ls = s.for_layer(layer)
            if ls is not None:
                err += self._layer_error(ls, SENS[layer])
        n = self.tokens if max_tokens is None else min(max_tokens, self.tokens)
        delta = err * 1.15 * self.text_factor * (1.1 if max_tokens else 1.0)
        w = self.ci_halfwidth
        return EvalResult(
            scheme=s.name,
            bits_per_element=s.bits_per_element(HEAD_DIM, NUM_LAYERS),
            ppl=20.0 * (1 + delta / 100),
            delta_ppl_pct=delta,
            kl=delta / 100,
            top1_agreement=1.0 - delta / 50,
            greedy_agreement_tokens=int(256 / (1.0 + delta)) if greedy else None,
            tokens=n,
            seconds=0.0,
            delta_ppl_pct_ci=None if w is None else [delta * (1 - w), delta * (1 + w)],
            kl_ci=None if w is None else [delta / 100 * (1 - w), delta / 100 * (1 + w)],
        )


class FakeFactory:
    """The texts of one part -> a FakeEvaluator of them joined, remembering every evaluator it made."""

    def __init__(self, interrupt_after: int | None = None, ci_halfwidth: float | None = None) -> None:
        self.made: list[FakeEvaluator] = []
        self.interrupt_after = interrupt_after
        self.ci_halfwidth = ci_halfwidth

    def __call__(self, texts: Sequence[str]) -> FakeEvaluator:
        ev = FakeEvaluator(
            "\n\n".join(texts),
            interrupt_after=self.interrupt_after if not self.made else None,
            ci_halfwidth=self.ci_halfwidth,
        )
        self.made.append(ev)
        return ev


@pytest.fixture
def fake_factory() -> FakeFactory:
    return FakeFactory()


def sample_text() -> str:
    para = "This is a paragraph of calibration text with several words in it.\n"
    return "\n".join(f"{i} {para * 3}" for i in range(40))


@pytest.fixture
def text() -> str:
    return sample_text()


def dims() -> tuple[int, int]:
    return NUM_LAYERS, HEAD_DIM


def any_kwargs(**kw: Any) -> dict[str, Any]:
    return kw
