"""Compile gate: build every kernel variant the launchers emit for a GPU, without a GPU.

Triton's NVIDIA backend and ``ptxas`` ship inside the ``triton`` wheel. A stand-in driver whose
``get_current_target()`` is ``GPUTarget("cuda", arch, 32)`` makes Triton compile for that GPU; every
``kernel[grid](...)`` of the real launchers in :mod:`kvarn.kernels.triton.ops`, driven with CPU tensors,
then compiles (``warmup=True``) instead of launching. For each compiled kernel the gate reads:

* registers, spills and the stack frame from ``ptxas -v`` on the kernel's PTX (the ``ptxas`` Triton
  itself uses for that arch, with its flags; results cached under Triton's cache directory by PTX
  hash). A stack frame is local memory even when ptxas counts no spill in it: registers it saves
  around its own subroutine calls (e.g. the slow path of an IEEE division) land there;
* shared memory from ``metadata.shared``;
* programs per SM from registers, warps and shared memory (:func:`programs_per_sm`).

A variant fails on a compile error, on shared memory above one block's limit (:data:`ARCHS`), on
any register spill or stack frame, and on still compiling after a timeout (:func:`compile_variants` compiles each
variant in its own forked process group and kills it, ptxas included). The kernels must be
compiled, not interpreted: run the gate in a process without ``TRITON_INTERPRET=1``
(``tools/compile_gate.py`` does). The variants are in :mod:`kvarn.bench.compile_gate.variants`.

Another Triton version is checked by running the CLI with that Triton's interpreter, in a
throwaway environment outside the repository:
``python3 -m venv /path/t36 && /path/t36/bin/pip install triton==3.6.0 torch==2.13.0 omegaconf==2.4.0``
then ``PYTHONPATH=. /path/t36/bin/python tools/compile_gate.py`` (results: ``docs/benchmarks.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.jit import JITFunction

from kvarn.kernels.triton._store import store_side_kernel

from .variants import Variant, full_variants, launch, quick_variants


@dataclass(frozen=True)
class Arch:
    """Per-SM resources of one GPU architecture (CUDA occupancy figures)."""

    name: str
    block_smem: int  # bytes of shared memory one block may use (opt-in maximum)
    sm_smem: int  # bytes of shared memory per SM
    regs: int = 65536  # 32-bit registers per SM
    max_warps: int = 64
    max_blocks: int = 32


ARCHS = {
    90: Arch("sm_90 (H100/H200)", block_smem=227 * 1024, sm_smem=228 * 1024),
    80: Arch("sm_80 (A100)", block_smem=163 * 1024, sm_smem=164 * 1024),
}

__all__ = [
    "ARCHS",
    "Row",
    "StandInDriver",
    "Variant",
    "check_row",
    "compile_call",
    "compile_variant",
    "compile_variants",
    "full_variants",
    "parse_ptxas",
    "programs_per_sm",
    "quick_variants",
]


@dataclass
class Row:
    """One compiled kernel of one variant on one arch; ``error`` set when it did not compile."""

    arch: int
    variant: str
    kernel: str
    warps: int = 0
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads per thread, from ptxas -v
    stack_bytes: int = 0  # stack frame per thread (local memory), from ptxas -v
    smem: int = 0  # bytes, metadata.shared
    programs_per_sm: int = 0
    error: str = ""

    @property
    def problems(self) -> list[str]:
        return check_row(self)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "problems": self.problems}


def check_row(row: Row) -> list[str]:
    """Why ``row`` fails the gate: compile error, shared memory over a block's limit, spills, a stack frame."""
    if row.error:
        return [f"compile error: {row.error}"]
    out = []
    limit = ARCHS[row.arch].block_smem
    if row.smem > limit:
        out.append(f"shared memory {row.smem / 1024:.0f} KiB > {limit // 1024} KiB per block on sm_{row.arch}")
    if row.spill_bytes:
        out.append(f"{row.spill_bytes} bytes of register spills per thread")
    if row.stack_bytes:
        out.append(f"{row.stack_bytes} bytes of stack frame per thread")
    if row.programs_per_sm < 1:
        out.append("no program fits on one SM")
    return out


def programs_per_sm(arch: int, registers: int, warps: int, smem: int) -> int:
    """Programs (blocks) resident on one SM: the least of the register, warp, block and smem limits.

    Registers are allocated per warp in units of 256; every block reserves 1 KiB of shared memory.
    """
    a = ARCHS[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = a.regs // (per_warp * warps)
    by_smem = a.sm_smem // (smem + 1024)
    return max(0, min(by_regs, a.max_warps // warps, a.max_blocks, by_smem))


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stores": re.compile(r"(\d+) bytes spill stores"),
    "loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas(log: str) -> tuple[int, int, int]:
    """``ptxas -v`` output -> (registers, spill store + load bytes, stack frame bytes), per thread."""
    found = {k: [int(x) for x in r.findall(log)] for k, r in _PTXAS_RE.items()}
    if not found["registers"]:
        raise ValueError(f"no 'Used N registers' line in ptxas output:\n{log[-2000:]}")
    return max(found["registers"]), sum(found["stores"]) + sum(found["loads"]), max(found["stack"], default=0)


def _ptxas(arch: int) -> tuple[str, list[str]]:
    """The ptxas Triton uses for ``arch`` and the flags it passes (beyond -v and --fmad)."""
    from triton.backends.nvidia import compiler as nv

    try:
        tool = nv.get_ptxas(arch)
    except TypeError:  # older Triton: one ptxas for every arch
        tool = nv.get_ptxas()
    flags = [f"--gpu-name={nv.sm_arch_from_capability(arch)}"]
    if "--regAllocOptLevel=2" in Path(nv.__file__).read_text():  # Triton >= 3.7 works around a ptxas 13 bug
        flags.append("--regAllocOptLevel=2")
    return str(tool.path), flags


def ptxas_usage(ptx: str, arch: int, fp_fusion: bool, cache_dir: Path) -> tuple[int, int, int]:
    """Registers, spill bytes and stack frame bytes of ``ptx`` for ``arch``, from ``ptxas -v`` (cached by PTX hash)."""
    exe, flags = _ptxas(arch)
    cmd = [exe, "-v", *flags, *([] if fp_fusion else ["--fmad=false"])]
    key = hashlib.sha256((" ".join(cmd[1:]) + ptx).encode()).hexdigest()[:32]
    hit = cache_dir / f"{key}.usage.json"
    if hit.exists():
        regs, spills, stack = json.loads(hit.read_text())
        return int(regs), int(spills), int(stack)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([*cmd, str(src), "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed ({res.returncode}): {res.stderr[-2000:]}")
    usage = parse_ptxas(res.stderr)
    cache_dir.mkdir(parents=True, exist_ok=True)
    hit.write_text(json.dumps(list(usage)))
    return usage


class StandInDriver(DriverBase):  # type: ignore[misc]
    """A Triton driver for a GPU that is not there: compiles for ``arch``, launches nothing.

    The device id is the arch, so each arch gets its own per-device kernel caches.
    """

    def __init__(self, arch: int) -> None:
        self.arch = arch

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the stand-in driver compiles only")

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


class _Recorder:
    """Turns every ``JITFunction`` launch into a compile-only warm-up and records the kernels."""

    def __init__(self) -> None:
        self.kernels: list[tuple[str, Any]] = []
        self.current = ""
        self._orig = JITFunction.run

    def __enter__(self) -> _Recorder:
        orig, rec = self._orig, self

        def run(fn: JITFunction[Any], *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            rec.current = fn.fn.__name__
            kernel = orig(fn, *args, grid=grid, warmup=True, **kwargs)
            rec.kernels.append((fn.fn.__name__, kernel))
            return kernel

        JITFunction.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        JITFunction.run = self._orig


def _first_lines(e: BaseException) -> str:
    """A one-line account of a compile failure: where (Triton's "at L:C") and the innermost cause."""
    where = str(e).strip().splitlines()[0] if str(e).strip() else ""
    cause: BaseException = e
    while cause.__cause__ is not None:
        cause = cause.__cause__
    what = getattr(cause, "error_message", None) or str(cause).strip().splitlines()[-1:] or [""]
    what = what if isinstance(what, str) else what[0]
    return f"{type(e).__name__} {where} {what}".strip()[:600]


def compile_variant(v: Variant, cache_dir: Path | None = None) -> list[Row]:
    """Compile one variant on its arch through the real launcher; one row per kernel it launches."""
    if not isinstance(store_side_kernel, JITFunction):
        raise RuntimeError("kvarn's kernels are interpreted (TRITON_INTERPRET=1): run the gate without it")
    return compile_call(lambda: launch(v), v.arch, v.name, v.op, cache_dir)


def compile_call(
    call: Callable[[], object], arch: int, variant: str, what: str, cache_dir: Path | None = None
) -> list[Row]:
    """Run ``call`` (which launches Triton kernels) with every launch compiled for ``arch`` instead.

    Returns one row per distinct kernel compiled; a single row with ``error`` set when compiling
    raised (``what`` names it when no kernel had started) or when nothing was compiled.
    """
    cache = cache_dir or Path(triton.knobs.cache.dir) / "kvarn-gate"
    drivers = triton.runtime.driver
    before = drivers._active  # no real driver exists without a GPU: restore the slot, not a default
    drivers.set_active(StandInDriver(arch))
    rec = _Recorder()
    try:
        with rec:
            call()
    except Exception as e:  # a compile error is a result, reported in the table
        return [Row(arch, variant, rec.current or what, error=_first_lines(e))]
    finally:
        drivers._active = before
    if not rec.kernels:
        return [Row(arch, variant, what, error="no kernel was compiled")]
    rows, seen = [], set()
    for name, k in rec.kernels:
        if k.hash in seen:
            continue
        seen.add(k.hash)
        md = k.metadata
        try:
            regs, spills, stack = ptxas_usage(k.asm["ptx"], arch, bool(md.enable_fp_fusion), cache)
        except (RuntimeError, ValueError) as e:
            rows.append(Row(arch, variant, name, md.num_warps, error=_first_lines(e)))
            continue
        occ = programs_per_sm(arch, regs, md.num_warps, md.shared)
        rows.append(Row(arch, variant, name, md.num_warps, regs, spills, stack, md.shared, occ))
    return rows


def compile_variants(variants: list[Variant], jobs: int = 1, timeout: float = 600.0) -> Iterator[list[Row]]:
    """Compile ``variants``, each in its own forked process (at most ``jobs`` at a time), in order.

    A variant still compiling after ``timeout`` seconds is killed with everything it started
    (ptxas included) and reported as a failure: a kernel ptxas needs minutes for is not shippable.
    """
    ctx = multiprocessing.get_context("fork")  # the children inherit the imported modules
    running: list[tuple[Variant, Any, Any, float]] = []
    pending = list(variants)
    done: dict[Variant, list[Row]] = {}
    order = list(variants)
    while pending or running:
        while pending and len(running) < jobs:
            v = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(v, send), daemon=True)
            proc.start()
            send.close()
            running.append((v, proc, recv, time.monotonic()))
        for item in list(running):
            v, proc, recv, t0 = item
            if recv.poll(0.2):
                try:
                    done[v] = [Row(**r) for r in recv.recv()]
                except EOFError:  # the child died without an answer
                    done[v] = [Row(v.arch, v.name, v.op, error=f"compiler process died (exit {proc.exitcode})")]
            elif time.monotonic() - t0 > timeout:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                done[v] = [Row(v.arch, v.name, v.op, error=f"still compiling after {timeout:.0f} s (killed)")]
            else:
                continue
            proc.join(5)
            running.remove(item)
        while order and order[0] in done:
            yield done.pop(order.pop(0))


def _child(v: Variant, send: Any) -> None:
    os.setsid()  # own process group: a timeout kills ptxas too
    rows = compile_variant(v)
    send.send([{f.name: getattr(r, f.name) for f in dataclasses.fields(r)} for r in rows])
    send.close()
