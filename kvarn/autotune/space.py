"""The search space (Optuna parameters -> a valid :class:`~kvarn.schemes.Scheme`) and the
per-layer sensitivity pass that orders layers for mixed precision.

Parameters of one trial:

* ``kv`` -- base key/value bits, e.g. ``"k4v2"``; keys never get fewer bits than values unless
  ``allow_kv_inversion`` (keys feed every attention score, values only a weighted sum);
* ``group_size``, ``rotation``, ``norm_iters``, ``scale_dtype``;
* ``sink`` -- ``"0"`` (none), ``"1"``/``"2"``/``"4"``/``"8"`` (that many first tokens also kept
  exactly: ``Scheme.sink_tokens``) or ``"tile"`` (the first tile unquantized: ``Scheme.sink_tile``);
* ``n_protect`` / ``protect_up`` -- the ``n_protect`` most sensitive layers get the bit pair
  ``protect_up`` rungs above the base on the ladder ``k2v2 < k3v2 < ... < k8v8`` (``< fp16``
  with ``allow_fp16_layers``; off by default because ``k8v8`` is near-lossless at half the bytes;
  the vLLM backend serves unquantized layers in vLLM's own 16-bit cache, except in models with
  sliding-window layers);
* ``n_demote`` / ``demote_down`` -- the ``n_demote`` least sensitive layers get the pair
  ``demote_down`` rungs below the base (clipped at the bottom rung).

Every combination maps to a valid scheme: bit pairs come from one fixed list of allowed pairs, and
the layer tiers are disjoint by construction.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna

from kvarn.schemes import ALLOWED_BITS, ALLOWED_SINK_TOKENS, LayerOverride, Scheme

ALLOWED_ROTATIONS: tuple[str, ...] = ("hadamard", "rhadamard", "none")
NORM_ITERS: tuple[int, ...] = (0, 2, 4, 8, 16)
SCALE_DTYPES: tuple[str, ...] = ("fp16", "log8")
FP16 = "fp16"
SINKS: tuple[str, ...] = ("0", "1", "2", "4", "tile")  # searched by default
SINK_CHOICES: tuple[str, ...] = ("0", "tile", *(str(n) for n in ALLOWED_SINK_TOKENS if n))  # allowed
# Tier rungs: k4v2 before k3v3 (same bits; keys matter more), k8v4 before k8v2 (values need some bits).
LADDER: tuple[str, ...] = ("k2v2", "k3v2", "k4v2", "k4v3", "k4v4", "k8v4", "k8v8")


def kv_pairs(bits: Sequence[int] = ALLOWED_BITS, allow_inversion: bool = False) -> tuple[str, ...]:
    """Allowed ``"k{K}v{V}"`` pairs, ordered by total bits then key bits."""
    pairs = [(k, v) for k in bits for v in bits if allow_inversion or k >= v]
    return tuple(f"k{k}v{v}" for k, v in sorted(pairs, key=lambda p: (p[0] + p[1], p[0])))


def parse_pair(pair: str) -> tuple[int, int]:
    """``"k4v2"`` -> ``(4, 2)``."""
    k, v = pair[1:].split("v")
    return int(k), int(v)


def _runs(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted layer indices -> maximal consecutive ``(first, last)`` runs."""
    out: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if out and layer == out[-1][1] + 1:
            out[-1] = (out[-1][0], layer)
        else:
            out.append((layer, layer))
    return out


def tier_overrides(layers: Sequence[int], pair: str | None) -> tuple[LayerOverride, ...]:
    """Overrides giving ``layers`` the bit pair ``pair`` (``None`` or ``"fp16"`` = unquantized)."""
    if pair is None or pair == FP16:
        return tuple(LayerOverride(a, b) for a, b in _runs(layers))
    k, v = parse_pair(pair)
    return tuple(LayerOverride(a, b, k, v) for a, b in _runs(layers))


def only_layer(scheme: Scheme, layer: int, num_layers: int) -> Scheme:
    """``scheme`` on layer ``layer`` only; every other layer unquantized (for sensitivity probes)."""
    others = [i for i in range(num_layers) if i != layer]
    return replace(scheme, overrides=tier_overrides(others, None))


@dataclass(frozen=True)
class SearchSpace:
    """What the tuner may choose. ``ranking`` lists layers most sensitive first.

    Example:
        >>> space = SearchSpace(num_layers=4, ranking=(3, 0, 1, 2))
        >>> space.build({"kv": "k4v2", "group_size": 128, "rotation": "hadamard", "norm_iters": 8,
        ...              "scale_dtype": "fp16", "sink": "1", "n_protect": 1, "protect_up": 2,
        ...              "n_demote": 2, "demote_down": 2}).name
        'kvarn_k4v2_g128_L1-2k2v2_L3k4v4'
    """

    num_layers: int
    ranking: tuple[int, ...] = ()
    bits: tuple[int, ...] = ALLOWED_BITS
    group_sizes: tuple[int, ...] = (32, 64, 128, 256)
    rotations: tuple[str, ...] = ALLOWED_ROTATIONS
    norm_iters: tuple[int, ...] = NORM_ITERS
    scale_dtypes: tuple[str, ...] = SCALE_DTYPES
    sinks: tuple[str, ...] = SINKS
    allow_kv_inversion: bool = False
    allow_fp16_layers: bool = False
    per_layer: bool = True
    max_protect: int = 4
    demote_step: int = 0  # 0: about a tenth of the layers

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        ranking = self.ranking or tuple(range(self.num_layers))
        if sorted(ranking) != list(range(self.num_layers)):
            raise ValueError(f"ranking {ranking} must be a permutation of 0..{self.num_layers - 1}")
        object.__setattr__(self, "ranking", tuple(ranking))
        if not self.group_sizes:
            raise ValueError("no group size left to search; allow at least one")
        if not self.sinks or any(x not in SINK_CHOICES for x in self.sinks):
            raise ValueError(f"sink choices {list(self.sinks)} are not valid; allowed: {', '.join(SINK_CHOICES)}")

    @property
    def pairs(self) -> tuple[str, ...]:
        return kv_pairs(self.bits, self.allow_kv_inversion)

    @property
    def step(self) -> int:
        return self.demote_step or max(1, self.num_layers // 10)

    @property
    def ladder(self) -> tuple[str, ...]:
        """The rungs tiers step along: one pair per total bit count, keys first, then ``fp16``."""
        allowed = set(kv_pairs(self.bits))
        top = (FP16,) if self.allow_fp16_layers else ()
        return (*(r for r in LADDER if r in allowed), *top)

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Sample one trial's parameters (define-by-run; tier steps only when a tier is used).

        The protected tier sits ``protect_up`` rungs above the base pair on :attr:`ladder`, the
        demoted tier ``demote_down`` rungs below, so tiers are always "more" and "fewer" bits and no
        two parameter settings mean the same thing twice.
        """
        p: dict[str, Any] = {
            "kv": trial.suggest_categorical("kv", self.pairs),
            "group_size": trial.suggest_categorical("group_size", self.group_sizes),
            "rotation": trial.suggest_categorical("rotation", self.rotations),
            "norm_iters": trial.suggest_categorical("norm_iters", self.norm_iters),
            "scale_dtype": trial.suggest_categorical("scale_dtype", self.scale_dtypes),
            "sink": trial.suggest_categorical("sink", self.sinks),
            "n_protect": 0,
            "n_demote": 0,
        }
        if self.per_layer:
            p["n_protect"] = trial.suggest_int("n_protect", 0, min(self.max_protect, self.num_layers))
            if p["n_protect"]:
                p["protect_up"] = trial.suggest_int("protect_up", 1, 3)
            top = self.num_layers - self.num_layers % self.step
            p["n_demote"] = trial.suggest_int("n_demote", 0, top, step=self.step)
            if p["n_demote"]:
                p["demote_down"] = trial.suggest_int("demote_down", 1, 2)
        return p

    def _rung(self, base: str, delta: int) -> str:
        """The rung ``delta`` steps above (or below) ``base`` by total bits, clipped to the ladder;
        ``base`` itself when nothing is above (below) it. Bases off the ladder (``k3v3``) work the same."""
        total = sum(parse_pair(base))
        if delta > 0:
            ups = [r for r in self.ladder if r == FP16 or sum(parse_pair(r)) > total]
            return ups[min(delta, len(ups)) - 1] if ups else base
        downs = [r for r in self.ladder if r != FP16 and sum(parse_pair(r)) < total][::-1]
        return downs[min(-delta, len(downs)) - 1] if downs else base

    def build(self, p: dict[str, Any]) -> Scheme:
        """Parameters -> scheme. Tiers: protected (most sensitive), demoted (least), the rest base."""
        k, v = parse_pair(p["kv"])
        n_protect = min(int(p.get("n_protect", 0)), self.num_layers)
        n_demote = min(int(p.get("n_demote", 0)), self.num_layers - n_protect)
        protected = list(self.ranking[:n_protect])
        demoted = list(self.ranking[self.num_layers - n_demote :]) if n_demote else []
        overrides: list[LayerOverride] = []
        protect = self._rung(p["kv"], int(p.get("protect_up", 1))) if protected else p["kv"]
        if protect != p["kv"]:
            overrides += tier_overrides(protected, protect)
        demote = self._rung(p["kv"], -int(p.get("demote_down", 1))) if demoted else p["kv"]
        if demote != p["kv"]:
            overrides += tier_overrides(demoted, demote)
        return Scheme(
            key_bits=k,
            value_bits=v,
            group_size=int(p["group_size"]),
            rotation=p["rotation"],
            norm_iters=int(p["norm_iters"]),
            scale_dtype=p["scale_dtype"],
            sink_tile=p["sink"] == "tile",
            overrides=tuple(overrides),
            sink_tokens=0 if p["sink"] == "tile" else int(p["sink"]),
        )

    def sample(self, trial: optuna.Trial) -> Scheme:
        """One trial -> one valid scheme."""
        return self.build(self.suggest(trial))

    def seeds(self) -> list[dict[str, Any]]:
        """Starting points enqueued before the sampler takes over: the shipped layout (with its exact
        first token) and two cheaper neighbours (log8 scales; 3-bit keys), where the space allows them."""
        out = []
        for kv, scale, sink in (("k4v2", "fp16", "1"), ("k4v2", "log8", "1"), ("k3v2", "log8", "1")):
            g = 128 if 128 in self.group_sizes else max(self.group_sizes)
            if kv in self.pairs and scale in self.scale_dtypes:
                p: dict[str, Any] = {
                    "kv": kv,
                    "group_size": g,
                    "rotation": self.rotations[0],
                    "norm_iters": 8 if 8 in self.norm_iters else self.norm_iters[-1],
                    "scale_dtype": scale,
                    "sink": sink if sink in self.sinks else self.sinks[0],
                }
                if self.per_layer:
                    p.update(n_protect=0, n_demote=0)
                out.append(p)
        return out


# ---- per-layer sensitivity --------------------------------------------------------------------


# 2: a plain probe name keeps one exact first token (Scheme.sink_tokens = 1); passes cached under
# key version 1 were made without it and are not reused. 3: keyed by the tokens read, not the texts
SENSITIVITY_KEY_VERSION = 3


def sensitivity_key(model: str, text_sha256: str, tokens: int, probe: str, num_layers: int) -> str:
    """Cache key of one sensitivity pass (model, hash of the tokens read, tokens, probe scheme, key
    version). Not in it: the codec's and the model's code (a change there needs ``--cache-dir``
    elsewhere or the cached file removed)."""
    raw = json.dumps([model, text_sha256, tokens, probe, num_layers, SENSITIVITY_KEY_VERSION])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def layer_sensitivity(
    measure: Callable[[Scheme], float],
    num_layers: int,
    probe: Scheme,
    cache_file: Path | None = None,
    progress: bool = True,
) -> list[float]:
    """KL (or any metric) when only one layer is quantized with ``probe``, for every layer.

    Args:
        measure: scheme -> metric on a short prefix (higher = more damage).
        num_layers: layers of the model.
        probe: low-bit scheme applied to one layer at a time; the other layers stay unquantized.
        cache_file: JSON cache, written after every layer; reused (and completed) when present.
        progress: show a tqdm bar.

    Returns:
        ``num_layers`` floats, index = layer.
    """
    done: list[float] = []
    if cache_file is not None and cache_file.is_file():
        data = json.loads(cache_file.read_text())
        if data.get("probe") == probe.name:
            done = [float(x) for x in data.get("sensitivity", [])][:num_layers]
    if len(done) == num_layers:
        return done
    from tqdm import tqdm

    def save() -> None:
        if cache_file is not None:  # after every layer: an interrupted pass resumes where it stopped
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"probe": probe.name, "sensitivity": done}))
            tmp.replace(cache_file)

    bar = tqdm(range(num_layers), desc="layer sensitivity", disable=not progress, leave=False, initial=len(done))
    for layer in range(len(done), num_layers):
        done.append(float(measure(only_layer(probe, layer, num_layers))))
        save()
        bar.update(1)
    bar.close()
    return done


def ranking(sensitivity: Sequence[float]) -> tuple[int, ...]:
    """Layers ordered most sensitive first (ties: lower index first, so deterministic)."""
    return tuple(sorted(range(len(sensitivity)), key=lambda i: (-sensitivity[i], i)))
