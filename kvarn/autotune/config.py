"""``TuneConfig``: every setting one tuning run depends on (the CLI fills it from its flags), and
the names derived from it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvarn.autotune.budget import Budget
from kvarn.autotune.corpus import CALIBRATION_DOCS, HELDOUT_DOCS
from kvarn.autotune.space import SINKS
from kvarn.autotune.storecost import OBJECTIVES

STRATEGIES: tuple[str, ...] = ("allocate", "ladder", "tpe")  # see kvarn.autotune.search


@dataclass
class TuneConfig:
    """Everything one tuning run depends on.

    Without ``text`` the parts are documents of different kinds (:mod:`kvarn.autotune.corpus`):
    ``calibration_docs`` for the search, ``heldout_docs`` (a kind the search never saw) for the
    confirmation; ``tokens`` is the calibration part's, shared equally by its documents, and every
    document (held-out ones too) is evaluated on that many (:attr:`sequence_tokens`). With
    ``text``, one text is split by paragraphs (``holdout``, ``split``) and each part evaluates
    ``tokens``. The 90% interval of a metric narrows with the
    tokens (docs/tuning.md, "How wide the bound is").
    """

    budget: Budget
    model: str = "smollm2-135m"
    text: str | None = None  # None: the documents below; else this text, split into two parts
    calibration_docs: tuple[str, ...] = CALIBRATION_DOCS
    heldout_docs: tuple[str, ...] = HELDOUT_DOCS
    tokens: int = 4096
    holdout: float = 0.5  # fraction of the text kept for confirmation
    split: str = "interleaved"  # how the held-out part is cut from the text (see split_text)
    strategy: str = "allocate"  # allocate: per-layer mixes of two pairs; ladder: one pair; tpe: Optuna's TPE
    trials: int = 30  # evaluated trials at most
    timeout: float | None = None
    seed: int = 0
    storage: str | None = None  # an Optuna storage URL (e.g. sqlite:///kvarn-tune.db); None: in memory
    study_name: str | None = None
    pareto: bool = False
    allow_kv_inversion: bool = False
    sinks: tuple[str, ...] = SINKS  # sink choices (see space.py); ("0",): none
    allow_fp16_layers: bool = False  # let tiers keep layers unquantized (see space.py for why it is off)
    context: int | None = None  # tokens a sequence's sink cost is spread over; None: ``tokens``
    per_layer: bool = True
    max_protect: int = 4
    group_sizes: tuple[int, ...] = (32, 64, 128, 256)
    search_tiles: bool = True  # ladder/allocate: every size of group_sizes that fits, not only the one nearest 128
    min_tiles: int = 4  # a group size needs this many full tiles in the evaluated tokens
    prune_tokens: int | None = -1  # -1: tokens // 2 with tpe or a resuming evaluator, else none; 0 or None: none
    prune_slack: float = 2.0
    sensitivity_tokens: int = 256  # 0: no sensitivity pass (layers ranked by index)
    sensitivity_probe: str = "k2v2"
    cache_dir: Path | None = None
    confirm: int = 3  # feasible candidates tried on held-out text, fewest bits first
    compare: tuple[str, ...] = ()  # presets / baselines measured on held-out text for the plot
    compare_builtin: bool = True  # also measure the built-in presets nearest the winner's bits (held-out)
    chunk: int = 128
    progress: bool = True
    feasibility: str = "bound"  # "bound": upper confidence bound within budget (default); "point": estimate
    device: str = "cpu"  # where the model runs: cpu, cuda, cuda:<n>
    dtype: str = "float32"  # the model's dtype: float32, bfloat16, float16
    objective: str = "bits"  # bits: fewest bits per element; speed: fastest measured store (tpe only)

    @property
    def allocates(self) -> bool:
        """Whether the search is the per-layer allocation (``allocate``, which needs per-layer search)."""
        return self.strategy == "allocate" and self.per_layer

    @property
    def searches_layers(self) -> bool:
        """Whether the search gives layers different precisions (and so needs the sensitivity pass)."""
        return self.per_layer and self.strategy != "ladder"

    @property
    def sequence_tokens(self) -> int:
        """Tokens of one evaluated sequence: ``tokens`` with ``text``, else the calibration
        documents' share of it in whole chunks, at least two (decode mode reads quantized tiles only
        from the second chunk on)."""
        if self.text is not None:
            return self.tokens
        share = self.tokens // max(1, len(self.calibration_docs))
        return max(2 * self.chunk, share // self.chunk * self.chunk)

    @property
    def bits_context(self) -> int:
        """Tokens a sequence's sink cost is spread over when counting bits per element."""
        return self.context or self.sequence_tokens

    def resolved_prune_tokens(self, resumes: bool = False) -> int | None:
        """Tokens of the partial evaluation; None when too short to read anything quantized
        (decode mode reads a chunk's own tokens unquantized, so a prefix needs > 1 chunk).

        By default (-1) half the tokens with TPE or with an evaluator that ``resumes`` (continues a
        prefix's measurement rather than restarting it: the documents' pooled evaluator), and none
        with the bisected searches on one ``--text``: their points lie near the budget, where a
        partial evaluation rarely prunes, and there it adds half a measurement.
        """
        if self.prune_tokens == -1 and self.strategy != "tpe" and not resumes:
            return None
        tokens = self.sequence_tokens
        n = tokens // 2 if self.prune_tokens == -1 else self.prune_tokens
        return n if n and self.chunk < n < tokens else None

    def checked_group_sizes(self) -> tuple[int, ...]:
        """The group sizes with ``min_tiles`` full tiles in ``tokens``, after checking the token counts.

        Raises:
            ValueError: none fits, the sensitivity pass would read no quantized tile, or
                ``objective`` is unknown or ``speed`` with a bisected search.
        """
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r}: choose one of {', '.join(OBJECTIVES)}")
        if self.objective == "speed" and self.strategy != "tpe":
            raise ValueError(
                "--objective speed needs --strategy tpe: the ladder and allocation searches bisect on bits"
            )
        tokens = self.sequence_tokens
        groups = tuple(g for g in self.group_sizes if g * self.min_tiles <= tokens)
        if not groups:
            docs = len(self.calibration_docs) if self.text is None else 1
            raise ValueError(
                f"--tokens {self.tokens} ({tokens} per document) is too short for group sizes {self.group_sizes}: "
                f"a group size needs {self.min_tiles} full tiles in each document; raise --tokens to at least "
                f"{self.min_tiles * min(self.group_sizes) * docs}"
            )
        if self.sensitivity_tokens and self.searches_layers and self.sensitivity_tokens <= self.chunk:
            raise ValueError(
                f"--sensitivity-tokens {self.sensitivity_tokens} must exceed the chunk ({self.chunk} tokens): "
                "decode mode reads quantized tiles only from the next chunk on"
            )
        return groups


def slug(s: str) -> str:
    """A model alias or folder as a lower-case identifier: ``"models/SmolLM2-135M"`` -> ``"smollm2_135m"``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", Path(s).name).strip("_").lower() or "model"


def derived_name(model: str, budget: Budget) -> str:
    """``kvarn_<model>_<budget>``, e.g. ``kvarn_smollm2_135m_1pct``."""
    return f"kvarn_{slug(model)}_{budget.slug}"
