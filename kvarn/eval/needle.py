"""``kvarn eval --task needle``: a pass key hidden in filler text, read back through the quantized cache.

The prompt follows the pass-key retrieval test of the long-context literature (Mohtashami and
Jaggi, 2023): an instruction, filler (the evaluator's text: the bundled licenses), one line
``The pass key is NNNNN. Remember it. NNNNN is the pass key.`` at a depth of the filler, more
filler, then ``What is the pass key? The pass key is``. Every prompt of a length is exactly that
many tokens; the needle starts on a line of the filler (the first line start at or after
``depth x filler``, or the last one before it near the end), and the key of the i-th depth is the same at every length.

Decode mode, as in :mod:`kvarn.eval.harness`: the prompt goes through the cache in chunks (tiles
quantized as they fill), then :data:`ANSWER_TOKENS` greedy tokens are generated one at a time,
reading the quantized tiles. Retrieved: the first number in the answer is the key.

The prompts of one length are the same up to their needles. The cache is fed that shared part
once and copied at the chunk boundary before each needle, so ten depths cost about six prompts'
chunks, with the tokens separate runs give (``tests/eval/test_needle.py``).

Example:
    >>> ev = Evaluator("smollm2-135m", tokens=1024)
    >>> r = NeedleTask(ev, lengths=[1024], depths=2).evaluate("fp16")
    >>> r.rates
    [1.0]
"""

from __future__ import annotations

import copy
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvarn.eval.harness import Evaluator
from kvarn.eval.task import Task
from kvarn.hf.spec import BaselineLike, Spec
from kvarn.schemes import Scheme

HEADER = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # " NNNNN." and a little more: SmolLM2 writes one token per digit
DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = 10
KEY_SEED = 0


def needle_depths(count: int) -> list[float]:
    """``count`` depths evenly spaced from 0 (right after the instruction) to 1 (right before the
    question); one depth is 0.5.

    Raises:
        ValueError: ``count`` < 1.
    """
    if count < 1:
        raise ValueError(f"depths={count}: at least 1 depth is needed")
    return [0.5] if count == 1 else [i / (count - 1) for i in range(count)]


def needle_keys(count: int, seed: int = KEY_SEED) -> list[int]:
    """The 5-digit keys of the first ``count`` depths (fixed by ``seed``)."""
    rng = random.Random(seed)
    return [rng.randint(10000, 99999) for _ in range(count)]


def retrieved(answer: str, key: int) -> bool:
    """Whether the first number in ``answer`` is ``key``."""
    m = re.search(r"\d+", answer)
    return m is not None and int(m.group()) == key


@dataclass(frozen=True)
class NeedlePrompt:
    """One prompt: ``ids`` ``[1, length]`` int64; its first ``shared`` tokens (everything before the
    needle) are those of every prompt of the same length."""

    ids: torch.Tensor
    key: int
    depth: float
    shared: int


def build_prompts(
    tokenizer: Any, filler: Sequence[int], length: int, depths: Sequence[float], prefix: Sequence[int] = ()
) -> list[NeedlePrompt]:
    """The prompts of one ``length`` (tokens), one per depth, over ``filler`` token ids.

    ``prefix`` (e.g. a BOS token) comes before the instruction.

    Raises:
        ValueError: ``length`` leaves no room for filler, or the filler is too short for it.
    """
    head = [*prefix, *tokenizer(HEADER, add_special_tokens=False).input_ids]
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    needles = [tokenizer(NEEDLE.format(key=k), add_special_tokens=False).input_ids for k in needle_keys(len(depths))]
    room = length - len(head) - len(question) - max(len(n) for n in needles)
    if room < 1:
        raise ValueError(f"needle length {length}: too short for the instruction, needle and question")
    if room > len(filler):
        raise ValueError(
            f"needle length {length}: the filler text has {len(filler)} tokens, {room} are needed; "
            "use a longer --text or shorter --lengths"
        )
    newline = [t.endswith("\n") for t in tokenizer.batch_decode([[t] for t in filler[:room]])]
    out = []
    for d, key, needle in zip(depths, needle_keys(len(depths)), needles, strict=True):
        n = length - len(head) - len(question) - len(needle)
        p = _line_start(newline, round(d * n), n)
        ids = [*head, *filler[:p], *needle, *filler[p:n], *question]
        out.append(NeedlePrompt(torch.tensor([ids]), key, d, len(head) + p))
    return out


def _line_start(newline: Sequence[bool], p: int, n: int) -> int:
    """The first line start at or after ``p`` within the first ``n`` filler tokens, else the last
    one before it (``newline[i]``: token ``i`` ends a line; a line starts at 0 and after each)."""
    for q in range(p, n + 1):
        if q == 0 or newline[q - 1]:
            return q
    return max(q for q in range(p + 1) if q == 0 or newline[q - 1])


@dataclass
class NeedleResult:
    """One scheme's retrievals: ``retrieved[i][j]`` at ``lengths[i]`` tokens, ``depths[j]``."""

    scheme: str
    bits_per_element: float  # after the longest prompt
    lengths: list[int]
    depths: list[float]
    keys: list[int]
    retrieved: list[list[bool]]
    answers: list[list[str]]
    seconds: float

    @property
    def rates(self) -> list[float]:
        """The fraction retrieved at each length."""
        return [sum(r) / len(r) for r in self.retrieved]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rates": self.rates}


class NeedleTask(Task[NeedleResult]):
    """Pass-key retrieval at several lengths and depths, on an :class:`Evaluator`'s model and text.

    Args:
        ev: the evaluator (model, tokenizer, chunk, device); its tokens are the filler, so it must
            hold about as many as the longest length.
        lengths: prompt lengths in tokens.
        depths: how many depths (evenly spaced, see :func:`needle_depths`).

    Raises:
        ValueError: a length beyond the model's context or the filler, or too short; no lengths.
    """

    def __init__(self, ev: Evaluator, lengths: Sequence[int] = DEFAULT_LENGTHS, depths: int = DEFAULT_DEPTHS) -> None:
        if not lengths:
            raise ValueError("needle: no lengths given")
        limit = getattr(ev.model.config, "max_position_embeddings", None)
        for n in lengths:
            if limit is not None and n > limit:
                raise ValueError(f"needle length {n}: beyond {ev.model_name}'s context of {limit} tokens")
        self.ev = ev
        self.lengths = sorted(set(lengths))
        self.depths = needle_depths(depths)
        filler = ev.ids[0].tolist()
        prefix = filler[:1] if ev.bos else []
        filler = filler[len(prefix) :]
        self.prompts = {n: build_prompts(ev.tokenizer, filler, n, self.depths, prefix) for n in self.lengths}

    def _check(self, scheme: str | Scheme | BaselineLike) -> Spec:
        return self.ev.check(scheme, self.lengths[0], "Use longer --lengths")

    def _steps(self, spec: Spec) -> int:
        """Progress-bar steps of one scheme (the same for every ``spec``): chunks fed and answer tokens."""
        c = self.ev.chunk
        steps = 0
        for n, prompts in self.prompts.items():
            starts = [p.shared // c * c for p in prompts]
            steps += max(starts) // c + sum(-(-(n - s) // c) for s in starts) + ANSWER_TOKENS * len(prompts)
        return steps

    def _measure(self, spec: Spec, name: str, bar: Any, t0: float) -> NeedleResult:
        """Retrieve every prompt's key through ``spec``'s cache (``fp16``: no quantization)."""
        ev = self.ev
        found: list[list[bool]] = []
        answers: list[list[str]] = []
        bits = 16.0
        for n in self.lengths:
            prompts = self.prompts[n]
            trunk = max(prompts, key=lambda p: p.shared).ids  # the shared part of every prompt is its prefix
            cache = ev.new_cache(spec)
            fed = 0
            out: dict[int, str] = {}
            order = sorted(range(len(prompts)), key=lambda i: prompts[i].shared)
            for k, i in enumerate(order):
                start = prompts[i].shared // ev.chunk * ev.chunk
                for _ in ev.feed(cache, trunk[:, :start], bar, start=fed, last_only=True):
                    pass
                fed = max(fed, start)
                fork = cache if k == len(order) - 1 else copy.deepcopy(cache)
                last = torch.empty(0)
                for _, lp in ev.feed(fork, prompts[i].ids, bar, start=start, last_only=True):
                    last = lp[-1]
                bits = fork.bits_per_element() if spec is not None else 16.0
                out[i] = ev.tokenizer.decode(ev.greedy(fork, last, ANSWER_TOKENS, bar))
            answers.append([out[i] for i in range(len(prompts))])
            found.append([retrieved(out[i], p.key) for i, p in enumerate(prompts)])
        return NeedleResult(
            scheme=name,
            bits_per_element=bits,
            lengths=list(self.lengths),
            depths=list(self.depths),
            keys=[p.key for p in self.prompts[self.lengths[0]]],
            retrieved=found,
            answers=answers,
            seconds=time.perf_counter() - t0,
        )
