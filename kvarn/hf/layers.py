"""One layer of :class:`kvarn.hf.KVarNCache`: an unquantized tail, committed tokens, an optional sink.

Two kinds of sink (see :class:`kvarn.schemes.Scheme`): a *sink tile* (``sink_tokens``: the first
tokens never enter a tile; committed tiles start after them) and *exact sink tokens*
(``exact_tokens``: the first tokens are committed inside tile 0 like any other, and also kept
exactly; once tile 0 is committed, the exact copies are read in place of their decoded values).

Tokens arrive at the tail (model dtype). A committer moves the oldest tokens out of the tail once
enough have arrived: kvarn schemes commit whole tiles (``group_size`` tokens) into packed records,
baselines commit ``commit_tokens`` tokens at a time, keeping their ``window`` newest ones. The
keys and values attention reads are ``[sink | committed | tail]``, where ``committed`` is what the
stored bytes decode to: exactly what a server reads back.

What a chunk reads: the cache as it was stored before the chunk, followed by the chunk's own new
keys and values unquantized (they are committed right after, so the next chunk reads them as
stored). That is how a server's prefill attention treats a chunk (context from the cache, the new
tokens from registers) and how a decode step treats its own token; every spec gets the same
treatment. ``quantize_before_read=True`` instead commits first, so a chunk reads its own tokens
quantized once their tile is full (a server that writes the cache and then attends over all of
it); measured for comparison in docs/accuracy.md.

A sliding-window layer (``sliding_window=W``: a query at position ``p`` reads keys ``p-W+1..p``)
holds only what a later query can read, as transformers' ``DynamicSlidingWindowLayer`` does.
Unquantized, it keeps the last ``W-1`` tokens after each update, exactly like transformers. With a
committer, whole committed tiles (or commit groups) are dropped once every one of their tokens has
left the window, as a server frees the blocks behind a window; the attention mask hides the
tokens of a kept tile that are already outside it. :meth:`KVarNLayer.get_mask_sizes` reports the
absolute position of the first key returned (``kv_offset``), so the mask lines up.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvarn.hf.committers import BaselineCommitter, Committer, TileCommitter

__all__ = ["BaselineCommitter", "Committer", "KVarNLayer", "TileCommitter"]


def _empty(like: torch.Tensor) -> torch.Tensor:
    b, h, _, d = like.shape
    return like.new_zeros((b, h, 0, d))


class KVarNLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """The cache of one attention layer. Shapes: ``[batch, kv_heads, tokens, head_dim]``.

    Args:
        committer: how full groups of tokens are stored; None keeps the layer unquantized.
        sink_tokens: the first ``sink_tokens`` tokens stay unquantized (a scheme's sink tile).
        quantize_before_read: commit before returning (see the module docstring).
        exact_tokens: the first ``exact_tokens`` tokens are also kept exactly and read in place of
            their committed values (a scheme's ``sink_tokens``).
        sliding_window: the layer's window ``W`` (a sliding-window layer), or None (full attention).
        drop_unit: tokens are dropped behind the window in multiples of this (default: the
            committer's ``commit_tokens``, else 1). Every sliding layer of a cache must drop alike:
            transformers builds one sliding-window mask from the first sliding layer's sizes.

    Raises:
        ValueError: both kinds of sink; a sink on a sliding-window layer; a window below 1 token;
            a committer whose uncommitted tokens could outlast the window (baseline window >= W).
    """

    is_croppable = False

    def __init__(
        self,
        committer: Committer | None,
        sink_tokens: int = 0,
        quantize_before_read: bool = False,
        exact_tokens: int = 0,
        sliding_window: int | None = None,
        drop_unit: int | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if sink_tokens and exact_tokens:
            raise ValueError("a layer keeps a sink tile (sink_tokens) or exact sink tokens (exact_tokens), not both")
        if sliding_window is not None:
            if sliding_window < 1:
                raise ValueError(f"sliding_window={sliding_window}: a window holds at least 1 token")
            if sink_tokens or exact_tokens:
                raise ValueError("a sliding-window layer keeps no sink: its first tokens leave the window")
            if committer is not None and committer.window >= sliding_window:
                raise ValueError(
                    f"the committer keeps its {committer.window} newest tokens unquantized, not fewer than the "
                    f"window ({sliding_window} tokens): nothing it commits would be read"
                )
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.drop_unit = drop_unit or (committer.commit_tokens if committer is not None else 1)
        self.offset = 0  # absolute position of the first token held (earlier ones left the window)
        self.quantize_before_read = quantize_before_read
        self.committer = committer
        self.sink_tokens = sink_tokens
        self.exact_tokens = exact_tokens if committer is not None else 0
        self.length = 0
        self.sink_k = self.sink_v = self.done_k = self.done_v = self.tail_k = self.tail_v = torch.empty(0)
        self.exact_k = self.exact_v = torch.empty(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.sink_k, self.sink_v = _empty(key_states), _empty(value_states)
        self.done_k, self.done_v = _empty(key_states), _empty(value_states)  # committed: decoded bytes
        self.tail_k, self.tail_v = _empty(key_states), _empty(value_states)
        self.exact_k, self.exact_v = _empty(key_states), _empty(value_states)  # copies of the first tokens
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H, S, D]`` new keys/values, commit what is due, return all keys/values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.committer is None or self.quantize_before_read:
            self._append(key_states, value_states)
            out = self._all()
        else:
            old_k, old_v = self._all()
            self._append(key_states, value_states)
            out = torch.cat([old_k, key_states], dim=-2), torch.cat([old_v, value_states], dim=-2)
        self._drop_behind_window()
        return out

    def _drop_behind_window(self) -> None:
        """Forget whole drop units that no later query can read (the next query sits at ``length``)."""
        if self.sliding_window is None:
            return
        keep_from = max(0, self.length - self.sliding_window + 1)
        n = (keep_from // self.drop_unit) * self.drop_unit - self.offset
        if self.committer is None:
            n = min(n, self.tail_k.shape[-2])
            self.tail_k, self.tail_v = self.tail_k[:, :, max(n, 0) :], self.tail_v[:, :, max(n, 0) :]
        else:
            # only committed tokens are dropped; the window check in __init__ makes this cap never bind
            # (committed tokens end at or after keep_from's unit), so all sliding layers drop alike
            n = min(n, self.done_k.shape[-2])
            if n > 0:
                self.committer.drop(n, self.done_k[:, :, :n].numel() * 2)
                self.done_k, self.done_v = self.done_k[:, :, n:], self.done_v[:, :, n:]
        self.offset += max(n, 0)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add new tokens to the tail; move the first ones to the sink; commit what is due."""
        self.length += key_states.shape[-2]
        self.tail_k = torch.cat([self.tail_k, key_states], dim=-2)
        self.tail_v = torch.cat([self.tail_v, value_states], dim=-2)
        if self.committer is None:
            return
        wanted = self.exact_tokens - self.exact_k.shape[-2]
        if wanted > 0:  # tokens arrive in order: the first ones appended are the sequence's first
            self.exact_k = torch.cat([self.exact_k, key_states[:, :, :wanted]], dim=-2)
            self.exact_v = torch.cat([self.exact_v, value_states[:, :, :wanted]], dim=-2)
        missing = self.sink_tokens - self.sink_k.shape[-2]
        if missing > 0:  # the first tokens of the sequence fill the sink before anything is committed
            self.sink_k = torch.cat([self.sink_k, self.tail_k[:, :, :missing]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, self.tail_v[:, :, :missing]], dim=-2)
            self.tail_k, self.tail_v = self.tail_k[:, :, missing:], self.tail_v[:, :, missing:]
        c, w = self.committer.commit_tokens, self.committer.window
        due = max(0, (self.tail_k.shape[-2] - w) // c) * c
        if due:
            kq, vq = self.committer.commit(self.tail_k[:, :, :due], self.tail_v[:, :, :due])
            n = self.exact_k.shape[-2] if self.done_k.shape[-2] == 0 else 0
            if n:  # tile 0 was just committed: read its first tokens from the exact copies
                kq, vq = kq.clone(), vq.clone()
                kq[:, :, :n], vq[:, :, :n] = self.exact_k, self.exact_v
            self.done_k = torch.cat([self.done_k, kq], dim=-2)
            self.done_v = torch.cat([self.done_v, vq], dim=-2)
            self.tail_k, self.tail_v = self.tail_k[:, :, due:], self.tail_v[:, :, due:]

    def _all(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([self.sink_k, self.done_k, self.tail_k], dim=-2)
        v = torch.cat([self.sink_v, self.done_v, self.tail_v], dim=-2)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: keys the next update returns, and the position of the first."""
        return self.length - self.offset + query_length, self.offset

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def held_tokens(self) -> int:
        """Tokens held now (a sliding-window layer holds only those a later query can read)."""
        return self.length - self.offset

    # ---- accounting --------------------------------------------------------------------------
    def quantized_bytes(self) -> float:
        """Bytes of committed (quantized) tokens as stored."""
        return 0.0 if self.committer is None else self.committer.quantized_bytes()

    def unquantized_elements(self) -> int:
        """Numbers (keys and values) held in the model's dtype: sink and tail."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() for t in (self.sink_k, self.sink_v, self.tail_k, self.tail_v))

    def copy_elements(self) -> int:
        """Numbers held twice: exact copies of sink tokens (their packed values are counted too)."""
        return 0 if not self.is_initialized else self.exact_k.numel() + self.exact_v.numel()

    def unquantized_bytes(self) -> int:
        """Bytes of the sink, the tail and the exact sink-token copies as held (model dtype)."""
        if not self.is_initialized:
            return 0
        return (self.unquantized_elements() + self.copy_elements()) * self.tail_k.element_size()

    def quantized_elements(self) -> int:
        """Numbers (keys and values) held quantized."""
        return 0 if not self.is_initialized else self.done_k.numel() + self.done_v.numel()

    # ---- unsupported cache operations: say so instead of silently corrupting ------------------
    def reset(self) -> None:
        self.length = self.offset = 0
        self.is_initialized = False
        self.exact_k = self.exact_v = torch.empty(0)
        if self.committer is not None:
            self.committer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KVarNCache does not support beam search (reorder_cache); use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVarNCache cannot crop: committed tiles are quantized (no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVarNCache does not support batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KVarNCache does not support batch_select_indices")

    def offload(self) -> None:
        raise NotImplementedError("KVarNCache does not support offloading")
