"""What the benchmark tools share: the section of a ``docs/`` page a run replaces, and the command,
date, commit and machine it records.

A benchmark prints its table and replaces its section of a page (the text between
``<!-- name -->`` and ``<!-- /name -->``), stamped with the UTC time and the command that measured
it, less the options that only say where the output goes. Every section names the commit it ran
(:func:`commit`) and, where timings depend on it, the machine (:func:`machine`): :func:`measured_at`.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose docs/ the benchmarks write (an editable install)


def write_section(doc: Path, name: str, body: str, title: str = "# Benchmarks") -> None:
    """Replace the text between ``<!-- name -->`` and ``<!-- /name -->`` in ``doc`` with ``body``
    (appended if absent; a missing ``doc`` starts with the heading ``title``)."""
    text = doc.read_text() if doc.exists() else title + "\n"
    block = f"<!-- {name} -->\n{body}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def measuring_args(argv: Sequence[str], valued: Collection[str], flags: Collection[str] = ()) -> list[str]:
    """``argv`` less the options that do not change what is measured: each of ``valued`` with its
    value (``--json x`` or ``--json=x``) and each of ``flags``.

    Example:
        >>> measuring_args(["a", "--json", "x", "--no-doc", "--doc=d", "--n", "4"], ("--json", "--doc"), ("--no-doc",))
        ['a', '--n', '4']
    """
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in valued:
            skip = True
        elif a not in flags and a.split("=", 1)[0] not in valued:
            out.append(a)
    return out


def utc_stamp() -> str:
    """The time now, as the sections print it: ``2026-12-04 23:29 UTC``."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> str:
    """CPU model, its vector extensions that matter here, and the cores this process may use."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    have = set(flags.group(1).split()) if flags else set()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    simd = ", ".join(f for f in wanted if f in have) or "none of " + ", ".join(wanted)
    return f"{name.group(1).strip() if name else 'unknown CPU'}, {cores} cores, {simd}"


def commit() -> str:
    """``git rev-parse --short HEAD``, naming the folders of ``kvarn/`` with uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvarn"], cwd=ROOT, capture_output=True,
                               text=True).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    folders = sorted({"/".join(line[3:].split("/")[:2]) for line in dirty})
    return head + (f" (with uncommitted changes in {', '.join(folders)})" if folders else "")


def measured_at(with_machine: bool = True) -> str:
    """When, at which commit and (``with_machine``) on which CPU a section was measured:
    ``2026-12-04 23:29 UTC at commit 6f633fe on AMD EPYC, 2 cores, avx2, fma``."""
    return f"{utc_stamp()} at commit {commit()}" + (f" on {machine()}" if with_machine else "")
