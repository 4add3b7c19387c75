"""Store full tiles into the paged cache on the CPU: :func:`store_tiles`, and the same store as a
drop-in for the reference codec's ``quantize_tiles`` (:func:`quantize_tiles_cpu`).

The native path (``store.cpp``, built by :mod:`.native`) rotates in torch with the reference's own
call, then encodes each side of each tile in one OpenMP task, following
:func:`kvarn.codec.tiles._encode_side` step for step: every Sinkhorn iterate 0..ITERS, fp16 or log8
storage of factors, scales and zero points, ``floor(x + 0.5)`` rounding, the iterate with the least
squared error, bit-plane packing. Element-wise float32 operations are the reference's, one for one
(divisions stay divisions; no fused multiply-add contraction). Where the reference's rounding
cannot be reproduced without torch's own vector math library the native code is as exact or more:
``exp``/``log`` through double precision rounded once, standard deviations and squared errors
summed in double; the Sinkhorn means follow torch's float32 summation order. One deliberate change
for speed: the Sinkhorn step's ``exp(-log_r - log_c)`` is taken as ``exp(-log_r) * exp(-log_c)``
(``T + D`` exponentials per step instead of ``T * D``). So records are byte-identical to the
reference for most tiles and otherwise differ where a stored factor or scale rounds to the
neighbouring fp16 value (or log8 code), or where two iterates' errors nearly tie. Speed against
the reference codec: ``docs/cpu_serving.md``. Without the extension, ``impl="auto"`` runs the
reference codec (:func:`kvarn.codec.quantize_tiles`) and scatters its records.
"""

from __future__ import annotations

import torch

from kvarn.codec import quantize_tiles
from kvarn.codec.rotation import rotate
from kvarn.kernels._checks import KernelArgumentError, check_store, log8_table, refuse_non_finite
from kvarn.kernels.cpu import native
from kvarn.kernels.cpu._checks import CPU
from kvarn.schemes.scheme import Scheme

__all__ = ["quantize_tiles_cpu", "store_tiles"]

IMPLS = ("auto", "native", "reference")


def store_tiles(
    keys: torch.Tensor,
    values: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    scheme: Scheme,
    *,
    check_finite: bool = False,
    impl: str = "auto",
) -> None:
    """Quantize and pack full tiles into the paged cache, in place, on the CPU.

    Args:
        keys: ``[N, num_kv_heads, group_size, head_dim]`` fp16/bf16/fp32, unrotated; any strides.
        values: same shape and dtype as ``keys``.
        cache: ``[num_blocks, num_kv_heads, tile_bytes]`` uint8 with a contiguous last axis (a page
            view ``pages[:, :, :tile_bytes]`` is fine); record ``cache[block_ids[n], h]`` is
            overwritten with the record of tile ``n``, head ``h``.
        block_ids: ``[N]`` int32/int64 destination blocks, distinct.
        scheme: a scheme without per-layer overrides.
        check_finite: refuse inf/NaN like the reference codec.
        impl: ``auto`` (native when the library builds, else the reference codec), ``native``
            (error without it) or ``reference``.

    Records match :func:`kvarn.codec.quantize_tiles` byte for byte for most tiles; the rest differ
    by one fp16 step (or log8 code) in a factor, scale or zero point, or pick a neighbouring
    Sinkhorn iterate whose error ties the reference's within float32 rounding (module doc).
    """
    if impl not in IMPLS:
        raise KernelArgumentError(f"impl={impl!r} is not one of: {', '.join(IMPLS)}")
    n, h, t, d = check_store(keys, values, cache, block_ids, scheme, CPU, any_strides=True)
    if n == 0:
        return
    ids = block_ids.to(torch.int64).contiguous()
    if int(ids.min()) < 0 or int(ids.max()) >= cache.shape[0]:
        raise KernelArgumentError(f"block_ids must be block ids in 0..{cache.shape[0] - 1}, got {block_ids.tolist()}")
    if check_finite:
        refuse_non_finite(keys, values)
    ext = native.extension() if impl != "reference" else None
    if ext is None:
        if impl == "native":
            raise KernelArgumentError("impl='native': the native CPU library is not built (see the warning logged)")
        rec = quantize_tiles(keys.reshape(n * h, t, d), values.reshape(n * h, t, d), scheme)
        cache[ids] = rec.view(n, h, scheme.tile_bytes(d))
        return
    # the reference's own rotation call, on the same [tiles, T, D] shape: same float32 results
    kr = rotate(keys.reshape(n * h, t, d), scheme.rotation).contiguous()
    vr = rotate(values.reshape(n * h, t, d), scheme.rotation).contiguous()
    ext.store(kr, vr, cache, ids, log8_table(CPU), native.store_record(scheme, d), torch.get_num_threads())


def quantize_tiles_cpu(keys: torch.Tensor, values: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Drop-in for :func:`kvarn.codec.quantize_tiles` on the CPU: ``[N, T, D]`` keys and values ->
    ``[N, tile_bytes]`` uint8 records, through the native store (records as :func:`store_tiles`
    documents them; the reference codec without a compiler). Refuses inf/NaN like the codec."""
    if keys.dim() != 3 or keys.shape != values.shape:
        raise KernelArgumentError(
            f"keys and values must both be [tiles, {scheme.group_size}, head_dim], "
            f"got {list(keys.shape)} and {list(values.shape)}"
        )
    n, _, d = keys.shape
    cache = torch.empty(n, 1, scheme.tile_bytes(d), dtype=torch.uint8)
    store_tiles(keys[:, None], values[:, None], cache, torch.arange(n), scheme, check_finite=True)
    return cache[:, 0]
