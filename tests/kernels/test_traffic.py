"""Bytes a decode step moves (computed from the launch arguments, not launched): issue #10's target."""

from __future__ import annotations

import torch

from kvarn.kernels.triton import choose_num_splits, decode_bytes

from ._reference import named

# Llama-3-8B attention: 8 KV heads, 32 query heads, head_dim 128
KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128


def test_long_context_decode_moves_at_most_1_1x_the_packed_records() -> None:
    s = named("kvarn_k4v2_g128", sink_tokens=1)
    lens = [32 * 1024 + 127] * 32  # 32K context, batch 32, a nearly full tail each (the worst case)
    splits = choose_num_splits(32, KV_HEADS, 32 * 1024 // 128 + 1, torch.device("cpu"))
    b = decode_bytes(s, lens, KV_HEADS, Q_HEADS, HEAD_DIM, splits)
    assert b.records == 32 * 256 * KV_HEADS * s.tile_bytes(HEAD_DIM)
    assert b.tails == 32 * 127 * KV_HEADS * HEAD_DIM * 2 * 2 and b.sinks == 32 * KV_HEADS * HEAD_DIM * 2 * 2
    assert b.overhead <= 1.1  # computed: 1.022


def test_small_batch_split_k_still_within_1_1x() -> None:
    """One sequence: split-K partials (float32, written and read back) are the extra bytes."""
    s = named("kvarn_k4v2_g128")
    splits = choose_num_splits(1, KV_HEADS, 257, torch.device("cpu"))
    b = decode_bytes(s, [32 * 1024 + 5], KV_HEADS, Q_HEADS, HEAD_DIM, splits)
    assert splits > 1 and b.partials == 2 * Q_HEADS * (splits * (HEAD_DIM + 2) + 2 * HEAD_DIM) * 4
    assert b.overhead <= 1.1


def test_short_contexts_are_dominated_by_staging() -> None:
    """The bound is for long contexts: at 200 tokens the fp16 tail weighs as much as the records."""
    b = decode_bytes(named("kvarn_k4v2_g128"), [200] * 8, KV_HEADS, Q_HEADS, HEAD_DIM)
    assert b.tails > 0.5 * b.records and b.overhead > 1.5
