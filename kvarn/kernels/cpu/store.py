"""Store full tiles into the paged cache on the CPU: :func:`store_tiles`, and the same store as a
drop-in for the reference codec's ``quantize_tiles`` (:func:`quantize_tiles_cpu`).

The native path (``store.cpp``, built by :mod:`.native`) reads the unrotated tiles where they lie
(any dtype of the three, any strides but a contiguous head_dim) and runs one OpenMP task per side
of each tile: the rotation as a fast Walsh-Hadamard transform, then the reference codec's algorithm
(:func:`kvarn.codec.tiles._encode_side`) in float32 vector arithmetic (16 lanes with AVX-512, 8
otherwise): every Sinkhorn iterate 0..ITERS, fp16 or log8 storage of factors, scales and zero
points, ``floor(x + 0.5)`` rounding, the iterate with the least squared error, bit-plane packing.
It computes in another order than torch does (sums in float32 along other axes, products by
reciprocals instead of divisions, fused multiply-adds, ``exp(-log_r) * exp(-log_c)`` for
``exp(-log_r - log_c)``), so its records follow the reference within a tolerance, asserted by the
tests (``assert_store_matches_reference`` in ``tests/kernels/test_cpu.py``):

* codes equal to the reference's for >= 99.9% of elements (>= 99.5% at 8 bits);
* in >= 90% of tile sides every factor, scale and zero point within two fp16 steps (or log8 codes);
  a side whose Sinkhorn iterates tie within rounding may pick another iterate;
* every tile side's squared reconstruction error within 0.2% of the reference's on tiles of
  ordinary spread; within 2% where a tile's token magnitudes span many decades (a rounding
  difference on a dominant token: ``docs/reliability.md``, the bound the fuzz tests assert).
  With log8 storage a Sinkhorn factor within float32 rounding of a rounding boundary may take the
  neighbouring code (9% apart) and the store keep another iterate: such a side's error is within
  the same tolerance of the reference's without normalization (iterate 0; the store keeps the
  iterate of least error).

Speed against the reference codec and the accuracy check of this tolerance: ``docs/cpu_serving.md``.
Without the extension, ``impl="auto"`` runs the reference codec (:func:`kvarn.codec.quantize_tiles`)
and scatters its records.
"""

from __future__ import annotations

import torch

from kvarn.codec import quantize_tiles
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

    Records follow :func:`kvarn.codec.quantize_tiles` within the tolerance of the module doc.
    """
    if impl not in IMPLS:
        raise KernelArgumentError(f"impl={impl!r} is not one of: {', '.join(IMPLS)}")
    n, h, t, d = check_store(keys, values, cache, block_ids, scheme, CPU, any_strides=True)
    if n == 0:
        return
    ids = block_ids.to(torch.int64).contiguous()
    if int(ids.min()) < 0 or int(ids.max()) >= cache.shape[0]:
        raise KernelArgumentError(f"block_ids must be block ids in 0..{cache.shape[0] - 1}, got {block_ids.tolist()}")
    ordered = ids.sort().values
    if bool((ordered[1:] == ordered[:-1]).any()):  # two tiles into one record: the store's tasks would race
        raise KernelArgumentError(f"block_ids must be distinct, got {block_ids.tolist()}")
    if check_finite:
        refuse_non_finite(keys, values)
    ext = native.extension() if impl != "reference" else None
    if ext is None:
        if impl == "native":
            raise KernelArgumentError("impl='native': the native CPU library is not built (see the warning logged)")
        rec = quantize_tiles(keys.reshape(n * h, t, d), values.reshape(n * h, t, d), scheme)
        cache[ids] = rec.view(n, h, scheme.tile_bytes(d))
        return
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    ext.store(
        keys,
        values,
        cache,
        ids,
        log8_table(CPU),
        native.store_record(scheme, d),
        *native.rotation_args(scheme, d),
        torch.get_num_threads(),
    )


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
