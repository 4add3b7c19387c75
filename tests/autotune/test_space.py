"""Search space: every sampled trial is a valid, canonical scheme; tiers follow the ranking."""

from __future__ import annotations

import optuna
import pytest

from kvarn.autotune.space import SearchSpace, kv_pairs, layer_sensitivity, only_layer, ranking, tier_overrides
from kvarn.schemes import Scheme

optuna.logging.set_verbosity(optuna.logging.WARNING)
RANK = (29, 0, 1, *range(2, 29))


def _sample_many(space: SearchSpace, sampler: optuna.samplers.BaseSampler, n: int) -> list[Scheme]:
    out: list[Scheme] = []

    def objective(trial: optuna.Trial) -> float:
        s = space.sample(trial)
        out.append(s)
        return s.bits_per_element(64, space.num_layers)

    optuna.create_study(sampler=sampler).optimize(objective, n_trials=n)
    return out


@pytest.mark.parametrize("inversion", [False, True])
@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_sampled_trials_are_valid_schemes(inversion: bool, sampler: str) -> None:
    space = SearchSpace(num_layers=30, ranking=RANK, allow_kv_inversion=inversion)
    smp = optuna.samplers.RandomSampler(seed=1) if sampler == "random" else optuna.samplers.TPESampler(seed=1)
    schemes = _sample_many(space, smp, 150)
    inverted = 0
    for s in schemes:
        assert Scheme.from_name(s.name) == s  # valid and canonical
        bits = s.bits_per_element(64, 30)
        assert 2.0 < bits <= 16.0
        for layer in range(30):
            ls = s.for_layer(layer)
            if ls is not None:
                inverted += ls.key_bits < ls.value_bits
                if not inversion:
                    assert ls.key_bits >= ls.value_bits, s.name
    if inversion and sampler == "random":
        assert inverted > 0  # the option really opens the space


def test_kv_pairs_respect_key_order() -> None:
    assert kv_pairs() == ("k2v2", "k3v2", "k3v3", "k4v2", "k4v3", "k4v4", "k8v2", "k8v3", "k8v4", "k8v8")
    assert len(kv_pairs(allow_inversion=True)) == 16


def test_tiers_follow_sensitivity_ranking() -> None:
    space = SearchSpace(num_layers=30, ranking=RANK)
    p = {
        "kv": "k3v2",
        "group_size": 64,
        "rotation": "hadamard",
        "norm_iters": 8,
        "scale_dtype": "log8",
        "sink": "tile",
        "n_protect": 3,
        "protect_up": 9,
        "n_demote": 9,
        "demote_down": 1,
    }
    assert space.build(p).name == "kvarn_k3v2_g64_s8_sink_L0-1k8v8_L20-28k2v2_L29k8v8"  # k8v8 is the top rung
    space = SearchSpace(num_layers=30, ranking=RANK, allow_fp16_layers=True)
    s = space.build(p)
    assert s.name == "kvarn_k3v2_g64_s8_sink_L0-1fp16_L20-28k2v2_L29fp16"
    assert [i for i in range(30) if s.for_layer(i) is None] == [0, 1, 29]
    assert s.for_layer(20) == Scheme(2, 2, 64, scale_dtype="log8", sink_tile=True)
    assert s.for_layer(19) == Scheme(3, 2, 64, scale_dtype="log8", sink_tile=True)
    # 3 fp16 layers, 9 at 2.53 bits, 18 at 3.03 bits (head_dim 64, g64, log8)
    expect = (
        3 * 16
        + 9 * Scheme(2, 2, 64, scale_dtype="log8").bits_per_element(64)
        + 18 * Scheme(3, 2, 64, scale_dtype="log8").bits_per_element(64)
    ) / 30
    assert s.bits_per_element(64, 30) == pytest.approx(expect)
    # demoting every layer leaves the protected tier intact and never overlaps it
    s2 = space.build({**p, "n_demote": 30})
    assert [i for i in range(30) if s2.for_layer(i) is None] == [0, 1, 29]
    assert Scheme.from_name(s2.name) == s2


def test_seeds_are_in_the_space() -> None:
    space = SearchSpace(num_layers=30)
    names = [space.build(p).name for p in space.seeds()]
    assert names == ["kvarn_k4v2_g128", "kvarn_k4v2_g128_s8", "kvarn_k3v2_g128_s8"]  # exact first token: default
    no_sink = SearchSpace(num_layers=30, sinks=("0",))
    assert [no_sink.build(p).name for p in no_sink.seeds()] == [
        "kvarn_k4v2_g128_sink0",
        "kvarn_k4v2_g128_s8_sink0",
        "kvarn_k3v2_g128_s8_sink0",
    ]
    small = SearchSpace(num_layers=30, group_sizes=(32, 64))
    assert small.build(small.seeds()[0]).group_size == 64


def test_bad_space_is_rejected() -> None:
    with pytest.raises(ValueError, match="permutation"):
        SearchSpace(num_layers=3, ranking=(0, 0, 1))
    with pytest.raises(ValueError, match="group size"):
        SearchSpace(num_layers=3, group_sizes=())
    with pytest.raises(ValueError, match="sink choices .'3'. are not valid; allowed: 0, tile, 1, 2, 4, 8"):
        SearchSpace(num_layers=3, sinks=("3",))


def test_only_layer_quantizes_one_layer() -> None:
    s = only_layer(Scheme(2, 2, 128), 7, 30)
    assert [i for i in range(30) if s.for_layer(i) is not None] == [7]
    assert s.for_layer(7) == Scheme(2, 2, 128)
    assert tier_overrides([3, 1, 2, 7], "k8v4")[0].first == 1
    assert [(o.first, o.last) for o in tier_overrides([3, 1, 2, 7], None)] == [(1, 3), (7, 7)]


def test_sensitivity_pass_is_cached(tmp_path) -> None:
    calls: list[str] = []

    def measure(s: Scheme) -> float:
        calls.append(s.name)
        layer = next(i for i in range(6) if s.for_layer(i) is not None)
        return [0.1, 0.5, 0.2, 0.2, 0.05, 0.9][layer]

    cache = tmp_path / "sens.json"
    sens = layer_sensitivity(measure, 6, Scheme(2, 2, 128), cache, progress=False)
    assert sens == [0.1, 0.5, 0.2, 0.2, 0.05, 0.9]
    assert len(calls) == 6
    assert ranking(sens) == (5, 1, 2, 3, 0, 4)
    again = layer_sensitivity(measure, 6, Scheme(2, 2, 128), cache, progress=False)
    assert again == sens and len(calls) == 6  # read from disk, nothing re-measured
    # an interrupted pass resumes at the first missing layer
    cache.write_text('{"probe": "kvarn_k2v2_g128", "sensitivity": [0.1, 0.5, 0.2, 0.2]}')
    assert layer_sensitivity(measure, 6, Scheme(2, 2, 128), cache, progress=False) == sens
    assert len(calls) == 8


def test_sink_choices_limit_what_is_sampled() -> None:
    """``--sinks``/``--no-sink``: the space samples exactly the sink kinds it is given."""
    every = _sample_many(SearchSpace(num_layers=30, ranking=RANK), optuna.samplers.RandomSampler(seed=2), 60)
    assert any(s.sink_tile for s in every) and {s.sink_tokens for s in every} >= {0, 1, 2, 4}
    without = _sample_many(
        SearchSpace(num_layers=30, ranking=RANK, sinks=("0",)), optuna.samplers.RandomSampler(seed=2), 60
    )
    assert not any(s.sink_len for s in without)
    tokens = _sample_many(
        SearchSpace(num_layers=30, ranking=RANK, sinks=("1", "4")), optuna.samplers.RandomSampler(seed=2), 40
    )
    assert {s.sink_tokens for s in tokens} == {1, 4} and not any(s.sink_tile for s in tokens)


def test_default_ladder_never_leaves_a_layer_unquantized() -> None:
    schemes = _sample_many(SearchSpace(num_layers=30, ranking=RANK), optuna.samplers.RandomSampler(seed=5), 60)
    assert all(s.for_layer(i) is not None for s in schemes for i in range(30))
    assert any(o.key_bits == 8 for s in schemes for o in s.overrides)
    fp16 = _sample_many(
        SearchSpace(num_layers=30, ranking=RANK, allow_fp16_layers=True), optuna.samplers.RandomSampler(seed=5), 60
    )
    assert any(s.for_layer(i) is None for s in fp16 for i in range(30))
