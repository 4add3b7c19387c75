"""Fused paged decode attention vs float64 attention over the reference-dequantized context.

Tolerance: SQNR >= 40 dB against the oracle (the interpreter, computing in float32, reaches well
above 100 dB; on a GPU tf32 matrix products bring it to roughly 60 dB).
"""

from __future__ import annotations

import pytest
import torch

from kvarn.codec import dequantize_tiles
from kvarn.kernels import KernelArgumentError, PagedContext, split_lengths
from kvarn.kernels.triton import choose_num_splits, decode_attention
from kvarn.schemes import BUILTINS, Scheme

from ._reference import DEVICE, PagedBatch, attention, decode_reference, named, paged_batch, sqnr_db

MIN_SQNR_DB = 40.0


def _run(scheme: Scheme, pb: PagedBatch, q: torch.Tensor, num_splits: int | None) -> torch.Tensor:
    return decode_attention(q, pb.context(scheme), num_splits=num_splits)


def _check(
    scheme: Scheme, lens: list[int], hkv: int, group: int, d: int, num_splits: int | None, seed: int = 0
) -> None:
    pb = paged_batch(scheme, lens, hkv, d, seed=seed)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    out = _run(scheme, pb, q, num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert sqnr_db(decode_reference(pb, q), out.cpu()) >= MIN_SQNR_DB


@pytest.mark.parametrize("name", list(BUILTINS))
def test_decode_every_builtin_mixed_lengths(name: str) -> None:
    t = BUILTINS[name].group_size
    _check(BUILTINS[name], [2 * t + 5, t, 3], hkv=1, group=2, d=64, num_splits=1)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_head_dims_gqa_and_split_k(d: int, group: int, splits: int) -> None:
    scheme = named("kvarn_k4v2_g32")
    # one context ends mid-tile, one exactly on a tile boundary, one is tail only
    _check(scheme, [4 * 32 + 17, 3 * 32, 9], hkv=2, group=group, d=d, num_splits=splits, seed=d + group)


@pytest.mark.parametrize("name", ["kvarn_k4v2_g32_s8_sink", "kvarn_k3v4_g32_rot-rh", "kvarn_k2v3_g32_rot-none_it0"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sink_rotations_and_options(name: str, splits: int) -> None:
    _check(named(name), [6 * 32 + 40, 32 + 1, 20], hkv=1, group=3, d=64, num_splits=splits)


@pytest.mark.parametrize(
    "name", ["kvarn_k4v2_g32_sink2", "kvarn_k3v2_g32_rot-rh_s8_sink8", "kvarn_k2v4_g64_rot-none_sink1"]
)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_sink_tokens_read_exact_copies(name: str, splits: int) -> None:
    t = named(name).group_size
    # four tiles and a tail (split-K: tile 0 in split 0), exactly one tile and no tail, tail only
    # shorter and longer than the sink (copies ignored)
    _check(named(name), [4 * t + 5, t, 1, 20], hkv=2, group=3, d=64, num_splits=splits)


def test_decode_sink_tokens_differ_from_reading_tile_0_quantized() -> None:
    """The oracle check can fail: dequantized tile-0 tokens instead of the copies are far off."""
    scheme = named("kvarn_k4v2_g32_sink2")
    pb = paged_batch(scheme, [2 * 32 + 3], 1, 64)
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = _run(scheme, pb, q, 1).cpu()
    dk, dv = dequantize_tiles(pb.cache[pb.block_table[0, :1].long()].view(1, -1).cpu(), scheme, 64)
    quant_k, quant_v = pb.context_k[0].clone(), pb.context_v[0].clone()
    quant_k[:, :32], quant_v[:, :32] = dk, dv
    assert sqnr_db(attention(q, pb.context_k[0], pb.context_v[0]), out) >= MIN_SQNR_DB
    assert sqnr_db(attention(q, quant_k, quant_v), out) < 20.0  # measured: 8.5 dB


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_sink_lens_are_clamped_and_ignored_without_tiles(splits: int) -> None:
    """``sink_lens`` above ``sink_tokens`` count as ``sink_tokens``; without a packed tile as 0."""
    scheme = named("kvarn_k4v2_g32_sink2")
    pb = paged_batch(scheme, [3 * 32 + 1, 32, 7], 1, 64)
    q = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    exact = _run(scheme, pb, q, splits)
    assert pb.sink_lens is not None and pb.sink_lens.tolist() == [2, 2, 0]
    pb.sink_lens = torch.full_like(pb.sink_lens, 32)  # the sink rows past 2 hold other random tokens
    assert torch.equal(_run(scheme, pb, q, splits), exact)


def test_split_k_is_chosen_automatically_for_long_contexts_and_small_batches() -> None:
    dev = torch.device("cpu")
    assert choose_num_splits(batch=1, num_kv_heads=2, max_tiles=64, device=dev) > 1
    assert choose_num_splits(batch=128, num_kv_heads=8, max_tiles=1024, device=dev) == 1
    assert choose_num_splits(batch=1, num_kv_heads=1, max_tiles=4, device=dev) == 1
    scheme = named("kvarn_k4v4_g32")
    assert choose_num_splits(1, 1, 10, DEVICE) > 1  # block table of 10 columns below: split path
    _check(scheme, [8 * 32 + 3], hkv=1, group=4, d=64, num_splits=None)


def test_split_lengths() -> None:
    lens = torch.tensor([0, 5, 64, 64 + 31, 3 * 64])
    tiles, tails, sinks = split_lengths(lens, named("kvarn_k4v2_g64_sink0"))
    assert sinks is None and tiles.tolist() == [0, 0, 1, 1, 3] and tails.tolist() == [0, 5, 0, 31, 0]
    tiles, tails, sinks = split_lengths(lens, named("kvarn_k4v2_g64_sink"))
    assert sinks is not None and sinks.tolist() == [0, 5, 64, 64, 64]
    assert tiles.tolist() == [0, 0, 0, 0, 2] and tails.tolist() == [0, 0, 0, 31, 0]
    tiles, tails, sinks = split_lengths(lens, named("kvarn_k4v2_g64_sink8"))
    assert sinks is not None and sinks.dtype == torch.int32 and sinks.tolist() == [0, 0, 8, 8, 8]
    assert tiles.tolist() == [0, 0, 1, 1, 3] and tails.tolist() == [0, 5, 0, 31, 0]


def test_decode_fp16_query_and_tail() -> None:
    scheme = named("kvarn_k4v2_g32")
    pb = paged_batch(scheme, [3 * 32 + 7], 1, 64)
    pb.tail_k, pb.tail_v = pb.tail_k.half(), pb.tail_v.half()
    q = torch.randn(1, 2, 64).half().to(DEVICE)
    out = _run(scheme, pb, q, 2)
    ref = attention(q.float(), pb.context_k[0], pb.context_v[0])
    assert out.dtype == torch.float16 and sqnr_db(ref, out.float().cpu()) >= MIN_SQNR_DB


def test_decode_rejects_bad_arguments() -> None:
    scheme = named("kvarn_k4v2_g32_sink0")
    pb = paged_batch(scheme, [40], 2, 64)
    q = torch.randn(1, 6, 64, device=DEVICE)
    with pytest.raises(KernelArgumentError, match="multiple of num_kv_heads"):
        _run(scheme, pb, q[:, :5], 1)
    with pytest.raises(KernelArgumentError, match="block_table dtype torch.int64"):
        decode_attention(
            q, PagedContext(pb.cache, pb.block_table.long(), pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens, scheme)
        )
    with pytest.raises(KernelArgumentError, match="keeps a sink tile"):
        _run(named("kvarn_k4v2_g32_sink"), pb, q, 1)
    with pytest.raises(KernelArgumentError, match="cache must have shape"):
        _run(named("kvarn_k4v4_g32"), pb, q, 1)


def test_decode_sink_tokens_require_sink_arguments() -> None:
    scheme = named("kvarn_k4v2_g32_sink2")
    pb = paged_batch(scheme, [40], 2, 64)
    q = torch.randn(1, 4, 64, device=DEVICE)
    args = (q, pb.cache, pb.block_table, pb.num_tiles, pb.tail_k, pb.tail_v, pb.tail_lens, scheme)
    with pytest.raises(KernelArgumentError, match="keeps its first 2 tokens exactly: pass sink_k"):
        decode_attention(args[0], PagedContext(*args[1:]))
    with pytest.raises(KernelArgumentError, match="go together"):
        decode_attention(args[0], PagedContext(*args[1:], sink_k=pb.sink_k, sink_v=pb.sink_v))
    assert pb.sink_k is not None
    with pytest.raises(KernelArgumentError, match="sink_v must have shape"):
        decode_attention(
            args[0], PagedContext(*args[1:], sink_k=pb.sink_k[:, :, :2], sink_v=pb.sink_v, sink_lens=pb.sink_lens)
        )
    with pytest.raises(KernelArgumentError, match="sink_k holds 1 tokens per slot"):
        decode_attention(
            args[0],
            PagedContext(*args[1:], sink_k=pb.sink_k[:, :, :1], sink_v=pb.sink_v[:, :, :1], sink_lens=pb.sink_lens),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v2_g128_sink4"])
@pytest.mark.parametrize("splits", [1, None])
def test_decode_full_size_on_gpu(name: str, splits: int | None) -> None:
    _check(named(name), [40 * 128 + 77, 128, 5], hkv=8, group=4, d=128, num_splits=splits)
