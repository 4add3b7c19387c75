"""``--search-tiles``: the ladder's rungs and the allocation's families at every tile size that fits."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvarn.autotune.cli as cli
import kvarn.autotune.tuner as tuner
from kvarn.autotune.allocate import AllocationSpace
from kvarn.autotune.budget import parse_budget
from kvarn.autotune.config import TuneConfig
from kvarn.autotune.ladder import LadderSpace, rungs
from kvarn.autotune.result import Outcome
from kvarn.autotune.search import make_space
from kvarn.autotune.tuner import tune
from kvarn.schemes import Scheme, get_preset

from .conftest import HEAD_DIM, NUM_LAYERS, FakeFactory


def bits(s: Scheme) -> float:
    return s.bits_per_element(HEAD_DIM, NUM_LAYERS, 2048)


def test_rungs_at_two_tile_sizes_interleave_by_bits() -> None:
    one, two = rungs(bits, 128), rungs(bits, (128, 256))
    assert len(two) == 2 * len(one) and {s.group_size for s in two} == {128, 256}
    b = [bits(s) for s in two]
    assert b == sorted(b)
    # each pair and scale format costs fewer bits in 256-token tiles (half the per-token scales)
    for s in one:
        wide = next(w for w in two if w.group_size == 256 and (w.key_bits, w.value_bits, w.scale_dtype)
                    == (s.key_bits, s.value_bits, s.scale_dtype))  # fmt: skip
        assert bits(wide) < bits(s)


def _config(tmp_path: Path, **kw: object) -> TuneConfig:
    base: dict[str, object] = dict(budget=parse_budget("1%"), tokens=4096, cache_dir=tmp_path, progress=False,
                                   compare_builtin=False, group_sizes=(64, 128, 256))  # fmt: skip
    base.update(kw)
    return TuneConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("search_tiles", [False, True])
def test_make_space_takes_every_fitting_tile_only_when_asked(tmp_path: Path, search_tiles: bool) -> None:
    cfg = _config(tmp_path, search_tiles=search_tiles, strategy="ladder")
    groups = cfg.checked_group_sizes()
    ladder = make_space(cfg, NUM_LAYERS, (), groups, bits)
    assert isinstance(ladder, LadderSpace)
    assert ladder.group_sizes == ((64, 128, 256) if search_tiles else (128,))
    cfg.strategy = "allocate"
    alloc = make_space(cfg, NUM_LAYERS, tuple(range(NUM_LAYERS)), groups, bits)
    assert isinstance(alloc, AllocationSpace)
    assert alloc.group_sizes == ((64, 128, 256) if search_tiles else (128,))
    tops = [bits(f.scheme(alloc.ranking, NUM_LAYERS)) for f in alloc.families]
    assert tops == sorted(tops)  # cheapest top first, so a family above the best costs nothing


def test_tiles_that_do_not_fit_the_tokens_are_not_searched(tmp_path: Path) -> None:
    cfg = _config(tmp_path, search_tiles=True, strategy="ladder", tokens=1536)  # 768 per document
    space = make_space(cfg, NUM_LAYERS, (), cfg.checked_group_sizes(), bits)
    assert space.group_sizes == (64, 128)  # 256-token tiles: 3 per document, fewer than min_tiles


def test_ladder_over_tiles_finds_the_cheapest_feasible_rung(tmp_path: Path) -> None:
    f = FakeFactory()
    res = tune(_config(tmp_path, search_tiles=True, strategy="ladder", group_sizes=(128, 256)), factory=f,
               dims=(NUM_LAYERS, HEAD_DIM))  # fmt: skip
    assert res.outcome is Outcome.OK, res.message
    calib = f.made[0]
    measured = {name for name, n in calib.calls if n is None}
    assert any("_g256" in name for name in measured)
    feasible = {s.name for s in rungs(bits, (128, 256)) if calib.evaluate(s).delta_ppl_pct <= 1.0}
    # the fake's damage grows with the tile (x (g/128)^0.3), so along this ladder it is not monotone
    # in bits: the bisection's contract is a feasible winner whose measured cheaper rungs all miss
    assert res.winner is not None and res.winner.scheme in feasible
    assert all(name not in feasible for name in measured if bits(Scheme.from_name(name)) < res.winner.bits)
    assert res.config["group_sizes"] == [128, 256]


def test_cli_search_tiles_reaches_the_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = FakeFactory()
    monkeypatch.setattr(cli, "model_dims", lambda model: (NUM_LAYERS, HEAD_DIM))
    monkeypatch.setattr(tuner, "harness_factory", lambda config: f)
    out = tmp_path / "presets"
    args = ["--budget", "1%", "--strategy", "ladder", "--group-sizes", "128,256", "--search-tiles",
            "--no-compare-builtin", "--name", "tiles", "--out", str(out), "--cache-dir", str(tmp_path), "--quiet"]  # fmt: skip
    assert cli.main(args) == 0, capsys.readouterr().err
    assert any("_g256" in name for name, _ in f.made[0].calls)
    monkeypatch.setenv("KVARN_PRESET_PATH", str(out))
    assert get_preset("tiles").scheme.group_size in (128, 256)
