"""What measuring several schemes shares: every scheme checked first (a typo fails fast), then each
measured in turn, its result handed on as soon as it is known (so a long run keeps what it measured).

:func:`evaluate_each` is that loop, for :meth:`kvarn.eval.harness.Evaluator.evaluate_all` and for
:class:`Task`, the base of :class:`~kvarn.eval.needle.NeedleTask` and :class:`~kvarn.eval.drift.DriftTask`.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm

from kvarn.hf.spec import BaselineLike, Spec
from kvarn.schemes import Scheme

R = TypeVar("R")


def progress_bar(desc: str, total: int, progress: bool) -> Any:
    """The bar of one measurement: ``total`` steps named ``desc``, shown when ``progress``."""
    return tqdm(total=total, desc=desc, unit="step", disable=not progress, leave=False)


def evaluate_each(
    schemes: Sequence[str | Scheme | BaselineLike],
    check: Callable[[str | Scheme | BaselineLike], Spec],
    evaluate: Callable[[str | Scheme | BaselineLike], R],
    *,
    progress: bool,
    on_result: Callable[[R], None] | None,
) -> list[R]:
    """``check`` every scheme, then ``evaluate`` each in turn (a ``schemes`` progress bar when there
    are several and ``progress``), calling ``on_result`` after each; returns the results in order.

    Raises:
        whatever ``check`` raises, before anything is measured.
    """
    for s in schemes:
        check(s)
    results = []
    for s in tqdm(schemes, desc="schemes", unit="scheme", disable=not progress or len(schemes) < 2):
        results.append(evaluate(s))
        if on_result is not None:
            on_result(results[-1])
    return results


class Task(ABC, Generic[R]):
    """A measurement of schemes on an :class:`~kvarn.eval.harness.Evaluator`'s model and text, one
    ``R`` per scheme: a subclass says which schemes it can measure, how many progress-bar steps one
    takes, and measures one. A subclass holds its evaluator as ``ev``."""

    @abstractmethod
    def _check(self, scheme: str | Scheme | BaselineLike) -> Spec:
        """Resolve ``scheme`` and check that the task can measure it (see ``Evaluator.check``)."""

    @abstractmethod
    def _steps(self, spec: Spec) -> int:
        """Progress-bar steps of measuring ``spec``."""

    @abstractmethod
    def _measure(self, spec: Spec, name: str, bar: Any, t0: float) -> R:
        """Measure the checked ``spec`` (``None``: fp16) as ``name``, advancing ``bar``; its seconds
        are counted from ``t0`` (``time.perf_counter()``)."""

    def evaluate(self, scheme: str | Scheme | BaselineLike, *, progress: bool = True) -> R:
        """Measure ``scheme`` (``fp16``: no quantization).

        Raises:
            UnknownSchemeError, SchemeError, ValueError: see :meth:`Evaluator.check`.
        """
        spec = self._check(scheme)
        name = scheme if isinstance(scheme, str) else scheme.name
        t0 = time.perf_counter()
        with progress_bar(name, self._steps(spec), progress) as bar:
            return self._measure(spec, name, bar, t0)

    def evaluate_all(
        self,
        schemes: Sequence[str | Scheme | BaselineLike],
        *,
        progress: bool = True,
        on_result: Callable[[R], None] | None = None,
    ) -> list[R]:
        """Check every scheme first (a typo fails fast), then measure each in turn."""
        measure = functools.partial(self.evaluate, progress=progress)
        return evaluate_each(schemes, self._check, measure, progress=progress, on_result=on_result)
