"""Decode-mode accuracy harness: a real model, a real text, the cache quantizing tiles as they fill.

The text is fed through :class:`kvarn.hf.KVarNCache` in chunks of ``chunk`` tokens, so each chunk
attends to tiles that were quantized when they filled, as on a server (never a one-shot fake
quantization of the whole prompt). Every position's next-token distribution is compared with the
fp16 reference (the same chunking, nothing quantized); then a greedy continuation is generated
token by token through the same cache and compared with fp16's.

Example:
    >>> ev = Evaluator("smollm2-135m", tokens=512, chunk=128, greedy_tokens=32)
    >>> r = ev.evaluate("kvarn_k4v2_g128")
    >>> r.kl > 0.0
    True
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import torch

from kvarn.baselines import Baseline
from kvarn.eval.bos import tokenize
from kvarn.eval.metrics import MetricSums, leading_matches, nll
from kvarn.eval.task import evaluate_each, progress_bar
from kvarn.hf import FP16, KVarNCache, model_geometry, resolve_spec
from kvarn.hf.layers import KVarNLayer
from kvarn.hf.spec import BaselineLike, Spec
from kvarn.models import load_model, parse_device, parse_dtype
from kvarn.schemes import Scheme


@dataclass
class EvalResult:
    """One scheme measured on the evaluator's tokens (see :meth:`Evaluator.evaluate`)."""

    scheme: str
    bits_per_element: float  # stored bits per cached number after the text; unquantized ones at 16
    ppl: float
    delta_ppl_pct: float  # 100 * (ppl / ppl_fp16 - 1)
    kl: float  # mean KL(fp16 || scheme) over next-token distributions, nats
    top1_agreement: float  # fraction of positions whose argmax equals fp16's
    greedy_agreement_tokens: int | None  # leading greedy tokens identical to fp16's; None: not run
    tokens: int
    seconds: float
    # block-bootstrap intervals (chunks as blocks; see kvarn.eval.metrics), [low, high]; None: not measured
    delta_ppl_pct_ci: list[float] | None = None
    kl_ci: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_TEXTS = ("gpl-3.txt", "apache-2.0.txt")  # verbatim copies, which both licenses allow


def default_text() -> str:
    """The bundled evaluation text: GPL-3, then Apache-2.0 (a blank line between them).

    GPL-3 alone is 7,658 SmolLM2 tokens; with Apache-2.0 after it the text is 9,881 tokens, enough
    for ``--tokens 8192`` (SmolLM2's whole context). The first 7,658 tokens are GPL-3's, so results
    on up to that many tokens are those of GPL-3 alone.
    """
    data = resources.files("kvarn").joinpath("data")
    return "\n\n".join(data.joinpath(name).read_text(encoding="utf-8").strip("\n") for name in DEFAULT_TEXTS)


@functools.lru_cache(maxsize=2)
def _loaded(model: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a model once per process (tests and the tuner build several evaluators)."""
    return load_model(model, dtype=dtype, device=device)


@dataclass
class _Reference:
    logp: torch.Tensor  # [tokens - 1, vocab] float32
    nll: torch.Tensor  # [tokens - 1] float32
    seconds: float
    greedy: dict[int, list[int]] = field(default_factory=dict)  # prefix length -> continuation
    cache: KVarNCache | None = None  # fp16 cache after the whole text, until its greedy run is done
    last: torch.Tensor | None = None  # [vocab] log-probs after the whole text


class Evaluator:
    """Loads a model and a text once; measures any number of schemes on the same tokens.

    Args:
        model: a model alias (``smollm2-135m``) or a local Hugging Face folder.
        text: the evaluation text; None = the bundled GPL-3.
        tokens: use the first ``tokens`` tokens of the text (fewer if the text is shorter).
        chunk: tokens per forward pass in decode mode.
        greedy_tokens: length of the greedy continuation compared with fp16's (0: none).
        quantize_before_read: chunks read their own tokens quantized once committed (see
            :mod:`kvarn.hf.layers`); default: as computed, later chunks read them as stored.
        device: where the model and its caches run: ``cpu`` (default), ``cuda`` or ``cuda:<n>``.
            Log-probabilities are compared on the CPU, in float32, whatever the device.
        dtype: the model's weights and activations: ``float32`` (default), ``bfloat16``, ``float16``.
            The reference is the same model in the same dtype with an unquantized cache.
        quantize_sliding: quantize sliding-window layers too (default: they stay exact, as in
            KVarN; see :class:`kvarn.hf.KVarNCache`).
        bos: ``auto`` (the tokenizer's own setting), ``yes`` (the text starts with the BOS token,
            prepended if the tokenizer did not), ``no`` (never). :attr:`bos` says whether it did.

    Raises:
        ValueError: a non-positive ``chunk`` or ``tokens``, a negative ``greedy_tokens``, a text
            of fewer than 2 tokens, an unknown device or dtype, or ``cuda`` without a CUDA device.
        ModelNotFoundError: the model cannot be found or loaded.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        text: str | None = None,
        tokens: int = 2048,
        chunk: int = 128,
        greedy_tokens: int = 256,
        *,
        quantize_before_read: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        quantize_sliding: bool = False,
        bos: str = "auto",
    ) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r}: the chunk size must be a positive number of tokens (e.g. 128)")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
            raise ValueError(f"tokens={tokens!r}: evaluate at least 2 tokens")
        if isinstance(greedy_tokens, bool) or not isinstance(greedy_tokens, int) or greedy_tokens < 0:
            raise ValueError(f"greedy_tokens={greedy_tokens!r}: must be 0 (no greedy run) or more")
        self.model_name = model
        self.chunk = chunk
        self.quantize_before_read = quantize_before_read
        self.quantize_sliding = quantize_sliding
        self.greedy_tokens = greedy_tokens
        self.device, self.dtype = parse_device(device), parse_dtype(dtype)
        self.model, self.tokenizer = _loaded(model, self.device, self.dtype)
        text = default_text() if text is None else text
        self.text_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self.ids, self.bos = tokenize(self.tokenizer, text, bos)
        self.ids = self.ids[:, :tokens]  # [1, n] int64, CPU
        self.tokens = int(self.ids.shape[1])
        if self.tokens < 2:
            raise ValueError(f"the text has {self.tokens} token(s); at least 2 are needed to score anything")
        self.num_layers, self.num_kv_heads, self.head_dim = model_geometry(self.model.config)
        self._ref: _Reference | None = None

    # ---- validation ----------------------------------------------------------------------------
    def check(
        self,
        scheme: str | Scheme | BaselineLike,
        max_tokens: int | None = None,
        remedy: str = "Use a longer --text or more --tokens",
    ) -> Spec:
        """Resolve ``scheme`` and check it can be measured on the text (or on sequences of
        ``max_tokens``); returns the resolved spec. ``remedy`` ends the too-short message.

        Raises:
            UnknownSchemeError: unknown name (lists the valid ones).
            ValueError: the text (or prefix) is shorter than one tile (or a baseline's first commit).
        """
        spec = resolve_spec(scheme)
        n = self._prefix(max_tokens)
        if spec is None:
            return spec
        if isinstance(spec, Scheme):
            spec.tile_bytes(self.head_dim)  # raises SchemeError for an unsupported head_dim
            need = spec.group_size * (2 if spec.sink_tile else 1)  # one tile (after the sink tile)
        else:
            need = spec.window + spec.commit_tokens
        # the first scored position that reads committed tokens: the one completing them with
        # quantize_before_read, else the first position of the next chunk
        first = need - 1 if self.quantize_before_read else -(-need // self.chunk) * self.chunk
        if first > n - 2:
            raise ValueError(
                f"the text has {n} tokens, too short for {_name(scheme)}: nothing quantized would be read "
                f"(one tile or commit is {need} tokens; with chunk {self.chunk} the first position reading it is "
                f"{first}). {remedy}"
            )
        return spec

    def _prefix(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            return self.tokens
        if max_tokens < 2:
            raise ValueError(f"max_tokens={max_tokens}: evaluate at least 2 tokens")
        return min(max_tokens, self.tokens)

    # ---- running the model -----------------------------------------------------------------------
    @torch.inference_mode()
    def feed(
        self, cache: KVarNCache, ids: torch.Tensor, bar: Any, *, start: int = 0, last_only: bool = False
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Feed ``ids[:, start:]`` (``[1, n]`` int64, CPU) through ``cache`` in chunks of :attr:`chunk`.

        Chunks start at multiples of :attr:`chunk` counted from ``start`` (0, or where a copy of a
        cache that was fed the same ``ids[:, :start]`` left off). Yields ``(chunk start, log-probs
        [L, vocab] float32 on CPU)``: every position of the chunk, or only its last with
        ``last_only`` (the model then skips its output layer for the others).
        """
        n = ids.shape[1]
        for pos in range(start, n, self.chunk):
            x = ids[:, pos : min(n, pos + self.chunk)].to(self.device)
            logits = self.model(
                input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0
            ).logits
            bar.update(1)
            yield pos, logits[0].float().log_softmax(-1).cpu()

    def _chunks(self, cache: KVarNCache, n: int, bar: Any) -> Iterator[tuple[int, torch.Tensor]]:
        """Feed the first ``n`` tokens of the text; yield ``(start, log-probs [L, vocab] float32 on CPU)``."""
        return self.feed(cache, self.ids[:, :n], bar)

    @torch.inference_mode()
    def greedy(
        self,
        cache: KVarNCache,
        last: torch.Tensor,
        steps: int,
        bar: Any,
        ref: Sequence[int] | None = None,
        logps: list[torch.Tensor] | None = None,
    ) -> list[int]:
        """Greedy continuation after what ``cache`` holds, one token per forward pass (decode mode).

        Args:
            last: ``[vocab]`` log-probs after the cache's last token (the first token's distribution).
            steps: tokens to generate.
            ref: stop at the first token that differs from ``ref`` (that token included).
            logps: if given, each generated token's distribution (``[vocab]`` float32 log-probs,
                ``last`` first) is appended to it.
        """
        out: list[int] = []
        lp = last
        for i in range(steps):
            out.append(int(lp.argmax()))
            if logps is not None:
                logps.append(lp)
            bar.update(1)
            if (ref is not None and out[-1] != ref[i]) or i + 1 == steps:
                break
            ids = torch.tensor([[out[-1]]], device=self.device)
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            lp = logits[0, -1].float().log_softmax(-1).cpu() if logps is not None else logits[0, -1]
        return out

    def new_cache(self, spec: Spec) -> KVarNCache:
        """An empty :func:`make_cache` for ``spec`` (a resolved one) with this evaluator's
        ``quantize_before_read`` and ``quantize_sliding``."""
        return make_cache(
            spec,
            self.model.config,
            quantize_before_read=self.quantize_before_read,
            quantize_sliding=self.quantize_sliding,
        )

    def _bar(self, desc: str, total: int, progress: bool) -> Any:
        return progress_bar(desc, total, progress)

    # ---- the reference -------------------------------------------------------------------------
    def _reference(self, progress: bool = True) -> _Reference:
        if self._ref is None:
            t0 = time.perf_counter()
            cache = KVarNCache(FP16, self.model.config)
            n = self.tokens
            logp = torch.empty(n - 1, self.model.config.vocab_size)
            last = None
            with self._bar("fp16 reference", math.ceil(n / self.chunk), progress) as bar:
                for start, lp in self._chunks(cache, n, bar):
                    stop = min(n - 1, start + lp.shape[0])
                    logp[start:stop] = lp[: stop - start]
                    last = lp[-1]
            targets = self.ids[0, 1:n]
            self._ref = _Reference(logp, nll(logp, targets), time.perf_counter() - t0, cache=cache, last=last)
        return self._ref

    def reference(self) -> torch.Tensor:
        """fp16-cache log-probs ``[tokens - 1, vocab]`` float32 (computed once, then cached)."""
        return self._reference().logp

    def _reference_greedy(self, n: int, progress: bool) -> list[int]:
        ref = self._reference(progress)
        if n not in ref.greedy:
            if n == self.tokens and ref.cache is not None and ref.last is not None:
                cache, last = ref.cache, ref.last
            else:  # a prefix: run fp16 over it once
                cache = KVarNCache(FP16, self.model.config)
                with self._bar(f"fp16 prefix {n}", math.ceil(n / self.chunk), progress) as bar:
                    for _, lp in self._chunks(cache, n, bar):
                        last = lp[-1]
            with self._bar("fp16 greedy", self.greedy_tokens, progress) as bar:
                ref.greedy[n] = self.greedy(cache, last, self.greedy_tokens, bar)
            if n == self.tokens:
                ref.cache = ref.last = None  # its continuation is known: free the fp16 cache
        return ref.greedy[n]

    # ---- measuring a scheme -----------------------------------------------------------------------
    def evaluate(
        self,
        scheme: str | Scheme | BaselineLike,
        *,
        greedy: bool = True,
        max_tokens: int | None = None,
        progress: bool = True,
    ) -> EvalResult:
        """Measure ``scheme`` in decode mode on the first ``max_tokens`` (default: all) tokens.

        Raises:
            UnknownSchemeError, SchemeError, ValueError: see :meth:`check`.
        """
        spec = self.check(scheme, max_tokens)
        n = self._prefix(max_tokens)
        ref = self._reference(progress)
        g = self.greedy_tokens if greedy else 0
        ref_greedy = self._reference_greedy(n, progress) if g else None
        ref_ppl = math.exp(float(ref.nll[: n - 1].double().mean()))
        if spec is None:  # fp16 is the reference itself
            agree = len(ref_greedy) if ref_greedy is not None else None
            return EvalResult(
                _name(scheme), 16.0, ref_ppl, 0.0, 0.0, 1.0, agree, n, ref.seconds, [0.0, 0.0], [0.0, 0.0]
            )
        t0 = time.perf_counter()
        cache = self.new_cache(spec)
        sums = MetricSums()
        last = torch.empty(0)
        with self._bar(_name(scheme), math.ceil(n / self.chunk) + g, progress) as bar:
            for start, lp in self._chunks(cache, n, bar):
                stop = min(n - 1, start + lp.shape[0])
                if stop > start:
                    sums.add(ref.logp[start:stop], lp[: stop - start], self.ids[0, start + 1 : stop + 1])
                last = lp[-1]
            bits = cache.bits_per_element()
            agree = None
            if ref_greedy is not None:
                agree = leading_matches(self.greedy(cache, last, g, bar, ref_greedy), ref_greedy)
        ppl_ci, kl_ci = sums.intervals(block=self.chunk)
        return EvalResult(
            scheme=_name(scheme),
            bits_per_element=bits,
            ppl=sums.ppl,
            delta_ppl_pct=100.0 * (sums.ppl / ref_ppl - 1.0),
            kl=sums.mean_kl,
            top1_agreement=sums.top1_agreement,
            greedy_agreement_tokens=agree,
            tokens=n,
            seconds=time.perf_counter() - t0,
            delta_ppl_pct_ci=list(ppl_ci),
            kl_ci=list(kl_ci),
        )

    def evaluate_all(
        self,
        schemes: Sequence[str | Scheme | BaselineLike],
        *,
        greedy: bool = True,
        progress: bool = True,
        on_result: Callable[[EvalResult], None] | None = None,
    ) -> list[EvalResult]:
        """Check every scheme first (so a typo fails fast), then measure each in turn."""
        measure = functools.partial(self.evaluate, greedy=greedy, progress=progress)
        return evaluate_each(schemes, self.check, measure, progress=progress, on_result=on_result)


def make_cache(spec: str | Scheme | BaselineLike | None, config: Any, **kwargs: Any) -> KVarNCache:
    """A :class:`KVarNCache` for ``spec`` whose baseline boundary layers (``boundary_layers``, as
    vLLM deploys TurboQuant) stay unquantized; ``kwargs`` go to :class:`KVarNCache`."""
    spec = None if spec is None else resolve_spec(spec)
    cache = KVarNCache(FP16 if spec is None else spec, config, **kwargs)
    if isinstance(spec, Baseline) and spec.boundary_layers:
        attention = cache.geometry.attention_layers
        hybrid = len(attention) < cache.geometry.num_layers
        for j, i in enumerate(attention):
            if not spec.quantizes_layer(j, len(attention), hybrid) and cache.geometry.windows[i] is None:
                cache.layers[i] = KVarNLayer(None)
    return cache


def _name(scheme: str | Scheme | BaselineLike) -> str:
    return scheme if isinstance(scheme, str) else scheme.name
