"""Build, load and call the native CPU decode kernel (C++ source in :mod:`kvarn.kernels.cpu_native_src`).

The library is compiled on first use with the system C++ compiler (``g++``/``c++``, about 3 s)
into ``<kvarn cache>/native/kvarn_cpu_<hash>.so``, keyed by the source, the flags and the CPU, and
loaded with ``ctypes`` (no Python headers, no torch headers: nothing to rebuild when they change).
``python -m kvarn.kernels.cpu_native`` builds it ahead of time. It links OpenMP by soname, so in a
process that imported torch it shares torch's OpenMP runtime and thread count.
Without a compiler, or if the build fails, :func:`library` returns None (logged once) and the
ops use the vectorized torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvarn.codec.tiles import layout
from kvarn.kernels._checks import KernelArgumentError, log8_table, rotation
from kvarn.kernels.cpu_args import CPU, Paged, check_indices
from kvarn.kernels.cpu_native_src import SOURCE
from kvarn.schemes.scheme import Scheme

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC")
NATIVE_FLAGS = ("-march=native",)  # retried without when the compiler refuses it
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Args(ctypes.Structure):
    """Mirror of ``struct Args`` in the C++ source (every field 8 bytes, same order)."""

    _fields_ = [
        *((n, _I) for n in ("B", "H", "G", "D", "T", "KB", "VB", "LOG8", "SPLIT_TILES", "NTHREADS")),
        *((n, _I) for n in ("KC", "VC", "KS", "KO", "KF", "VS", "VO", "VF", "DTYPE", "SINK_TOKENS", "SINK_CAP")),
        *((n, _I) for n in ("NUM_BLOCKS", "BT_WIDTH", "TAIL_SLOTS", "SINK_SLOTS")),
        ("cache", _P), ("cache_sb", _I), ("cache_sh", _I), ("block_table", _P), ("bt_sb", _I), ("num_tiles", _P),
        ("q", _P), ("q_sb", _I), ("q_sh", _I),
        ("tail_k", _P), ("tail_v", _P), ("tail_ss", _I), ("tail_sh", _I), ("tail_st", _I),
        ("tail_slot", _P), ("tail_lens", _P),
        ("sink_k", _P), ("sink_v", _P), ("sink_ss", _I), ("sink_sh", _I), ("sink_st", _I),
        ("sink_slot", _P), ("sink_lens", _P),
        ("rot", _P), ("rot_t", _P), ("lut", _P), ("scale", ctypes.c_double), ("out", _P), ("out_sb", _I), ("out_sh", _I),
    ]  # fmt: skip


def build_dir() -> Path:
    """Where built libraries live: ``native/`` under kvarn's cache directory."""
    from kvarn.models import default_cache_dir

    return default_cache_dir() / "native"


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


def _compile(compiler: str, target: Path) -> None:
    """Compile the source to ``target`` atomically (a temp file in the same folder, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "kvarn_cpu.cpp", Path(tmp) / target.name
        src.write_text(SOURCE)
        for extra in (NATIVE_FLAGS, ()):
            cmd = [compiler, *FLAGS, *extra, str(src), "-o", str(lib)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode == 0:
                os.replace(lib, target)
                return
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded native library, built on first use; None when it cannot be built (logged once)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("kvarn: no C++ compiler (g++/c++) found; CPU attention uses the slower torch path")
        return None
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, *NATIVE_FLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    target = build_dir() / f"kvarn_cpu_{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as e:
        log.warning("kvarn: building the native CPU kernel failed (%s); CPU attention uses the torch path", e)
        return None
    lib.kvarn_decode.argtypes = [ctypes.POINTER(_Args)]
    lib.kvarn_decode.restype = ctypes.c_int
    lib.kvarn_store.argtypes = [ctypes.c_void_p]  # a StoreArgs (kvarn.kernels.cpu_store)
    lib.kvarn_store.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=16)
def _rotations(kind: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``R`` and ``R^T``, ``[D, D]`` float32 contiguous (kept alive by the cache)."""
    r = rotation(kind, head_dim, CPU)
    return r, r.T.contiguous()


# Tiles per decode task. Fixed, so that a sequence's tiles are split and merged the same way in any
# batch and with any thread count: decode is batch-invariant, and a token verified in a speculative
# step (or recomputed) reads the same bits as when it is decoded alone.
SPLIT_TILES = 8


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


# what an error code of kvarn_decode's index check means
_INDEX_ERRORS = {
    1: "num_tiles must be in 0..block_table.shape[1]",
    2: "block_table[b, :num_tiles[b]] must hold block ids in 0..num_blocks-1",
    3: "tail_lens must be in 0..group_size",
    4: "tail_slot must hold indices into the staging pool",
    5: "sink_slot must hold indices into the sink pool",
}


@functools.lru_cache(maxsize=64)
def _static_args(scheme: Scheme, d: int, dtype: torch.dtype, sink_cap: int) -> _Args:
    """The fields of ``_Args`` fixed by the scheme, head_dim and dtype (copied per call)."""
    lay = layout(scheme, d)
    a = _Args()
    a.D, a.T, a.KB, a.VB, a.LOG8 = (
        d,
        scheme.group_size,
        scheme.key_bits,
        scheme.value_bits,
        scheme.scale_dtype == "log8",
    )
    a.KC, a.VC, a.KS, a.KO, a.KF = lay.key_codes, lay.value_codes, lay.key_scale, lay.key_offset, lay.key_factor
    a.VS, a.VO, a.VF = lay.value_scale, lay.value_offset, lay.value_factor
    a.DTYPE, a.SINK_TOKENS, a.SINK_CAP = _DTYPES[dtype], scheme.sink_tokens, sink_cap
    if scheme.rotation != "none":
        a.rot, a.rot_t = (m.data_ptr() for m in _rotations(scheme.rotation, d))
    a.lut = log8_table(CPU).data_ptr()
    return a


@dataclass
class Prepared:
    """A decode call's arguments except the query and output (``prepare``), for ``run``.

    ``keep`` holds every tensor whose pointer is in ``args`` (converted index tensors included).
    """

    args: _Args
    keep: list[torch.Tensor]
    paged: Paged
    block_table: torch.Tensor
    num_tiles: torch.Tensor
    copies: bool  # some index tensor was converted to int32: the args point at a copy made now


def prepare(p: Paged, query: torch.Tensor, block_table: torch.Tensor, num_tiles: torch.Tensor) -> Prepared | None:
    """The native call's arguments for these tensors; None when the library is missing or the
    tensors do not fit it (mixed dtypes, different strides of keys and values)."""
    lib = library()
    dtype = query.dtype
    sink = p.sink_k is not None and p.sink_v is not None and p.sink_lens is not None
    rows = [(p.tail_k, p.tail_v)] + ([(p.sink_k, p.sink_v)] if sink else [])
    if lib is None or any(k is None or v is None or k.dtype != dtype or k.stride() != v.stride() for k, v in rows):
        return None
    bsz, hq, d = query.shape
    h = p.cache.shape[1]
    a = _Args.from_buffer_copy(_static_args(p.scheme, d, dtype, p.sink_k.shape[2] if p.sink_k is not None else 0))
    threads = torch.get_num_threads()
    a.B, a.H, a.G, a.SPLIT_TILES, a.NTHREADS = bsz, h, hq // h, SPLIT_TILES, threads
    given = [block_table, num_tiles, p.tail_lens]
    keep = [_i32(block_table), _i32(num_tiles), _i32(p.tail_lens)]
    a.NUM_BLOCKS, a.BT_WIDTH, a.TAIL_SLOTS = p.cache.shape[0], block_table.shape[1], p.tail_k.shape[0]
    a.cache, a.cache_sb, a.cache_sh = p.cache.data_ptr(), p.cache.stride(0), p.cache.stride(1)
    a.block_table, a.bt_sb, a.num_tiles = keep[0].data_ptr(), keep[0].stride(0), keep[1].data_ptr()
    a.tail_k, a.tail_v, a.tail_lens = p.tail_k.data_ptr(), p.tail_v.data_ptr(), keep[2].data_ptr()
    a.tail_ss, a.tail_sh, a.tail_st = p.tail_k.stride()[:3]
    if p.tail_slot is not None:
        given.append(p.tail_slot)
        keep.append(_i32(p.tail_slot))
        a.tail_slot = keep[-1].data_ptr()
    if p.sink_k is not None and p.sink_v is not None and p.sink_lens is not None:
        given.append(p.sink_lens)
        keep.append(_i32(p.sink_lens))
        a.sink_k, a.sink_v, a.sink_lens = p.sink_k.data_ptr(), p.sink_v.data_ptr(), keep[-1].data_ptr()
        a.sink_ss, a.sink_sh, a.sink_st = p.sink_k.stride()[:3]
        a.SINK_SLOTS = p.sink_k.shape[0]
        if p.sink_slot is not None:
            given.append(p.sink_slot)
            keep.append(_i32(p.sink_slot))
            a.sink_slot = keep[-1].data_ptr()
    a.scale = p.sm_scale
    copies = any(k is not g for k, g in zip(keep, given, strict=True))
    return Prepared(a, keep, p, block_table, num_tiles, copies)


def run(prep: Prepared, query: torch.Tensor, out: torch.Tensor) -> None:
    """Native decode of ``query`` ``[B, Hq, D]`` (the shape and dtype ``prep`` was made for) into ``out``.

    Raises:
        KernelArgumentError: an index out of range (checked by the kernel before it reads anything).
    """
    lib = library()
    assert lib is not None  # prepare() returned None without it
    a = prep.args
    dst = out if out.dtype == query.dtype and out.stride(-1) == 1 else torch.empty_like(query)
    a.q, a.q_sb, a.q_sh = query.data_ptr(), query.stride(0), query.stride(1)
    a.out, a.out_sb, a.out_sh = dst.data_ptr(), dst.stride(0), dst.stride(1)
    bad = lib.kvarn_decode(ctypes.byref(a))
    if bad:  # the host checks name the values; the kernel's code says which check failed
        check_indices(prep.paged, prep.block_table, prep.num_tiles)
        raise KernelArgumentError(_INDEX_ERRORS[bad])
    if dst is not out:
        out.copy_(dst)


def decode(
    p: Paged, query: torch.Tensor, block_table: torch.Tensor, num_tiles: torch.Tensor, out: torch.Tensor
) -> bool:
    """Native decode into ``out`` ``[B, Hq, D]``; False (nothing written) when the library is missing
    or the tensors do not fit it (mixed dtypes, different strides of keys and values).

    Raises:
        KernelArgumentError: an index out of range (checked by the kernel before it reads anything).
    """
    prep = prepare(p, query, block_table, num_tiles)
    if prep is None:
        return False
    run(prep, query, out)
    return True


# Decode calls of a layer seen before. vLLM calls every layer with the same staging and sink pools
# and cache pages each step, and all layers of a step with the same index tensors: the arguments a
# layer fixes are checked and marshalled once (``remember``), and a later call with the same layer
# key checks and sets only the step's index tensors, the query and the output (``decode_again``).
# Measured at SmolLM2 shapes (4 requests, 1 thread): 88 -> 48 us per call, of which 22 us in C.
_LAYERS: dict[tuple[object, ...], _Args] = {}
_MAX_LAYERS = 512


def _tensor_key(t: torch.Tensor | None) -> tuple[object, ...] | None:
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def layer_key(
    query: torch.Tensor,
    cache: torch.Tensor,
    rows: tuple[torch.Tensor | None, ...],
    optional: tuple[torch.Tensor | None, ...],
    scheme: Scheme,
    sm_scale: float | None,
) -> tuple[object, ...]:
    """What a layer's prepared arguments depend on: memory and layout of the cache and the staging
    and sink pools (``rows``), the query's shape and dtype, which optional index tensors are given,
    the scheme, the scale and the thread count."""
    return (
        scheme, sm_scale, query.shape, query.dtype, torch.get_num_threads(), _tensor_key(cache),
        *(_tensor_key(t) for t in rows), *(t is None for t in optional),
    )  # fmt: skip


def remember(key: tuple[object, ...], prep: Prepared) -> None:
    """Keep ``prep``'s arguments for :func:`decode_again` (not when an index tensor had to be converted)."""
    if prep.copies:
        return
    if len(_LAYERS) >= _MAX_LAYERS:
        _LAYERS.clear()
    _LAYERS[key] = _Args.from_buffer_copy(prep.args)


def _index_ok(t: torch.Tensor | None, bsz: int) -> bool:
    return t is None or (t.dtype == torch.int32 and t.shape == (bsz,) and t.is_cpu and t.is_contiguous())


def decode_again(
    key: tuple[object, ...],
    query: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    tail_lens: torch.Tensor,
    tail_slot: torch.Tensor | None,
    sink_lens: torch.Tensor | None,
    sink_slot: torch.Tensor | None,
    out: torch.Tensor,
) -> bool:
    """Native decode with a remembered layer's arguments; False (nothing done) when the layer is
    not remembered or a step tensor, the query or the output does not fit the fast path (the full
    path then checks everything and names what is wrong). An index out of range: False as well."""
    template = _LAYERS.get(key)
    if template is None:
        return False
    bsz = query.shape[0]
    if not (
        block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == bsz
        and block_table.is_cpu and block_table.stride(1) == 1
        and all(_index_ok(t, bsz) for t in (num_tiles, tail_lens, tail_slot, sink_lens, sink_slot))
        and query.is_cpu and query.stride(-1) == 1
        and out.dtype == query.dtype and out.shape == query.shape and out.is_cpu and out.stride(-1) == 1
    ):  # fmt: skip
        return False
    lib = library()
    assert lib is not None  # a layer is only remembered after a native call
    a = _Args.from_buffer_copy(template)
    a.block_table, a.bt_sb, a.BT_WIDTH = block_table.data_ptr(), block_table.stride(0), block_table.shape[1]
    a.num_tiles, a.tail_lens = num_tiles.data_ptr(), tail_lens.data_ptr()
    if tail_slot is not None:
        a.tail_slot = tail_slot.data_ptr()
    if sink_lens is not None:
        a.sink_lens = sink_lens.data_ptr()
    if sink_slot is not None:
        a.sink_slot = sink_slot.data_ptr()
    a.q, a.q_sb, a.q_sh = query.data_ptr(), query.stride(0), query.stride(1)
    a.out, a.out_sb, a.out_sh = out.data_ptr(), out.stride(0), out.stride(1)
    return bool(lib.kvarn_decode(ctypes.byref(a)) == 0)


if __name__ == "__main__":
    lib = library()
    print(f"built: {build_dir()}" if lib is not None else "no native CPU kernel (see the warning above)")
