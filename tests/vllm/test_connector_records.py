"""KV records that travel are checked: each way a stored record can be wrong is refused, named, and
costs only a computation (``kvarn/vllm/connectors/store.py``, ``fingerprint.py``, ``storage.py``).

Without an engine: the record store (truncated, damaged, another store's, renamed, unwritable, two
writers of one record at once), the weights' fingerprint, and the worker side's load (a record
damaged after it was matched, no free sink slot) on pages of a stand-in engine. The same cases
through a vLLM engine: ``test_connector_recovery.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvarn.vllm.connectors.fingerprint import model_fingerprint  # noqa: E402
from kvarn.vllm.connectors.store import Identity, RecordError, RecordStore, tile_keys  # noqa: E402

ID = Identity("m", "0123456789abcdef", "kvarn_k4v2_g128", "torch.float32", 64)
TILE = 128


def _record(seed: int = 0, layers: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(0, 256, (2, 1200), dtype=torch.uint8, generator=g) for i in range(layers)}


def _stored(tmp_path: Path) -> tuple[RecordStore, Path]:
    store = RecordStore(tmp_path, ID)
    store.write("tile", "k0", _record())
    return store, store.path / "tile-k0.safetensors"


def _rejected(store: RecordStore) -> list[str]:
    return sorted(p.name.split(".rejected-")[0] for p in store.path.glob("*.rejected-*"))


def test_a_record_reads_back_as_written(tmp_path: Path) -> None:
    store, _ = _stored(tmp_path)
    got = store.read("tile", "k0")
    assert got.keys() == _record().keys() and all(torch.equal(got[k], v) for k, v in _record().items())
    assert store.check("tile", "k0") and not store.check("tile", "k1")


@pytest.mark.parametrize("cut", [4, 40, 300, -1])
def test_a_truncated_record_is_refused_and_moved_aside(
    tmp_path: Path, cut: int, caplog: pytest.LogCaptureFixture
) -> None:
    store, path = _stored(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(RecordError, match=r"tile-k0\.safetensors.*(truncated|header)"):
        store.read("tile", "k0")
    with caplog.at_level(logging.WARNING, logger="kvarn.vllm"):
        assert not store.check("tile", "k0")
    assert not path.exists() and _rejected(store) == ["tile-k0.safetensors"]
    assert "tile-k0.safetensors" in caplog.text and "rejected" in caplog.text


def test_a_flipped_byte_in_the_data_fails_the_crc(tmp_path: Path) -> None:
    store, path = _stored(tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(RecordError, match="damaged: CRC-32"):
        store.read("tile", "k0")


def test_a_flipped_byte_in_the_header_is_refused(tmp_path: Path) -> None:
    store, path = _stored(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.index(b'"scheme"') + 3  # inside the word: the header still parses, the field is another
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(RecordError, match="another store's record"):
        store.read("tile", "k0")


@pytest.mark.parametrize(
    ("field", "other"),
    [("scheme", "kvarn_k4v4_g128"), ("weights", "fedcba9876543210"), ("dtype", "torch.bfloat16")],
)
def test_another_stores_record_is_refused_naming_what_differs(tmp_path: Path, field: str, other: str) -> None:
    """A record written by an engine of another scheme, weights or dtype, found in this store's folder
    (copied by hand, or a store shared by mistake): its header says so."""
    store, path = _stored(tmp_path)
    theirs = RecordStore(tmp_path, Identity(**{**ID.__dict__, field: other}))
    theirs.write("tile", "k0", _record())
    path.write_bytes((theirs.path / "tile-k0.safetensors").read_bytes())
    header_field = "model" if field == "weights" else field
    with pytest.raises(RecordError, match=rf"{header_field} '{other}', expected"):
        store.read("tile", "k0")


def test_a_record_under_another_key_is_refused(tmp_path: Path) -> None:
    store, path = _stored(tmp_path)
    path.rename(store.path / "tile-k1.safetensors")
    with pytest.raises(RecordError, match="key 'k0', expected 'k1'"):
        store.read("tile", "k1")


def test_a_record_that_changes_is_checked_again(tmp_path: Path) -> None:
    store, path = _stored(tmp_path)
    assert store.check("tile", "k0")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: the check follows the file's inode and modification time
    assert not store.check("tile", "k0")


def test_longest_tail_skips_a_damaged_tail_for_a_shorter_valid_one(tmp_path: Path) -> None:
    store = RecordStore(tmp_path, ID)
    tokens = list(range(1000, 1300))
    prefix = tile_keys(tokens, TILE)[1]
    rows = {"l0": torch.zeros(44, 1, 4, dtype=torch.uint8)}
    store.write_tail(prefix, tokens[256:], rows)
    store.write_tail(prefix, tokens[256:280], {"l0": rows["l0"][:24]})
    assert store.longest_tail(prefix, tokens[256:299]) == (43, store.tail_key(prefix, tokens[256:]))
    long = store.path / f"tail-{store.tail_key(prefix, tokens[256:])}.safetensors"
    data = bytearray(long.read_bytes())
    data[-3] ^= 0x01
    long.write_bytes(bytes(data))
    assert store.longest_tail(prefix, tokens[256:299]) == (24, store.tail_key(prefix, tokens[256:280]))
    assert not long.exists()


def test_a_store_that_cannot_be_written_raises_oserror_and_leaves_no_file(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    with pytest.raises(OSError):
        RecordStore(blocker, ID).write("tile", "k0", _record())
    store = RecordStore(tmp_path / "s", ID)
    store.path.mkdir(parents=True)

    def full(*args: object, **kw: object) -> None:
        from safetensors import SafetensorError

        Path(str(args[1])).write_bytes(b"partial")  # what a disk that fills up mid-write leaves
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    import kvarn.vllm.connectors.store as store_module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_module, "save_file", full)
        with pytest.raises(OSError, match="No space left"):
            store.write("tile", "k0", _record())
    assert list(store.path.iterdir()) == []


def _write_many(root: str, seed: int, times: int) -> None:
    store = RecordStore(root, ID)
    for _ in range(times):
        store.write("tile", "k0", _record(seed))


def test_two_engines_writing_one_record_at_once_leave_a_whole_one(tmp_path: Path) -> None:
    """Two processes save the same tile (as two engines serving the same prefix) 40 times each while
    this one reads it: every read is one writer's whole record, never a mix or a half."""
    ctx = multiprocessing.get_context("fork")
    RecordStore(tmp_path, ID).write("tile", "k0", _record(1))
    writers = [ctx.Process(target=_write_many, args=(str(tmp_path), seed, 40)) for seed in (1, 2)]
    for w in writers:
        w.start()
    reader, seen = RecordStore(tmp_path, ID), set()
    while any(w.is_alive() for w in writers):
        got = reader.read("tile", "k0")
        seen.add(next(s for s in (1, 2) if torch.equal(got["l0"], _record(s)["l0"])))
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert seen and not list(reader.path.glob("*.tmp"))


def test_the_fingerprint_follows_the_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights = {"a": torch.randn(300, 1000), "b": torch.randn(64)}
    save_file(weights, str(model / "model.safetensors"))
    base = model_fingerprint(str(model))
    assert model_fingerprint(str(model)) == base
    file = model / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-8] ^= 0x01  # the last sampled run holds the file's last bytes
    file.write_bytes(bytes(data))
    assert model_fingerprint(str(model)) != base
    save_file({**weights, "a": weights["a"].reshape(1000, 300)}, str(file))  # same bytes, another shape
    assert model_fingerprint(str(model)) != base
    save_file(weights, str(file))
    assert model_fingerprint(str(model)) == base
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert model_fingerprint(str(model)) != base


# ---- the worker side's load, on the pages of a stand-in engine -------------------------------------


def _worker(tmp_path: Path, slots: int, live: set[int]) -> tuple[object, torch.Tensor, torch.Tensor]:
    """A connector's worker side over one layer of 2 heads, 16 blocks of 2,048 bytes, and a sink pool
    of ``slots`` one-row slots whose ``live`` first blocks belong to running requests."""
    from kvarn.schemes import Scheme
    from kvarn.vllm.connectors.storage import KvarnStorageConnector, _Layer
    from kvarn.vllm.sinks import SinkPool
    from kvarn.vllm.staging import LiveBlocks
    from kvarn.vllm.tail import page_layout

    scheme = Scheme.from_name("kvarn_k4v2_g128")
    heads, d, tile = 2, 64, scheme.tile_bytes(64)
    pages = torch.zeros(16, heads, tile, dtype=torch.uint8)
    sink = (torch.zeros(slots, heads, 1, d), torch.zeros(slots, heads, 1, d))
    layout = page_layout(scheme, tile, d, torch.float32)
    sinks = SinkPool(num_slots=slots, capacity=1, block_size=TILE, live=LiveBlocks(first=live))
    for b in sorted(live):
        sinks.adopt(b)
    state = SimpleNamespace(planner=SimpleNamespace(sinks=sinks), spec=SimpleNamespace(layout=layout))
    impl = SimpleNamespace(state=state, sink=sink)
    conn = object.__new__(KvarnStorageConnector)
    conn.group_size, conn.sink_rows = TILE, 1
    conn._store = RecordStore(tmp_path, ID)
    conn._layers = {"l0": _Layer(pages, tile, impl)}
    conn._received, conn._failed = set(), set()
    return conn, pages, sink[0]


def _load(conn: object, blocks: list[int], tokens: list[int]) -> None:
    from kvarn.vllm.connectors.storage import KvarnConnectorMetadata, Transfer

    conn._connector_metadata = KvarnConnectorMetadata(loads=[Transfer("r", tokens, blocks)])  # type: ignore[attr-defined]
    conn.start_load_kv(None)  # type: ignore[attr-defined]


def _save_prompt(conn: object, pages: torch.Tensor, sink: torch.Tensor, tokens: list[int]) -> None:
    from kvarn.vllm.connectors.store import token_hash

    store: RecordStore = conn._store  # type: ignore[attr-defined]
    keys = tile_keys(tokens, TILE)
    g = torch.Generator().manual_seed(3)
    for k in keys:
        store.write("tile", k, {"l0": torch.randint(0, 256, pages.shape[1:], dtype=torch.uint8, generator=g)})
    store.write("sink", token_hash(tokens[:1]), {"l0": torch.randn(2, *sink.shape[1:], generator=g)})


def test_a_load_without_a_free_sink_slot_writes_nothing_and_is_reported(tmp_path: Path) -> None:
    """Both sink slots hold running requests' first rows: the load is reported failed (vLLM computes its
    tokens) rather than served with tile 0 read quantized; neither pages nor slots are written."""
    conn, pages, sink = _worker(tmp_path, slots=2, live={5, 6})
    tokens = list(range(300))
    _save_prompt(conn, pages, sink, tokens[:256])
    _load(conn, [1, 2, 3], tokens[:256])
    assert conn.get_block_ids_with_load_errors() == {1, 2}  # type: ignore[attr-defined]
    assert not pages.any() and not sink.any()
    assert conn.get_finished(set()) == (None, {"r"})  # type: ignore[attr-defined]


def test_a_record_damaged_after_its_match_is_reported_and_moved_aside(tmp_path: Path) -> None:
    conn, pages, sink = _worker(tmp_path, slots=2, live={5})
    tokens = list(range(256))
    _save_prompt(conn, pages, sink, tokens)
    _load(conn, [1, 2, 3], tokens)
    assert conn.get_block_ids_with_load_errors() == set() and pages[1:3].any()  # type: ignore[attr-defined]
    pages.zero_()
    tile1 = conn._store.path / f"tile-{tile_keys(tokens, TILE)[1]}.safetensors"  # type: ignore[attr-defined]
    tile1.write_bytes(tile1.read_bytes()[:-10])
    _load(conn, [7, 8, 9], tokens)
    assert conn.get_block_ids_with_load_errors() == {7, 8}  # type: ignore[attr-defined]
    assert not pages.any() and not tile1.exists()
