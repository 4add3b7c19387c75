"""``KvarnStorageConnector``: vLLM's KV-connector API over kvarn pages, saving and loading whole
tiles, tail rows and sink rows to a directory (:class:`~kvarn.vllm.connectors.store.RecordStore`).

Enable it with ``kv_transfer_config={"kv_connector": "KvarnStorageConnector", "kv_role":
"kv_both", "kv_connector_extra_config": {"storage_path": DIR}}`` (``--kv-transfer-config`` for
``vllm serve``) and a kvarn ``kv_cache_dtype``. The plugin registers the name with vLLM's
``KVConnectorFactory`` (:func:`kvarn.vllm.connectors.register`).

* **Save**: the step that computes a request's last prompt token writes, after the forward, every
  whole tile of its prompt not stored yet, the rows of its partial tile and its sink rows.
* **Load**: a new request matches the longest stored prefix of its prompt (at most all tokens but
  the last): whole tiles, then a tail of fewer than ``T`` rows; with a sink scheme only when the
  sink rows of its first tokens are stored too. The load is asynchronous in vLLM's sense: the
  request waits one engine step while its records are written into its blocks and its sink rows
  into a sink slot, so that the step planning its first forward finds the slot filled
  (:meth:`~kvarn.vllm.sinks.SinkPool.adopt`) and reads every loaded token as the saving
  engine held it.

Records move byte for byte, so the loading engine reads the saving engine's KV exactly (same model
weights, scheme and dtype: the store's namespace, :class:`~kvarn.vllm.connectors.store.Identity`).
Nothing is loaded that is not exactly that:

* the scheduler side matches only records that pass their checks (header, length, CRC-32:
  :meth:`~kvarn.vllm.connectors.store.RecordStore.check`); a record that fails is moved aside and
  logged, and the tokens it held are computed (and saved again);
* the worker side checks every record again as it reads it, and reads them all before it writes
  anything; a load that cannot be done exactly (a record gone or damaged since it was matched, no
  free sink slot for a sequence's first rows) writes nothing it needs and is reported to vLLM as
  failed blocks (:meth:`KvarnStorageConnector.get_block_ids_with_load_errors`): vLLM computes them
  under ``kv_load_failure_policy="recompute"`` and fails the request under its default ``"fail"``;
* a save that fails (disk full, no permission) is logged and the request goes on.

See ``docs/connectors.md``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvarn.vllm.connectors import NAME
from kvarn.vllm.connectors.carry import read_sink, read_tail, read_tiles, write_sink, write_tail, write_tiles
from kvarn.vllm.connectors.fingerprint import model_fingerprint
from kvarn.vllm.connectors.store import ROOT_KEY, Identity, RecordError, RecordStore, tile_keys, token_hash
from kvarn.vllm.context import EngineSpec
from kvarn.vllm.pools import sink_capacity
from kvarn.vllm.registry import DTYPES

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger("kvarn.vllm")

PATH_KEY = "storage_path"  # kv_connector_extra_config key of the store's root folder


def transfer_policy(transfer: Any) -> str:
    """vLLM's ``kv_load_failure_policy`` of ``transfer`` (``"fail"``, vLLM's default, where it has none)."""
    return str(getattr(transfer, "kv_load_failure_policy", "fail"))


@dataclass
class Transfer:
    """One request's records to move: its ``tokens`` (the prompt saved, or the matched prefix
    loaded), its block table ``blocks`` (tiles then lookahead blocks) and, for a load, ``start``:
    tokens it already holds (a local prefix-cache hit, whole tiles) that are not written."""

    req_id: str
    tokens: list[int]
    blocks: list[int]
    start: int = 0
    tail: str = ""  # a load's tail record (its first ``len(tokens) % T`` rows are loaded)


@dataclass
class KvarnConnectorMetadata(KVConnectorMetadata):
    """A step's loads and saves, built by the scheduler side for the worker side."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class _Layer:
    """A kvarn layer as the worker side moves it: pages ``[NB, H, page_bytes]`` uint8, its record
    size, and the attention impl holding its sink pool and engine context."""

    pages: torch.Tensor
    tile_bytes: int
    impl: Any


@dataclass
class _Prompt:
    """A request the scheduler side follows until its prompt is computed (then saved)."""

    tokens: list[int]
    blocks: list[int]


class KvarnStorageConnector(KVConnectorBase_V1):
    """Whole kvarn tiles, tail rows and sink rows to and from a directory (module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cache, model = vllm_config.cache_config, vllm_config.model_config
        if not DTYPES.is_kvarn(cache.cache_dtype):
            raise ValueError(
                f"{NAME} carries kvarn pages only; kv_cache_dtype={cache.cache_dtype!r} is not a kvarn dtype "
                "(use one of vLLM's connectors, e.g. ExampleConnector, for vLLM's own caches)"
            )
        root = self._kv_transfer_config.get_from_extra_config(PATH_KEY, None)
        if not root:
            raise ValueError(f"{NAME} needs kv_connector_extra_config={{{PATH_KEY!r}: <folder>}}")
        scheme = EngineSpec.from_config(vllm_config).scheme
        self.group_size = int(cache.block_size)
        self.sink_rows = sink_capacity(scheme)
        self._root = root
        self._identity = (model.model, getattr(model, "revision", None), scheme.name, str(model.dtype),
                          model.get_head_size())  # fmt: skip
        self._store: RecordStore | None = None
        if transfer_policy(self._kv_transfer_config) != "recompute":
            logger.info("%s: a record that cannot be loaded exactly fails its request (kv_load_failure_policy="
                        "'fail'); set kv_load_failure_policy='recompute' to compute its tokens instead", NAME)  # fmt: skip
        # scheduler side
        self._matched: dict[str, tuple[list[int], str]] = {}  # prefix to load, its tail record's key
        self._loading: dict[str, set[int]] = {}  # requests whose load is under way -> the blocks it writes
        self._unloadable: set[str] = set()  # requests whose load failed: computed, never matched again
        self._loads: list[Transfer] = []
        self._prompts: dict[str, _Prompt] = {}
        # worker side
        self._layers: dict[str, _Layer] = {}
        self._received: set[str] = set()
        self._failed: set[int] = set()  # blocks of loads that failed since vLLM last asked

    @property
    def store(self) -> RecordStore:
        """The record store, its identity fingerprinted on first use (the weights are on disk by then)."""
        if self._store is None:
            model, revision, scheme, dtype, head_size = self._identity
            identity = Identity(model, model_fingerprint(model, revision), scheme, dtype, head_size)
            self._store = RecordStore(self._root, identity)
        return self._store

    # ------------------------------------------------------------------ scheduler side

    def matched_prefix(self, tokens: list[int]) -> tuple[int, str]:
        """Tokens of ``tokens`` (all but the last at most) whose records the store holds in full, and the
        key of the tail record that holds the rows past their whole tiles ("" when none)."""
        t, limit = self.group_size, len(tokens) - 1
        keys = tile_keys(tokens[:limit], t)
        n = 0
        while n < len(keys) and self.store.check("tile", keys[n]):
            n += 1
        prefix = keys[n - 1] if n else ROOT_KEY
        rows, tail = self.store.longest_tail(prefix, tokens[n * t : min(limit, n * t + t - 1)])
        matched = n * t + rows
        sink_key = token_hash(tokens[: self.sink_rows])
        if self.sink_rows and matched and (matched < self.sink_rows or not self.store.check("sink", sink_key)):
            return 0, ""  # without its exact first rows the request would not read what was saved
        return matched, tail

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._kv_transfer_config.is_kv_consumer or request.request_id in self._unloadable:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        matched, tail = self.matched_prefix(tokens)
        if matched <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (tokens[:matched], tail)
        return matched - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        tokens, tail = matched
        start = len(tokens) - num_external_tokens
        transfer = Transfer(request.request_id, tokens, list(blocks.get_block_ids()[0]), start, tail)
        self._loads.append(transfer)
        self._loading[request.request_id] = set(transfer.blocks)

    def update_connector_output(self, connector_output: Any) -> None:
        """A request whose load the worker side reported failed is not matched again: vLLM computes
        the tokens (or fails the request) and a second try would fail alike."""
        invalid = connector_output.invalid_block_ids or set()
        for req_id, blocks in list(self._loading.items()):
            if blocks & invalid:
                self._unloadable.add(req_id)
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvarnConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        done: dict[str, int] = {}
        if not self._kv_transfer_config.is_kv_producer:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            self._prompts[new.req_id] = _Prompt(list(new.prompt_token_ids or []), list(new.block_ids[0]))
            done[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                prompt.blocks = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                prompt.blocks += new_blocks[0]
            done[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in done.items():
            prompt = self._prompts[req_id]
            if computed + scheduled.get(req_id, 0) >= len(prompt.tokens):
                meta.saves.append(Transfer(req_id, prompt.tokens, list(prompt.blocks)))
                del self._prompts[req_id]
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._prompts.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._unloadable.discard(request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the kvarn layers' pages (``[NB, H, 1, page_bytes]`` uint8 per layer).

        Raises:
            ValueError: a layer of the model is not a kvarn layer with tail pages (16-bit layers,
                MLA and hybrid models are refused at start-up: :mod:`kvarn.vllm.admission`).
        """
        from vllm.model_executor.models.utils import extract_layer_index

        from kvarn.vllm.backend import KvarnAttentionImpl

        layers = self._vllm_config.compilation_config.static_forward_context
        for name, cache in kv_caches.items():
            impl = getattr(layers.get(name), "impl", None)
            if not isinstance(impl, KvarnAttentionImpl) or impl.spec.layout is None:
                raise ValueError(f"{NAME}: layer {name} is not a kvarn layer with tail pages ({type(impl).__name__})")
            scheme = impl.spec.layer_scheme(extract_layer_index(name))
            assert scheme is not None  # a kvarn impl serves quantized layers only
            self._layers[name] = _Layer(cache[:, :, 0, :], scheme.tile_bytes(impl.head_size), impl)

    def _first(self) -> _Layer:
        if not self._layers:
            raise RuntimeError(f"{NAME}: no KV caches registered")
        return next(iter(self._layers.values()))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvarnConnectorMetadata)
        for transfer in meta.loads:
            try:
                self._load(transfer)
            except (OSError, KeyError, ValueError) as e:  # vLLM recomputes or fails the blocks (module docstring)
                if isinstance(e, RecordError):
                    self.store.reject(e)
                t = self.group_size
                logger.warning("%s: request %s: its stored KV is not loaded (%s); reported to vLLM as failed blocks",
                               NAME, transfer.req_id, e)  # fmt: skip
                self._failed |= set(transfer.blocks[transfer.start // t : -(-len(transfer.tokens) // t)])
            self._received.add(transfer.req_id)

    def _load(self, tr: Transfer) -> None:
        """Write the records of ``tr`` into its blocks and a sink slot. Every record is read and checked,
        and the sink slot taken, before anything is written.

        Raises:
            FileNotFoundError: a record is gone.
            RecordError: a record fails its checks.
            ValueError: a record does not fit this engine's pages, or no sink slot is free for the
                sequence's first rows (every slot belongs to a running request).
        """
        t, tokens = self.group_size, tr.tokens
        n, rem = len(tokens) // t, len(tokens) % t
        keys = tile_keys(tokens, t)
        first = tr.start // t
        tiles = [self.store.read("tile", keys[j]) for j in range(first, n)]
        tail = self.store.read("tail", tr.tail) if rem else None
        state = self._first().impl.state
        sinks = getattr(state.planner, "sinks", None)
        # a first block held before the load (a local prefix-cache hit) keys its own sequence's sink rows;
        # a block allocated for the load may still key a finished sequence's slot: overwritten
        held = not self.sink_rows or sinks is None or (first > 0 and sinks.full_slot(tr.blocks[0]) >= 0)
        sink = None if held else self.store.read("sink", token_hash(tokens[: self.sink_rows]))
        slot = -1
        if sink is not None and sinks is not None:
            slot = sinks.adopt(tr.blocks[0])
            if slot < 0:
                raise ValueError(
                    f"no free sink slot for its first {self.sink_rows} rows (all held by running requests)"
                )
        for name, layer in self._layers.items():
            if tiles:
                write_tiles(
                    layer.pages, tr.blocks[first:n], torch.stack([rec[name] for rec in tiles]), layer.tile_bytes
                )
            if tail is not None:
                write_tail(layer.pages, state.spec.layout, tr.blocks, n, tail[name][:rem])
            if slot >= 0 and sink is not None:
                write_sink(layer.impl.sink, slot, sink[name])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole records are written once every layer has run (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvarnConnectorMetadata)
        for transfer in meta.saves:
            try:
                self._save(transfer)
            except OSError as e:  # disk full, no permission: the request is served all the same
                logger.error("%s: saving the KV of request %s failed (%s); it is served, its records are not stored",
                             NAME, transfer.req_id, e)  # fmt: skip

    def _save(self, tr: Transfer) -> None:
        t, tokens, store = self.group_size, tr.tokens, self.store
        n, rem = len(tokens) // t, len(tokens) % t
        keys = tile_keys(tokens, t)
        state = self._first().impl.state
        for j in range(n):
            if not store.check("tile", keys[j]):
                store.write(
                    "tile",
                    keys[j],
                    {k: read_tiles(x.pages, [tr.blocks[j]], x.tile_bytes)[0] for k, x in self._layers.items()},
                )
        prefix = keys[n - 1] if n else ROOT_KEY
        if rem and not store.check("tail", store.tail_key(prefix, tokens[n * t :])):
            rows = {k: read_tail(x.pages, state.spec.layout, tr.blocks, n, rem) for k, x in self._layers.items()}
            store.write_tail(prefix, tokens[n * t :], rows)
        sinks = getattr(state.planner, "sinks", None)
        if not self.sink_rows or sinks is None or len(tokens) < self.sink_rows:
            return
        sink_key = token_hash(tokens[: self.sink_rows])
        slot = sinks.full_slot(tr.blocks[0])
        if slot >= 0 and not store.check("sink", sink_key):
            store.write("sink", sink_key, {k: read_sink(x.impl.sink, slot) for k, x in self._layers.items()})

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        received, self._received = self._received, set()
        return None, received or None
