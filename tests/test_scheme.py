"""The scheme: name round-trip, validation, and the byte-size formulas."""

from __future__ import annotations

import itertools

import pytest

from kvarn.schemes import BUILTINS, LayerOverride, Scheme, SchemeError


def test_builtin_names_round_trip() -> None:
    for name, scheme in BUILTINS.items():
        assert scheme.name == name
        assert Scheme.from_name(name) == scheme


def test_reference_layout_matches_kvarn_paper() -> None:
    s = Scheme.from_name("kvarn_k4v2_g128")
    assert (s.key_bits, s.value_bits, s.group_size, s.rotation, s.scale_dtype) == (4, 2, 128, "hadamard", "fp16")
    # KVarN: 108 bytes per token per KV head at head_dim 128 -> 3.375 bits/element, 4.74x
    assert s.tile_bytes(128) == 108 * 128
    assert s.bits_per_element(128) == pytest.approx(3.375)
    assert s.compression(128) == pytest.approx(16 / 3.375)
    assert s.bits_per_element(64) == pytest.approx(3.5625)
    # the smaller scale option beats it
    assert Scheme(4, 2, 128, scale_dtype="log8").bits_per_element(128) == pytest.approx(3.1875)


@pytest.mark.parametrize(
    "scheme",
    [
        Scheme(k, v, g, rotation=r, norm_iters=it, scale_dtype=sd, sink_tile=sink == "tile", sink_tokens=n)
        for (k, v), g, r, it, sd, (sink, n) in itertools.product(
            [(4, 2), (8, 3), (2, 4)],
            [32, 256],
            ["hadamard", "none", "rhadamard"],
            [0, 8, 32],
            ["fp16", "log8"],
            [("tile", 0), ("tokens", 0), ("tokens", 1), ("tokens", 4)],
        )
    ]
    + [
        Scheme(overrides=(LayerOverride(0, 1, 8, 8), LayerOverride(29, 29))),
        Scheme(3, 3, 64, overrides=(LayerOverride(5, 7, 4, 2),)),
    ],
    ids=lambda s: s.name,
)
def test_every_option_round_trips(scheme: Scheme) -> None:
    assert Scheme.from_name(scheme.name) == scheme


def test_option_suffixes_are_documented_spellings() -> None:
    s = Scheme(
        3,
        2,
        64,
        rotation="rhadamard",
        norm_iters=4,
        scale_dtype="log8",
        sink_tile=True,
        overrides=(LayerOverride(29, 29), LayerOverride(0, 1, 8, 4)),
    )
    assert s.name == "kvarn_k3v2_g64_rot-rh_it4_s8_sink_L0-1k8v4_L29fp16"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"key_bits": 5}, "key_bits=5 is not allowed; allowed: 2, 3, 4, 8"),
        ({"value_bits": 1}, "value_bits=1"),
        ({"group_size": 100}, "group_size=100 is not allowed; allowed: 32, 64, 128, 256"),
        ({"norm_iters": -1}, "norm_iters=-1 is not allowed; allowed: 0..32"),
        ({"norm_iters": 33}, "norm_iters=33"),
        ({"rotation": "dct"}, "rotation='dct' is not allowed; allowed: hadamard, none, rhadamard"),
        ({"scale_dtype": "fp8"}, "scale_dtype='fp8'"),
        ({"sink_tile": 1}, "sink_tile=1"),
        ({"overrides": (LayerOverride(0, 3, 8, 8), LayerOverride(2, 4))}, "overlap"),
    ],
)
def test_invalid_fields_raise_naming_value_and_allowed(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(SchemeError, match=None) as e:
        Scheme(**kwargs)  # type: ignore[arg-type]
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "name", ["kvarn_k5v2_g128", "kvarn_k4v2", "k4v2_g128", "kvarn_k4v2_g128_it8", "kvarn_k4v2_g128_s8_rot-none"]
)
def test_bad_names_raise(name: str) -> None:
    with pytest.raises(SchemeError):
        Scheme.from_name(name)


def test_for_layer_and_mixed_bits_per_element() -> None:
    s = Scheme(4, 2, 128, overrides=(LayerOverride(0, 1, 8, 8), LayerOverride(3, 3)))
    assert s.for_layer(0) == Scheme(8, 8, 128)
    assert s.for_layer(3) is None
    assert s.for_layer(2) == Scheme(4, 2, 128)
    expect = (2 * Scheme(8, 8).bits_per_element(64) + 16 + 27 * Scheme(4, 2).bits_per_element(64)) / 30
    assert s.bits_per_element(64, num_layers=30) == pytest.approx(expect)


def test_tile_bytes_formula() -> None:
    for s in BUILTINS.values():
        for d in (64, 128, 256):
            t = s.group_size
            codes = t * d * (s.key_bits + s.value_bits) // 8
            assert s.tile_bytes(d) == codes + s.param_bytes * 3 * (t + d)
    with pytest.raises(SchemeError, match="head_dim=96"):
        Scheme().tile_bytes(96)


def test_exact_first_token_is_the_default_and_sink0_opts_out() -> None:
    s = Scheme()
    assert (s.sink_tokens, s.sink_tile, s.name) == (1, False, "kvarn_k4v2_g128")
    assert all(b.sink_tokens == 1 and not b.sink_tile for b in BUILTINS.values())
    off = Scheme(sink_tokens=0)
    assert off.name == "kvarn_k4v2_g128_sink0" and Scheme.from_name(off.name) == off
    assert Scheme.from_name("kvarn_k4v2_g128_s8_sink0_L3fp16").sink_tokens == 0
    # the explicit spelling of the default, canonical before the default changed, still parses
    assert Scheme.from_name("kvarn_k4v2_g128_sink1") == s
    with pytest.raises(SchemeError, match="write it as 'kvarn_k4v2_g128'"):
        Scheme.from_name("kvarn_k4v2_g128_sink01")
    # a sink tile already keeps the first tokens exact: no exact copies beside it
    tile = Scheme(sink_tile=True)
    assert tile.sink_tokens == 0 and tile == Scheme(sink_tile=True, sink_tokens=0) and tile.name.endswith("_sink")
    # the default's cost: 16 bits per sequence spread over the context
    assert s.bits_per_element(128, context=8192) == pytest.approx(3.375 + 16 / 8192)
    assert off.bits_per_element(128, context=8192) == 3.375


@pytest.mark.parametrize("n", [0, 1, 2, 4, 8])
def test_sink_tokens_name_round_trip_and_layout(n: int) -> None:
    s = Scheme.from_name(f"kvarn_k4v2_g128_s8_sink{n}_L3fp16")
    assert (s.sink_tokens, s.sink_tile, s.sink_len) == (n, False, n)
    assert Scheme.from_name(s.name) == s
    # the tiles are unchanged: same record, same bits without a context
    assert s.tile_bytes(64) == Scheme(4, 2, 128, scale_dtype="log8").tile_bytes(64)
    assert s.sink_bytes(64) == 2 * n * 64 * 2


def test_sink_tile_and_tokens_exclude_each_other() -> None:
    with pytest.raises(SchemeError, match="exclude each other"):
        Scheme(sink_tile=True, sink_tokens=2)
    with pytest.raises(SchemeError, match="sink_tokens=3 is not allowed; allowed: 0, 1, 2, 4, 8"):
        Scheme(sink_tokens=3)
    assert Scheme.from_name("kvarn_k4v2_g128_sink").sink_len == 128


def test_bits_per_element_spreads_the_sink_over_the_context() -> None:
    base = Scheme(4, 2, 128).bits_per_element(64)  # 3.5625
    assert Scheme(4, 2, 128, sink_tokens=1).bits_per_element(64, context=2048) == pytest.approx(base + 16 / 2048)
    assert Scheme(4, 2, 128, sink_tokens=0).bits_per_element(64, context=2048) == base
    tile = Scheme(4, 2, 128, sink_tile=True)
    assert tile.bits_per_element(64) == base  # the packed tiles alone
    assert tile.bits_per_element(64, context=2048) == pytest.approx((128 * 16 + 1920 * base) / 2048)
    assert tile.bits_per_element(64, context=100) == 16.0  # all of it sits in the sink tile
    mixed = Scheme(4, 2, 128, overrides=(LayerOverride(0, 0),), sink_tokens=4)
    expect = (16 + 29 * (base + 4 * 16 / 1024)) / 30
    assert mixed.bits_per_element(64, num_layers=30, context=1024) == pytest.approx(expect)
    with pytest.raises(SchemeError, match="context=0"):
        Scheme().bits_per_element(64, context=0)
