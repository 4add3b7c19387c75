"""A kvarn engine with ``KvarnStorageConnector`` never serves a stored record that is not exactly what
it would compute: each way a record can be wrong costs a computation, is named in the log, and the
request's tokens are those computed without the store.

One in-process engine (``kv_both``, prefix caching off so that a repeated prompt reads the store,
``kv_load_failure_policy="recompute"``), SmolLM2 in float32 (a loaded prompt's last token is
computed in a step of its own, which moves float32 logprobs by rounding only: :data:`DRIFT`, as in
``test_connectors.py``). The prompt ``P`` (2 tiles and 124 rows) is served once with an empty store
(the reference: computed, then saved), then again after each damage; the engine saves what it
computed again, so every case starts from a whole store.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm.engines import ENGINE_DTYPE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DTYPE = "kvarn_k4v2_g128"  # sink_tokens 1: a sink record too
TILE, SHORT, GEN = 128, 380, 8
DRIFT = 1e-3  # float32 rounding of the last prompt token's own step (test_connectors.FLOAT32_DRIFT)


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> str:
        text, self.lines = "\n".join(self.lines), []
        return text


class Engine:
    """The engine, its store folder, the prompt and the reference completion."""

    def __init__(self, llm: Any, store: Path, prompt: list[int], log: _Log) -> None:
        self.llm, self.store, self.prompt, self.log = llm, store, prompt, log
        self.reference = self.serve()[0]

    def serve(self, prompt: list[int] | None = None) -> tuple[Any, int]:
        """Greedy tokens of ``prompt`` (default ``P``) and the prompt tokens the engine did not compute."""
        from vllm import SamplingParams, TokensPrompt

        from kvarn.testing.greedy import TOP, greedy

        params = SamplingParams(max_tokens=GEN, temperature=0.0, logprobs=TOP)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt or self.prompt)], params, use_tqdm=False)
        return greedy(out)[0], int(out[0].num_cached_tokens or 0)

    def records(self, kind: str) -> list[Path]:
        return sorted(p for p in self.store.rglob(f"{kind}-*.safetensors"))

    def equal_to_reference(self, got: Any) -> None:
        ref = self.reference
        assert got.tokens == ref.tokens, (ref, got)
        drift = max(abs(x[t] - y[t]) for t, x, y in zip(ref.tokens, ref.top, got.top, strict=True))
        assert drift <= DRIFT, drift


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from kvarn.models import resolve_model
    from kvarn.vllm.engine import cpu_engine
    from tests.vllm.test_connectors import _prompt

    model = str(resolve_model("smollm2-135m"))
    store = tmp_path_factory.mktemp("recovery") / "kv_store"
    transfer = {"kv_connector": "KvarnStorageConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"storage_path": str(store)}}  # fmt: skip
    log = _Log()
    logging.getLogger("kvarn.vllm").addHandler(log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process: patchable
        with cpu_engine(model, DTYPE, dtype=ENGINE_DTYPE, max_model_len=640, max_num_seqs=2,
                        enable_prefix_caching=False, kv_transfer_config=transfer) as llm:  # fmt: skip
            yield Engine(llm, store, _prompt(model, SHORT), log)
    logging.getLogger("kvarn.vllm").removeHandler(log)


def test_a_whole_store_serves_every_prompt_token_but_the_last(engine: Engine) -> None:
    assert [len(engine.records(k)) for k in ("tile", "tail", "sink")] == [2, 1, 1]
    got, loaded = engine.serve()
    assert loaded == SHORT - 1
    engine.equal_to_reference(got)


def _flip(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "loaded", "why"),
    [
        ("flip a byte of tile 1", TILE, "damaged: CRC-32"),
        ("truncate the tail", 2 * TILE, "truncated"),
        ("tile 0 from another scheme", 0, "scheme 'kvarn_k4v4_g128', expected 'kvarn_k4v2_g128'"),
        ("the sink from other weights", 0, "model 'fedcba9876543210', expected"),
    ],
)
def test_a_wrong_record_is_computed_named_and_saved_again(engine: Engine, damage: str, loaded: int, why: str) -> None:
    """The prompt loads the valid records before the wrong one (a sink record is needed to load any),
    computes the rest, and its tokens are the reference's; the log names the file and why."""
    from kvarn.vllm.connectors.store import Identity, RecordStore, tile_keys

    tiles, tail, sink = engine.records("tile"), engine.records("tail")[0], engine.records("sink")[0]

    key0 = tile_keys(engine.prompt, TILE)[0]
    tile0 = next(p for p in tiles if p.name == f"tile-{key0}.safetensors")
    tile1 = next(p for p in tiles if p != tile0)
    ns = tile0.parent
    if damage == "flip a byte of tile 1":
        target = tile1
        _flip(tile1)
    elif damage == "truncate the tail":
        target = tail
        tail.write_bytes(tail.read_bytes()[:-1000])
    else:
        target = tile0 if "tile 0" in damage else sink
        kind, key = target.name.removesuffix(".safetensors").split("-", 1)
        mine = RecordStore(ns.parent, _identity_of(ns))
        mine.path = ns
        field = {"scheme": "kvarn_k4v4_g128"} if "scheme" in damage else {"weights": "fedcba9876543210"}
        theirs = RecordStore(ns.parent / "elsewhere", Identity(**{**mine.identity.__dict__, **field}))
        theirs.write(kind, key, mine.read(kind, key))
        target.write_bytes((theirs.path / target.name).read_bytes())
    engine.log.take()
    got, got_loaded = engine.serve()
    log = engine.log.take()
    assert got_loaded == loaded
    engine.equal_to_reference(got)
    assert target.name in log and why in log and "rejected" in log, log
    assert target.is_file() and any(target.parent.glob(f"{target.name}.rejected-*"))  # saved again, bad one aside
    again, again_loaded = engine.serve()
    assert again_loaded == SHORT - 1
    engine.equal_to_reference(again)


def _identity_of(ns: Path) -> Any:
    """The identity of the engine whose records are in the folder ``ns`` (read from a record's header)."""
    from kvarn.vllm.connectors.store import Identity, read_header

    head = read_header(next(ns.glob("*.safetensors")))
    return Identity("", head["model"], head["scheme"], head["dtype"], int(head["head_size"]))


def test_no_free_sink_slot_is_reported_and_computed(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sink slot held by running requests (made so by a sink pool that has none to give): the
    worker loads nothing and reports the blocks; vLLM computes them (recompute policy) and the tokens
    are the reference's. The request is not matched again (a second load would fail alike)."""
    from kvarn.vllm.sinks import SinkPool

    monkeypatch.setattr(SinkPool, "adopt", lambda self, first_block: -1)
    engine.log.take()
    got, _ = engine.serve()
    log = engine.log.take()
    assert "no free sink slot" in log and "reported to vLLM as failed blocks" in log, log
    engine.equal_to_reference(got)


def test_a_failed_save_is_logged_and_the_request_served(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up while the engine saves a new prompt: logged, the request completes with the
    tokens it computed, and nothing half-written is left in the store."""
    from safetensors import SafetensorError

    import kvarn.vllm.connectors.store as store_module

    def full(tensors: Any, path: str, metadata: Any = None) -> None:
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    other = engine.prompt[::-1][:300]
    monkeypatch.setattr(store_module, "save_file", full)
    before = sorted(engine.store.rglob("*"))
    engine.log.take()
    got, loaded = engine.serve(other)
    log = engine.log.take()
    monkeypatch.undo()
    assert loaded == 0 and len(got.tokens) == GEN
    assert "saving the KV of request" in log and "No space left on device" in log, log
    assert sorted(engine.store.rglob("*")) == before
    computed, _ = engine.serve(other)  # saved now; the same tokens as the request whose save failed
    assert computed.tokens == got.tokens
