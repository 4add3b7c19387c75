"""Build, load and call the native CPU kernels (``decode.cpp``, ``store.cpp``, ``dequant.cpp``, bound by
``bind.cpp``).

The extension is built on first use by :func:`torch.utils.cpp_extension.load` (ninja and the system
C++ compiler) with ``-O3 -march=native`` and OpenMP, retried without ``-march=native`` when the
compiler refuses it, into ``torch_extensions/<name>`` under kvarn's cache directory; the name is
keyed by the sources, the flags and the CPU, so a build is reused until one of them changes.
``python -m kvarn.kernels.cpu.native`` builds it ahead of time. Without a compiler, or if the
build fails, :func:`extension` returns None (logged once) and the ops take the torch
path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import shutil
from pathlib import Path
from types import ModuleType

import torch

from kvarn.codec.rotation import rotation_signs
from kvarn.codec.tiles import layout
from kvarn.kernels._checks import KernelArgumentError, log8_table, rotation
from kvarn.kernels.api import PagedContext
from kvarn.kernels.cpu._checks import CPU, check_indices
from kvarn.schemes.scheme import Scheme

log = logging.getLogger(__name__)

SOURCES = ("bind.cpp", "decode.cpp", "dequant.cpp", "store.cpp")
HEADERS = ("attend.h", "half.h", "kernels.h", "vec.h")
FLAGS = ("-O3", "-fopenmp")
NATIVE_FLAGS = ("-march=native",)  # retried without when the compiler refuses it

# Tiles per decode task. Fixed, so that a sequence's tiles are split and merged the same way in any
# batch and with any thread count: decode is batch-invariant, and a token verified in a speculative
# step (or recomputed) reads the same bits as when it is decoded alone.
SPLIT_TILES = 8

# what an error code of the decode kernel's index check means
INDEX_ERRORS = {
    1: "num_tiles must be in 0..block_table.shape[1]",
    2: "block_table[b, :num_tiles[b]] must hold block ids in 0..num_blocks-1",
    3: "tail_lens must be in 0..group_size",
    4: "tail_slot must hold indices into the tail tiles",
    5: "sink_slot must hold indices into the sink pool",
}


def build_dir() -> Path:
    """Where builds live: ``torch_extensions/`` under kvarn's cache directory."""
    from kvarn.models import default_cache_dir

    return default_cache_dir() / "torch_extensions"


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


def _build(flags: tuple[str, ...]) -> ModuleType:
    here = Path(__file__).parent
    text = "\0".join((here / f).read_text() for f in (*SOURCES, *HEADERS))
    # the sources' folder is part of the key: ninja rebuilds a folder whose sources lie elsewhere, so two
    # checkouts with the same sources would otherwise rebuild each other's extension on every load
    parts = [str(here.resolve()), text, *flags, torch.__version__, _cpu_key()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    name = f"kvarn_cpu_{key}"
    target = build_dir() / name
    target.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    module: ModuleType = cpp_extension.load(
        name=name,
        sources=[str(here / f) for f in SOURCES],
        extra_cflags=list(flags),
        extra_ldflags=["-fopenmp"],
        build_directory=str(target),
        verbose=False,
    )
    return module


@functools.lru_cache(maxsize=1)
def extension() -> ModuleType | None:
    """The loaded extension, built on first use; None when it cannot be built (logged once)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        log.warning("kvarn: no C++ compiler (g++/c++) found; CPU attention uses the slower torch path")
        return None
    error: Exception | None = None
    for extra in (NATIVE_FLAGS, ()):
        try:
            return _build((*FLAGS, *extra))
        except (OSError, RuntimeError, ImportError) as e:  # a failed build raises RuntimeError
            error = e
    log.warning("kvarn: building the native CPU kernel failed (%s); CPU attention uses the torch path", error)
    return None


@functools.lru_cache(maxsize=64)
def decode_record(scheme: Scheme, d: int) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """The decode kernel's scheme fields (``bind.cpp``: T, KB, VB, LOG8, SINK_TOKENS, the section
    offsets) and ``R``, ``R^T`` ``[D, D]`` float32 contiguous (None without rotation)."""
    lay = layout(scheme, d)
    fields = [scheme.group_size, scheme.key_bits, scheme.value_bits, int(scheme.scale_dtype == "log8")]
    fields += [scheme.sink_tokens, lay.key_codes, lay.value_codes, lay.key_scale, lay.key_offset, lay.key_factor]
    fields += [lay.value_scale, lay.value_offset, lay.value_factor]
    if scheme.rotation == "none":
        return fields, None, None
    r = rotation(scheme.rotation, d, CPU)
    return fields, r, r.T.contiguous()


@functools.lru_cache(maxsize=64)
def store_record(scheme: Scheme, d: int) -> list[int]:
    """The store kernel's scheme fields (``bind.cpp``: KB, VB, LOG8, ITERS, the section offsets)."""
    lay = layout(scheme, d)
    fields = [scheme.key_bits, scheme.value_bits, int(scheme.scale_dtype == "log8"), scheme.norm_iters]
    fields += [lay.key_codes, lay.value_codes, lay.key_scale, lay.key_offset, lay.key_factor]
    return fields + [lay.value_scale, lay.value_offset, lay.value_factor]


def rotation_args(scheme: Scheme, d: int) -> tuple[int, torch.Tensor]:
    """The store's and dequantize's rotation arguments: (0 none / 1 Hadamard, signs [D] float32 or empty)."""
    if scheme.rotation == "none":
        return 0, _NO_SIGNS
    return 1, _NO_SIGNS if scheme.rotation == "hadamard" else rotation_signs(scheme.rotation, d)


_NO_SIGNS = torch.empty(0)


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def decode(query: torch.Tensor, ctx: PagedContext, out: torch.Tensor) -> bool:
    """Native decode of ``query`` ``[B, Hq, D]`` over ``ctx`` (checked by the caller) into ``out``;
    False (nothing written) when the extension is missing or the tensors do not fit it (staged rows
    in another dtype than the query's, keys and values with different strides).

    Raises:
        KernelArgumentError: an index out of range (checked by the kernel before it reads anything).
    """
    ext = extension()
    if ext is None:
        return False
    dtype = query.dtype
    sink = ctx.sink_k is not None and ctx.sink_v is not None and ctx.sink_lens is not None
    rows = [(ctx.tail_k, ctx.tail_v), (ctx.sink_k, ctx.sink_v)] if sink else [(ctx.tail_k, ctx.tail_v)]
    if any(k is None or v is None or k.dtype != dtype or k.stride() != v.stride() for k, v in rows):
        return False
    d = query.shape[2]
    fields, rot, rot_t = decode_record(ctx.scheme, d)
    dst = out if out.dtype == dtype and out.stride(-1) == 1 else torch.empty_like(query)
    slots = [None if t is None else _i32(t) for t in (ctx.tail_slot, ctx.sink_slot)]
    sink_lens = _i32(ctx.sink_lens) if sink and ctx.sink_lens is not None else None
    bad = ext.decode(
        query, ctx.cache, _i32(ctx.block_table), _i32(ctx.num_tiles), ctx.tail_k, ctx.tail_v,
        _i32(ctx.tail_lens), slots[0], ctx.sink_k if sink else None, ctx.sink_v if sink else None, sink_lens,
        slots[1] if sink else None, rot, rot_t, log8_table(CPU), fields, ctx.sm_scale(d), SPLIT_TILES,
        torch.get_num_threads(), dst,
    )  # fmt: skip
    if bad:  # the host checks name the values; the kernel's code says which check failed
        check_indices(ctx)
        raise KernelArgumentError(INDEX_ERRORS[bad])
    if dst is not out:
        out.copy_(dst)
    return True


if __name__ == "__main__":
    built = extension()
    print(f"built under {build_dir()}" if built is not None else "no native CPU kernel (see the warning above)")
