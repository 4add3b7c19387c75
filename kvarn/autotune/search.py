"""The search phase of ``tune()``: per-layer sensitivity, then an Optuna study on calibration text.

The study minimizes bits per element subject to the budget constraint
(:class:`~kvarn.autotune.objective.Objective`). Three strategies fill it: ``allocate`` (default)
bisects per-layer mixes of two bit pairs (:mod:`kvarn.autotune.allocate`) and ``ladder`` one
precision for all layers (:mod:`kvarn.autotune.ladder`), one enqueued trial at a time; ``tpe`` lets
Optuna's TPE sampler roam the whole :class:`~kvarn.autotune.space.SearchSpace`.
The study is named from everything that defines the search
(model, text, budget, space, seed), so the same command with the same ``storage`` resumes it.
Trials left RUNNING by a killed process are marked FAIL before the study continues.

A resumed ``allocate`` or ``ladder`` search replays the uninterrupted run's path from its first
point: every decision (which point next, which points are skipped) reads only the trials of the
current run, and a point measured before the interruption is answered from its stored
measurement (a new trial, not evaluated again). So the interrupted and resumed run measures the
same schemes and picks the same winner as one uninterrupted run. A resumed ``tpe`` search keeps
every trial but samples anew (the sampler's random state is not stored).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import optuna
from optuna.trial import FrozenTrial, TrialState

from kvarn.autotune.allocate import DEFAULT_FAMILIES, AllocationSpace, allocate, bisect_smallest
from kvarn.autotune.config import TuneConfig, slug
from kvarn.autotune.ladder import LadderSpace, rungs
from kvarn.autotune.objective import CONSTRAINT, EvaluatorLike, Objective, best_feasible
from kvarn.autotune.space import SearchSpace, layer_sensitivity, parse_pair, ranking, sensitivity_key
from kvarn.autotune.storecost import StoreCost
from kvarn.schemes import Scheme

MAX_FREE_PER_TRIAL = 20  # unmeasured (skipped) trials allowed per evaluated one before the study stops
_OPTUNA_TRIAL_LOG = "optuna.study._optimize"  # the logger that reports a failed trial

OnTrial = Callable[[int, int, float | None], None]
Space = SearchSpace | AllocationSpace | LadderSpace


def resume_hint(storage: str | None) -> str:
    """How to pick up an interrupted run: the same command with the same ``--storage``, or, when
    the study was kept in memory, the flag that makes the next run resumable."""
    if storage:
        return f"rerun with the same --storage ({storage}) to resume"
    return "nothing to resume (no --storage); pass --storage sqlite:///kvarn-tune.db to make a run resumable"


class _DropInterruptedTrial(logging.Filter):
    """Drops Optuna's report of the trial Ctrl-C stopped (a traceback and a value line): the
    interrupt is the user's, reported once by the caller with :func:`resume_hint`."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        if exc and exc[0] is not None and issubclass(exc[0], KeyboardInterrupt):
            self.dropped = True
            return False
        return not (self.dropped and record.getMessage().endswith("failed with value None."))


@dataclass
class SearchRun:
    """What the search phase leaves for the held-out check: the study's trials and their space."""

    study_name: str
    space: Space
    sensitivity: list[float]
    trials: list[FrozenTrial]
    interrupted: bool
    sensitivity_end: float  # time.perf_counter() after the sensitivity pass
    prune_tokens: int | None = None  # tokens of the partial evaluation (successive halving); None: none


def layer_mix_bits(evaluator: EvaluatorLike, context: int) -> Callable[[Scheme], float] | None:
    """Bits per element of a model with sliding-window layers at ``context`` tokens: they stay
    16-bit and weigh only their window (:meth:`kvarn.hf.CacheGeometry.bits_per_element`); None for
    a model with full attention only, or an evaluator without a model (the scheme's own figure)."""
    config = getattr(getattr(evaluator, "model", None), "config", None)
    if config is None:
        return None
    from kvarn.hf import FULL, cache_geometry

    geometry = cache_geometry(config)
    if geometry.count(FULL) == geometry.num_layers:
        return None
    return lambda scheme: geometry.bits_per_element(scheme, context)


def study_name(config: TuneConfig, space: Space, text_sha: str) -> str:
    """``kvarn-tune-<model>-<budget>-<hash of the search's definition>``."""
    sig = json.dumps(
        [
            config.model,
            text_sha,
            config.tokens,
            config.holdout,
            config.split,
            config.budget.to_dict(),
            repr(space),
            config.seed,
        ],
        sort_keys=True,
    )
    return f"kvarn-tune-{slug(config.model)}-{config.budget.slug}-{hashlib.sha256(sig.encode()).hexdigest()[:10]}"


def prefix_sha(evaluator: EvaluatorLike, tokens: int, fallback: str) -> str:
    """SHA-256 of the token ids a pass over the first ``tokens`` of each of ``evaluator``'s texts
    reads (its ``parts``' or its own ``ids``); ``fallback`` for an evaluator without ids."""
    h = hashlib.sha256()
    for part in getattr(evaluator, "parts", None) or [evaluator]:
        ids = getattr(part, "ids", None)  # [1, n] int64
        if ids is None:
            return fallback
        h.update(json.dumps(ids[0, :tokens].tolist()).encode())
    return h.hexdigest()


def quantized_layers(evaluator: EvaluatorLike, num_layers: int) -> set[int]:
    """The layers the tuner's caches quantize: attention layers, but not sliding-window ones (they
    stay 16-bit); every layer for an evaluator without a model."""
    model_config = getattr(getattr(evaluator, "model", None), "config", None)
    if model_config is None:
        return set(range(num_layers))
    from kvarn.hf import SLIDING, cache_geometry

    geometry = cache_geometry(model_config)
    return {i for i in geometry.attention_layers if geometry.layer_types[i] != SLIDING}


def sensitivity(config: TuneConfig, evaluator: EvaluatorLike, num_layers: int, calib_sha: str) -> list[float]:
    """Per-layer KL of the probe scheme on one layer at a time, cached on disk by model, the
    tokens it reads (the first ``sensitivity_tokens`` of each calibration text: an edit further
    into a text does not invalidate it) and probe; ``[]`` when the pass is off
    (``sensitivity_tokens`` 0 or no per-layer search). ``calib_sha`` keys it for an evaluator
    without token ids."""
    if not config.sensitivity_tokens or not config.searches_layers:
        return []
    from kvarn.models import default_cache_dir

    k, v = parse_pair(config.sensitivity_probe)
    g = 128 if 128 in config.group_sizes else min(config.group_sizes)
    probe = Scheme(k, v, g)
    read = prefix_sha(evaluator, config.sensitivity_tokens, calib_sha)
    key = sensitivity_key(config.model, read, config.sensitivity_tokens, probe.name, num_layers)
    cache = (config.cache_dir or default_cache_dir() / "sensitivity") / f"{key}.json"

    quantized = quantized_layers(evaluator, num_layers)

    def measure(s: Scheme) -> float:
        if not any(s.for_layer(i) is not None for i in quantized):
            return 0.0  # a recurrent or sliding-window layer: its cache is exact, no pass needed
        r = evaluator.evaluate(s, greedy=False, max_tokens=config.sensitivity_tokens, progress=False)
        return float(r.kl)

    return layer_sensitivity(measure, num_layers, probe, cache, progress=config.progress)


def planned_trials(config: TuneConfig, space: Space) -> int:
    """About how many measurements the search makes, for a progress bar's ETA (at most
    ``config.trials``): a bisection of the first family or the ladder (its top, then log2 of its
    points) and, for the allocation, one capped point for each of a few families after it (the
    default run measured three; the rest cost nothing, no cheaper than the best found)."""
    if isinstance(space, AllocationSpace):
        plan = math.ceil(math.log2(space.num_layers + 1)) + 1 + min(3, len(space.families) - 1)
    elif isinstance(space, LadderSpace):
        plan = math.ceil(math.log2(len(space.rungs))) + 1 + max(0, config.confirm - 1)
    else:
        plan = config.trials
    return max(1, min(plan, config.trials))


def make_space(
    config: TuneConfig,
    num_layers: int,
    rank: tuple[int, ...],
    groups: tuple[int, ...],
    bits: Callable[[Scheme], float] | None = None,
) -> Space:
    """The space of ``config.strategy``: layer mixes of the default families or the ladder's
    uniform schemes (on the searched tile size nearest 128, or on every searched size with
    ``config.search_tiles``; one exact first token unless sinks are off; rungs and families
    ordered by ``bits``), or TPE's whole space."""
    tiles = groups if config.search_tiles else (min(groups, key=lambda x: (abs(x - 128), x)),)
    sink = 1 if "1" in config.sinks else 0
    bits = bits or (lambda s: s.bits_per_element(64, num_layers))
    if config.strategy == "ladder":
        return LadderSpace(rungs(bits, tiles, sink))
    if config.allocates:
        top = rank or tuple(range(num_layers))
        families = sorted(
            (replace(f, group_size=g, sink_tokens=sink) for g in tiles for f in DEFAULT_FAMILIES),
            key=lambda f: bits(f.scheme(top, num_layers)),
        )  # cheapest top first, as DEFAULT_FAMILIES is at one tile size
        return AllocationSpace(num_layers=num_layers, ranking=rank, families=tuple(families))
    return SearchSpace(
        num_layers=num_layers,
        ranking=rank,
        group_sizes=groups,
        allow_kv_inversion=config.allow_kv_inversion,
        sinks=config.sinks,
        allow_fp16_layers=config.allow_fp16_layers,
        per_layer=config.per_layer,
        max_protect=config.max_protect,
    )


def open_study(config: TuneConfig, name: str, prune_tokens: int | None = None) -> optuna.Study:
    """Create or load the study ``name`` in ``config.storage`` and fail the trials a killed
    process left RUNNING (they cannot be resumed) and, for a search that enqueues one point at a
    time (allocate, ladder), WAITING: ``study.optimize`` would run that stale point in place of the
    one enqueued next. ``prune_tokens``: the partial evaluation's length (None: none, no pruner)."""
    storage = optuna.storages.get_storage(config.storage)
    pruner: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
    if prune_tokens and not config.budget.needs_greedy:
        pruner = optuna.pruners.ThresholdPruner(upper=config.budget.limit * config.prune_slack)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=config.seed)  # enqueued points
    enqueues = config.allocates or config.strategy == "ladder"
    if not enqueues:
        sampler = optuna.samplers.TPESampler(seed=config.seed, n_startup_trials=8, multivariate=True, group=True)
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        load_if_exists=True,
        direction="minimize",
        sampler=sampler,
        pruner=pruner,
    )
    states = (TrialState.RUNNING, TrialState.WAITING) if enqueues else (TrialState.RUNNING,)
    stale = study.get_trials(deepcopy=False, states=states)
    if stale:
        study_id = storage.get_study_id_from_name(name)
        for t in stale:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            storage.set_trial_state_values(trial_id, TrialState.FAIL)
    return study


def search(
    config: TuneConfig,
    calib_ev: EvaluatorLike,
    dims: tuple[int, int],
    groups: tuple[int, ...],
    text_sha: str,
    calib_sha: str,
    on_trial: OnTrial | None = None,
) -> SearchRun:
    """Run the sensitivity pass and the study on the calibration evaluator until ``config.trials``
    trials have been evaluated (or the timeout, or Ctrl-C: then ``interrupted``).

    ``dims``: ``(num_layers, head_dim)``; ``groups``: the group sizes searched; ``text_sha`` names the
    study, ``calib_sha`` keys the sensitivity cache; ``on_trial``: see :func:`kvarn.autotune.tuner.tune`.
    """
    num_layers, head_dim = dims
    sens = sensitivity(config, calib_ev, num_layers, calib_sha)
    sensitivity_end = time.perf_counter()
    bits_of = layer_mix_bits(calib_ev, config.bits_context)
    quantized = quantized_layers(calib_ev, num_layers)
    rank = ranking(sens) if sens else ()
    if len(quantized) < num_layers:  # the layers whose pair matters first (allocate bisects over them)
        rank = tuple(sorted(rank or range(num_layers), key=lambda i: i not in quantized))
    space = make_space(
        config,
        num_layers,
        rank,
        groups,
        bits_of or (lambda s: s.bits_per_element(head_dim, num_layers, config.bits_context)),
    )
    name = config.study_name or study_name(config, space, text_sha)
    prune_tokens = config.resolved_prune_tokens(resumes=bool(getattr(calib_ev, "resumes", False)))
    study = open_study(config, name, prune_tokens)
    first = len(study.trials)  # this run's trials are numbered from here on
    objective = Objective(
        space,
        config.budget,
        calib_ev,
        head_dim,
        num_layers,
        prune_tokens=prune_tokens,
        pareto=config.pareto,
        chunk=config.chunk,
        tokens=config.tokens,
        context=config.bits_context,
        bits_of=bits_of,
        feasibility=config.feasibility,
        since=first if isinstance(space, AllocationSpace | LadderSpace) else 0,
        cost_of=StoreCost(head_dim, num_layers) if config.objective == "speed" else None,
    )
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    objective.prime(done)
    if not study.trials and isinstance(space, SearchSpace):
        for p in space.seeds():
            study.enqueue_trial(p, skip_if_exists=True)
    evaluated = sum(bool(t.user_attrs.get("evaluated")) for t in done)
    cap = len(study.trials) + (config.trials - evaluated) * MAX_FREE_PER_TRIAL
    plan = planned_trials(config, space)
    if on_trial is not None:  # the sensitivity pass is over: the bar's clock starts with the search
        resumed = best_feasible(list(done))
        on_trial(
            evaluated, max(plan, evaluated), float(resumed.value) if resumed and resumed.value is not None else None
        )

    def after(study: optuna.Study, trial: FrozenTrial) -> None:
        nonlocal evaluated
        evaluated += bool(trial.user_attrs.get("evaluated"))
        if on_trial is not None:
            best = best_feasible(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            planned = max(plan, evaluated)
            on_trial(evaluated, planned, float(best.value) if best and best.value is not None else None)
        if evaluated >= config.trials or trial.number + 1 >= cap:
            study.stop()

    start = time.perf_counter()

    def stopped() -> bool:
        late = config.timeout is not None and time.perf_counter() - start >= config.timeout
        return evaluated >= config.trials or late

    def optimize(n_trials: int | None) -> None:
        study.optimize(
            objective,
            n_trials=n_trials,
            timeout=config.timeout,
            catch=(RuntimeError, ValueError),
            callbacks=[after],
            gc_after_trial=False,
            show_progress_bar=False,
        )

    def feasible_at(params: dict[str, object]) -> bool | None:
        """One enqueued trial with ``params``: met the budget or not (None: the search stopped)."""
        if stopped():
            return None
        study.enqueue_trial(params)
        optimize(1)
        t = study.trials[-1]
        if t.state == TrialState.PRUNED and str(t.user_attrs.get("status", "")).startswith("skipped"):
            return True  # no cheaper than the best feasible point: search below it
        return t.state == TrialState.COMPLETE and t.constraints.get(CONSTRAINT, 1.0) <= 0.0

    def best_bits() -> float | None:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        best = best_feasible([t for t in done if t.number >= objective.since])
        return None if best is None or best.value is None else float(best.value)

    interrupted = False
    quiet = _DropInterruptedTrial()
    logging.getLogger(_OPTUNA_TRIAL_LOG).addFilter(quiet)
    try:
        if isinstance(space, AllocationSpace):
            span = len(quantized) if len(quantized) < num_layers else None
            allocate(space, lambda f, n: feasible_at(space.point(f, n)), objective.bits, best_bits, stopped, span)
        elif isinstance(space, LadderSpace):
            found = bisect_smallest(len(space.rungs) - 1, lambda i: feasible_at(space.point(i)))
            # the rungs just above the winner, measured too, so that the held-out check, when it
            # rejects one, confirms the next rung up rather than the next rung the bisection measured
            objective.pareto = True
            for i in range(found + 1, min(len(space.rungs) - 1, found + config.confirm)) if found is not None else ():
                feasible_at(space.point(i))
        elif evaluated < config.trials:
            optimize(None)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        logging.getLogger(_OPTUNA_TRIAL_LOG).removeFilter(quiet)
    return SearchRun(
        study_name=name,
        space=space,
        sensitivity=sens,
        trials=study.get_trials(deepcopy=False),
        interrupted=interrupted,
        sensitivity_end=sensitivity_end,
        prune_tokens=prune_tokens,
    )
