"""``tune()``: calibration/held-out split, sensitivity pass, Optuna study, held-out confirmation.

Data flow::

    text --split--> calibration | held-out (never seen by the search)
    calibration --> per-layer sensitivity (cached on disk) --> SearchSpace.ranking
    calibration --> study.optimize(Objective)   (minimize bits s.t. the budget constraint)
    feasible trials, fewest bits first --> re-measured on held-out --> first that meets the budget wins

A trial is feasible when the upper end of its metric's 90% chunk-bootstrap interval on the
calibration text is within the budget (``feasibility='bound'``), not merely its point estimate: on
another text of the same kind the point estimate moves by about the interval's half-width.

The library never prints or reads ``sys.argv``; :mod:`kvarn.autotune.cli` does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from kvarn.autotune.budget import Budget
from kvarn.autotune.objective import (
    CONSTRAINT,
    EvaluatorLike,
    Objective,
    best_feasible,
    bound_of,
    interval_of,
    measurement_dict,
    metric_of,
)
from kvarn.autotune.space import SINKS, SearchSpace, layer_sensitivity, parse_pair, ranking, sensitivity_key
from kvarn.eval.metrics import CONFIDENCE
from kvarn.schemes import Scheme

EvaluatorFactory = Callable[[str], EvaluatorLike]
MAX_FREE_PER_TRIAL = 20  # unmeasured (skipped) trials allowed per evaluated one before the study stops
_OPTUNA_TRIAL_LOG = "optuna.study._optimize"  # the logger that reports a failed trial


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
class TuneConfig:
    """Everything one tuning run depends on (the CLI fills it from its flags)."""

    budget: Budget
    model: str = "smollm2-135m"
    text: str | None = None  # None: the bundled text of kvarn eval (GPL-3, then Apache-2.0)
    # per part: calibration and held-out each evaluate this many tokens. 4096 (of the bundled text's
    # 4,800 / 5,080 per part): the 90% interval of a perplexity increase narrows with the tokens, for
    # a 3.18-bit preset from +-1.2 points at 1024 tokens to +-0.78 at 2048 and +-0.60 at 3752 (docs/tuning.md)
    tokens: int = 4096
    holdout: float = 0.5  # fraction of the text kept for confirmation
    split: str = "interleaved"  # how the held-out part is cut from the text (see split_text)
    trials: int = 30
    timeout: float | None = None
    seed: int = 0
    storage: str | None = None
    study_name: str | None = None
    pareto: bool = False
    allow_kv_inversion: bool = False
    sinks: tuple[str, ...] = SINKS  # sink choices (see space.py); ("0",): none
    allow_fp16_layers: bool = False  # let tiers keep layers unquantized (see space.py for why it is off)
    context: int | None = None  # tokens a sequence's sink cost is spread over; None: ``tokens``
    per_layer: bool = True
    max_protect: int = 4
    group_sizes: tuple[int, ...] = (32, 64, 128, 256)
    min_tiles: int = 4  # a group size needs this many full tiles in the evaluated tokens
    prune_tokens: int | None = -1  # -1: tokens // 2; 0 or None: no partial evaluation
    prune_slack: float = 2.0
    sensitivity_tokens: int = 256  # 0: no sensitivity pass (layers ranked by index)
    sensitivity_probe: str = "k2v2"
    cache_dir: Path | None = None
    confirm: int = 3  # feasible candidates tried on held-out text, fewest bits first
    compare: tuple[str, ...] = ()  # presets / baselines measured on held-out text for the plot
    chunk: int = 128
    progress: bool = True
    feasibility: str = "bound"  # "bound": upper confidence bound within budget (default); "point": estimate
    device: str = "cpu"  # where the model runs: cpu, cuda, cuda:<n>
    dtype: str = "float32"  # the model's dtype: float32, bfloat16, float16

    @property
    def bits_context(self) -> int:
        """Tokens a sequence's sink cost is spread over when counting bits per element."""
        return self.context or self.tokens

    def resolved_prune_tokens(self) -> int | None:
        """Tokens of the partial evaluation; None when too short to read anything quantized
        (decode mode reads a chunk's own tokens unquantized, so a prefix needs > 1 chunk)."""
        n = self.tokens // 2 if self.prune_tokens == -1 else self.prune_tokens
        return n if n and self.chunk < n < self.tokens else None


@dataclass
class Candidate:
    """One scheme with its measurements (``heldout`` None until confirmed)."""

    scheme: str
    bits: float
    calib: dict[str, Any] | None
    calib_metric: float | None
    heldout: dict[str, Any] | None = None
    heldout_metric: float | None = None
    meets_heldout: bool | None = None
    calib_bound: float | None = None  # what feasibility was decided on (the upper bound, or the point)
    calib_ci: tuple[float, float] | None = None  # the metric's 90% interval on calibration text
    heldout_ci: tuple[float, float] | None = None


@dataclass
class TuneResult:
    """What a run found. ``exit_code``: 0 ok, 2 budget unreachable, 3 no candidate held on
    held-out text, 130 interrupted."""

    config: dict[str, Any]
    winner: Candidate | None
    confirmed: list[Candidate]
    front: list[Candidate]
    closest: Candidate | None
    trials: list[dict[str, Any]]
    references: list[dict[str, Any]]
    sensitivity: list[float]
    ranking: list[int]
    study_name: str
    head_dim: int
    num_layers: int
    text_sha256: str
    seconds: float
    message: str
    exit_code: int
    interrupted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def fmt_ci(ci: tuple[float, float] | None) -> str:
    """``[low, high]`` of a 90% interval for messages and tables, or ``''`` if there is none."""
    return "" if ci is None else f"[{ci[0]:.3g}, {ci[1]:.3g}]"


def bundled_text() -> str:
    """The default tuning text: ``kvarn eval``'s bundled text (GPL-3, then Apache-2.0; 9,881 tokens)."""
    from kvarn.eval.harness import default_text

    return default_text()


SPLITS: tuple[str, ...] = ("interleaved", "contiguous")


def split_text(text: str, holdout: float, mode: str = "interleaved") -> tuple[str, str]:
    """Split ``text`` into (calibration, held-out) parts that share no paragraph.

    ``interleaved`` (default): paragraphs (blank-line separated) are dealt out in turn, a
    ``holdout`` share of them to the held-out part, so both parts sample the whole text: a document
    whose second half is more predictable (the bundled GPL-3: fp16 perplexity 19.7 on its first
    half, 16.5 on its second, where every scheme's relative damage is about twice as large) does not
    calibrate on the easy part and confirm on the hard one. ``contiguous``: the first
    ``1 - holdout`` of the text, then the rest, cut at a paragraph (else a line, else a space)
    boundary so no word straddles the two. A text with fewer than 4 paragraphs is always cut
    contiguously.
    """
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout={holdout} must be strictly between 0 and 1")
    if mode not in SPLITS:
        raise ValueError(f"split mode {mode!r} is not known; allowed: {', '.join(SPLITS)}")
    paras = [p for p in text.split("\n\n") if p.strip()]
    if mode == "interleaved" and len(paras) >= 4:
        calib: list[str] = []
        held: list[str] = []
        for i, p in enumerate(paras):  # paragraph i is held out when the running share steps up
            (held if int((i + 1) * holdout) > int(i * holdout) else calib).append(p)
        return "\n\n".join(calib), "\n\n".join(held)
    cut = int(len(text) * (1.0 - holdout))
    for sep in ("\n\n", "\n", " "):
        i = text.find(sep, cut)
        if 0 < i < len(text) - 1:
            return text[:i], text[i + len(sep) :]
    return text[:cut], text[cut:]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def model_dims(model: str) -> tuple[int, int]:
    """``(num_layers, head_dim)`` from the model's config.json (no weights loaded).

    Raises:
        kvarn.models.ModelNotFoundError: unknown alias or folder.
    """
    from kvarn.models import resolve_model

    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]), int(head_dim)


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


def harness_factory(config: TuneConfig) -> EvaluatorFactory:
    """Evaluators of the decode-mode harness, one per text part."""

    def make(text: str) -> EvaluatorLike:
        from kvarn.eval.harness import Evaluator

        ev: EvaluatorLike = Evaluator(
            config.model,
            text=text,
            tokens=config.tokens,
            chunk=config.chunk,
            device=config.device,
            dtype=config.dtype,
        )
        return ev

    return make


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", Path(s).name).strip("_").lower() or "model"


def derived_name(model: str, budget: Budget) -> str:
    """``kvarn_<model>_<budget>``, e.g. ``kvarn_smollm2_135m_1pct``."""
    return f"kvarn_{_slug(model)}_{budget.slug}"


def _candidate(t: FrozenTrial, budget: Budget, feasibility: str = "bound") -> Candidate:
    calib = t.user_attrs.get("calib")
    metric = metric_of(budget, calib) if calib else None
    decided = (bound_of(budget, calib) if feasibility == "bound" else metric) if calib else None
    return Candidate(
        t.user_attrs["scheme"], float(t.user_attrs["bits"]), calib, metric,
        calib_bound=decided, calib_ci=interval_of(budget, calib),
    )  # fmt: skip


def pareto_front(cands: list[Candidate], budget: Budget) -> list[Candidate]:
    """Non-dominated (fewer bits, better metric) measured candidates, by bits."""
    sign = 1.0 if budget.lower_is_better else -1.0
    best: float | None = None
    out = []
    for c in sorted(cands, key=lambda c: (c.bits, sign * (c.calib_metric or 0.0))):
        m = sign * float(c.calib_metric if c.calib_metric is not None else float("inf"))
        if best is None or m < best:
            out.append(c)
            best = m
    return out


def _unique(cands: list[Candidate]) -> list[Candidate]:
    seen: dict[str, Candidate] = {}
    for c in cands:
        seen.setdefault(c.scheme, c)
    return list(seen.values())


def _study_name(config: TuneConfig, space: SearchSpace, sha: str) -> str:
    sig = json.dumps(
        [
            config.model,
            sha,
            config.tokens,
            config.holdout,
            config.split,
            config.budget.to_dict(),
            repr(space),
            config.seed,
        ],
        sort_keys=True,
    )
    return f"kvarn-tune-{_slug(config.model)}-{config.budget.slug}-{hashlib.sha256(sig.encode()).hexdigest()[:10]}"


def _sensitivity(
    config: TuneConfig, evaluator: EvaluatorLike, num_layers: int, head_dim: int, calib_sha: str
) -> list[float]:
    if not config.sensitivity_tokens or not config.per_layer:
        return []
    from kvarn.models import default_cache_dir

    k, v = parse_pair(config.sensitivity_probe)
    g = 128 if 128 in config.group_sizes else min(config.group_sizes)
    probe = Scheme(k, v, g)
    key = sensitivity_key(config.model, calib_sha, config.sensitivity_tokens, probe.name, num_layers)
    cache = (config.cache_dir or default_cache_dir() / "sensitivity") / f"{key}.json"

    model_config = getattr(getattr(evaluator, "model", None), "config", None)
    if model_config is not None:
        from kvarn.hf import cache_geometry

        attention = set(cache_geometry(model_config).attention_layers)
    else:
        attention = set(range(num_layers))

    def measure(s: Scheme) -> float:
        if not any(s.for_layer(i) is not None for i in attention):
            return 0.0  # a hybrid model's recurrent layer: nothing to quantize there, no pass needed
        r = evaluator.evaluate(s, greedy=False, max_tokens=config.sensitivity_tokens, progress=False)
        return float(r.kl)

    return layer_sensitivity(measure, num_layers, probe, cache, progress=config.progress)


def tune(
    config: TuneConfig,
    factory: EvaluatorFactory | None = None,
    dims: tuple[int, int] | None = None,
    on_trial: Callable[[int, int, float | None], None] | None = None,
) -> TuneResult:
    """Search the smallest scheme within ``config.budget``; see the module docstring.

    Args:
        config: the run's settings.
        factory: text -> evaluator (default: the decode-mode harness on ``config.model``).
        dims: ``(num_layers, head_dim)``; default read from the model's config.
        on_trial: called after every trial with (evaluated trials, ``config.trials``, best
            feasible bits so far or None): the CLI's progress bar.

    ``config.trials`` counts trials that ran an evaluation; trials pruned unmeasured (they could not
    beat the best feasible bits) are free and do not count, up to ``MAX_FREE_PER_TRIAL`` per trial.
    """
    t0 = time.perf_counter()
    num_layers, head_dim = dims or model_dims(config.model)
    factory = factory or harness_factory(config)
    text = config.text if config.text is not None else bundled_text()
    calib_text, held_text = split_text(text, config.holdout, config.split)
    sha = text_hash(text)
    groups = tuple(g for g in config.group_sizes if g * config.min_tiles <= config.tokens)
    if not groups:
        raise ValueError(
            f"--tokens {config.tokens} is too short for group sizes {config.group_sizes}: a group size needs "
            f"{config.min_tiles} full tiles; raise --tokens to at least {config.min_tiles * min(config.group_sizes)}"
        )
    if config.sensitivity_tokens and config.per_layer and config.sensitivity_tokens <= config.chunk:
        raise ValueError(
            f"--sensitivity-tokens {config.sensitivity_tokens} must exceed the chunk ({config.chunk} tokens): "
            "decode mode reads quantized tiles only from the next chunk on"
        )
    calib_ev = factory(calib_text)
    sens = _sensitivity(config, calib_ev, num_layers, head_dim, text_hash(calib_text))
    t_sens = time.perf_counter()
    t_sens = time.perf_counter()
    space = SearchSpace(
        num_layers=num_layers,
        ranking=ranking(sens) if sens else (),
        group_sizes=groups,
        allow_kv_inversion=config.allow_kv_inversion,
        sinks=config.sinks,
        allow_fp16_layers=config.allow_fp16_layers,
        per_layer=config.per_layer,
        max_protect=config.max_protect,
    )
    prune_tokens = config.resolved_prune_tokens()
    pruner: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
    if prune_tokens and not config.budget.needs_greedy:
        pruner = optuna.pruners.ThresholdPruner(upper=config.budget.limit * config.prune_slack)
    study_name = config.study_name or _study_name(config, space, sha)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_name,
        storage=config.storage,
        load_if_exists=True,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=config.seed, n_startup_trials=8, multivariate=True, group=True),
        pruner=pruner,
    )
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        if t.state == TrialState.RUNNING:  # left behind by a killed process: not resumable
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
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
        bits_of=layer_mix_bits(calib_ev, config.bits_context),
        feasibility=config.feasibility,
    )
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    objective.prime(done)
    if not study.trials:
        for p in space.seeds():
            study.enqueue_trial(p, skip_if_exists=True)
    evaluated = sum(bool(t.user_attrs.get("evaluated")) for t in done)
    cap = len(study.trials) + (config.trials - evaluated) * MAX_FREE_PER_TRIAL

    def after(study: optuna.Study, trial: FrozenTrial) -> None:
        nonlocal evaluated
        evaluated += bool(trial.user_attrs.get("evaluated"))
        if on_trial is not None:
            best = best_feasible(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            on_trial(evaluated, config.trials, float(best.value) if best and best.value is not None else None)
        if evaluated >= config.trials or trial.number + 1 >= cap:
            study.stop()

    interrupted = False
    if evaluated < config.trials:
        quiet = _DropInterruptedTrial()
        logging.getLogger(_OPTUNA_TRIAL_LOG).addFilter(quiet)
        try:
            study.optimize(
                objective,
                n_trials=None,
                timeout=config.timeout,
                catch=(RuntimeError, ValueError),
                callbacks=[after],
                gc_after_trial=False,
                show_progress_bar=False,
            )
        except KeyboardInterrupt:
            interrupted = True
        finally:
            logging.getLogger(_OPTUNA_TRIAL_LOG).removeFilter(quiet)
    trials = study.get_trials(deepcopy=False)
    res = _finish(
        config, study_name, trials, space, sens, factory, held_text, sha, head_dim, num_layers, t0, interrupted
    )
    res.extra["sensitivity_seconds"] = round(t_sens - t0, 1)
    res.extra["search_seconds"] = round(res.extra.pop("search_end", time.perf_counter()) - t_sens, 1)
    return res


def _trial_rows(trials: list[FrozenTrial], budget: Budget) -> list[dict[str, Any]]:
    rows = []
    for t in trials:
        calib = t.user_attrs.get("calib")
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "scheme": t.user_attrs.get("scheme"),
                "bits": t.user_attrs.get("bits"),
                "metric": metric_of(budget, calib) if calib else None,
                "partial": t.user_attrs.get("partial"),
                "constraint": t.constraints.get(CONSTRAINT),
                "status": t.user_attrs.get("status", ""),
                "evaluated": bool(t.user_attrs.get("evaluated")),
            }
        )
    return rows


def _closest(trials: list[FrozenTrial], budget: Budget) -> Candidate | None:
    measured = [t for t in trials if CONSTRAINT in t.constraints and "scheme" in t.user_attrs]
    if not measured:
        return None
    t = min(measured, key=lambda t: (t.constraints[CONSTRAINT], t.user_attrs["bits"]))
    c = _candidate(t, budget)
    if c.calib_metric is None and "partial" in t.user_attrs:
        c.calib_metric = metric_of(budget, t.user_attrs["partial"])
    return c


def _finish(
    config: TuneConfig,
    study_name: str,
    trials: list[FrozenTrial],
    space: SearchSpace,
    sens: list[float],
    factory: EvaluatorFactory,
    held_text: str,
    sha: str,
    head_dim: int,
    num_layers: int,
    t0: float,
    interrupted: bool,
) -> TuneResult:
    budget = config.budget
    measured = [
        _candidate(t, budget, config.feasibility)
        for t in trials
        if t.state == TrialState.COMPLETE and "calib" in t.user_attrs
    ]
    front = pareto_front(_unique(measured), budget)
    best = best_feasible(trials)
    feasible = sorted(
        _unique([c for c in measured if c.calib_bound is not None and budget.met(c.calib_bound)]),
        key=lambda c: (c.bits, budget.violation(c.calib_bound or 0.0)),
    )
    cfg = {
        "model": config.model,
        "budget": budget.to_dict(),
        "tokens": config.tokens,
        "holdout": config.holdout,
        "split": config.split,
        "trials": config.trials,
        "seed": config.seed,
        "pareto": config.pareto,
        "group_sizes": list(space.group_sizes),
        "sinks": list(space.sinks),
        "allow_fp16_layers": space.allow_fp16_layers,
        "bits_context": config.bits_context,
        "prune_tokens": config.resolved_prune_tokens(),
        "feasibility": config.feasibility,
        "confidence": CONFIDENCE,
        "device": config.device,
        "dtype": config.dtype,
    }
    res = TuneResult(
        cfg, None, [], front, None, _trial_rows(trials, budget), [], sens, list(space.ranking), study_name,
        head_dim, num_layers, sha, 0.0, "", 0, interrupted,
    )  # fmt: skip
    n_done = sum(bool(t.user_attrs.get("evaluated")) for t in trials)
    if interrupted:
        res.closest = _candidate(best, budget) if best else _closest(trials, budget)
        res.message = f"interrupted after {n_done} finished trials; {resume_hint(config.storage)}"
        res.exit_code = 130
        res.seconds = time.perf_counter() - t0
        return res
    if best is None or not feasible:
        res.closest = _closest(trials, budget)
        c = res.closest
        near = (
            f"; closest trade-off: {c.scheme} at {c.bits:.4f} bits/element with {budget.metric}={c.calib_metric:.4g}"
            if c is not None and c.calib_metric is not None
            else ""
        )
        how = " (upper confidence bound)" if config.feasibility == "bound" else ""
        res.message = f"budget {budget.text} unreachable: none of {n_done} trials met it{how} on calibration text{near}"
        res.exit_code = 2
        res.seconds = time.perf_counter() - t0
        return res
    res.extra["search_end"] = time.perf_counter()
    held_ev = factory(held_text)

    def confirm(c: Candidate) -> Candidate:
        r = held_ev.evaluate(Scheme.from_name(c.scheme), greedy=budget.needs_greedy, progress=config.progress)
        c.heldout = measurement_dict(r)
        c.heldout_metric = metric_of(budget, c.heldout)
        c.heldout_ci = interval_of(budget, c.heldout)
        c.meets_heldout = budget.met(c.heldout_metric)
        return c

    for c in feasible[: max(1, config.confirm)]:
        res.confirmed.append(confirm(c))
        if c.meets_heldout:
            res.winner = c
            break
    if config.pareto:
        for c in front:
            if c.heldout is None:
                confirm(c)
    t_confirm = time.perf_counter()
    res.extra["confirm_seconds"] = round(t_confirm - res.extra["search_end"], 1)
    for name in config.compare:
        r = held_ev.evaluate(name, greedy=budget.needs_greedy, progress=config.progress)
        m = measurement_dict(r)
        res.references.append(
            {
                "name": name,
                "bits": float(r.bits_per_element),
                "heldout": m,
                "metric": metric_of(budget, m),
                "interval": interval_of(budget, m),
            }
        )
    res.extra["compare_seconds"] = round(time.perf_counter() - t_confirm, 1)
    if res.winner is None:
        c = min(res.confirmed, key=lambda c: budget.violation(c.heldout_metric or 0.0))
        res.closest = c
        res.message = (
            f"{len(res.confirmed)} candidate(s) met budget {budget.text} on calibration text but none on held-out "
            f"text; closest: {c.scheme} at {c.bits:.4f} bits/element with {budget.fmt(c.heldout_metric or 0.0)} on held-out text"
        )
        res.exit_code = 3
    else:
        w = res.winner
        res.message = (
            f"{w.scheme}: {w.bits:.4f} bits/element ({16 / w.bits:.2f}x), {budget.fmt(w.calib_metric or 0.0)} "
            f"{fmt_ci(w.calib_ci)} on calibration and {budget.fmt(w.heldout_metric or 0.0)} {fmt_ci(w.heldout_ci)} "
            f"on held-out text (budget {budget.text})"
        )
    res.seconds = time.perf_counter() - t0
    return res
