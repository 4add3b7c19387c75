"""Random argument lists through ``kvarn eval``'s and ``kvarn-tune``'s parsers and their checks
(parse and validate only: no model is loaded, nothing is run).

Each list is drawn from the real flags, values that fit them and values that do not (negative,
huge, non-numeric, empty, unknown words), and stray words. It parses and passes the checks, or it
is refused with a message that names a flag or value of the list.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvarn.autotune.cli as tune_cli
from kvarn.cli import build_parser
from kvarn.eval.cli import checked_schemes
from kvarn.schemes import UnknownSchemeError
from kvarn.schemes.presets import PresetError

VALUES = st.one_of(
    st.integers(-(2**66), 2**66).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(
        (
            "",
            "0",
            "1",
            "-1",
            "64",
            "256",
            "1e9",
            "cpu",
            "cuda",
            "cuda:7",
            "tpu",
            "fp16",
            "kvarn_k4v2_g128",
            "kvarn_k9v2_g128",
            "kivi2",
            "all",
            "kvarn,baselines",
            ",",
            "kl=0.01",
            "1%",
            "ppl=150%",
            "greedy=20",
            "kl=-1",
            "lots",
            "32,64",
            "48",
            "0,tile",
            "9",
            "float32",
            "bfloat16",
            "int8",
            "yes",
            "auto",
            "perplexity",
            "needle",
            "drift",
            "tpe",
            "ladder",
            "nope",
            "2048,4096",
            "10,x",
            "/nonexistent/t.txt",
            "gpl-3",
            "gpl-3,gpl-3",
            "apache-2.0",
            "kvarn-code",
            "no-such-doc",
        )
    ),  # fmt: skip
    st.text(max_size=10),
)


def argv(flags: tuple[str, ...]) -> st.SearchStrategy[list[str]]:
    """Lists of flags (valued flags mostly followed by a value) and stray words."""
    item = st.one_of(
        st.tuples(st.sampled_from(flags), VALUES).map(list),
        st.sampled_from(flags).map(lambda f: [f]),
        st.tuples(st.sampled_from(flags), VALUES).map(lambda fv: [f"{fv[0]}={fv[1]}"]),
        VALUES.map(lambda v: [v]),
    )
    return st.lists(item, max_size=5).map(lambda items: [a for it in items for a in it])


def _options(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    return tuple(o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help"))


def _eval_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["eval"]
    return parser


EVAL_FLAGS = _options(_eval_parser())
TUNE_FLAGS = _options(tune_cli.build_parser())


def _names_one_of(message: str, args: list[str]) -> bool:
    """Whether ``message`` names a flag or value of ``args`` (or the whole of an ``--x=v`` item)."""
    words = {w for a in args for w in (a, *a.split("=", 1))}
    return any(w.strip() and w in message for w in words) or any(repr(w) in message for w in words)


def _parse(parse: Callable[[list[str]], Any], args: list[str]) -> Any:
    """``parse(args)``, or None after checking argparse's refusal (exit 2, a message naming an argument)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parse(args)
        except SystemExit as e:
            message = err.getvalue()
            if e.code == 0:  # --help
                assert "--help" in args or "-h" in args
                return None
            assert e.code == 2 and "error:" in message, message
            listed = "unrecognized arguments:" in message  # argparse lists them verbatim (an empty one too)
            assert listed or _names_one_of(message, args), (args, message)
            return None


@given(argv(EVAL_FLAGS))
def test_kvarn_eval_arguments_parse_or_are_refused_by_name(args: list[str]) -> None:
    ns = _parse(lambda a: build_parser().parse_args(["eval", *a]), args)
    if ns is None:
        return
    try:
        names = checked_schemes(ns)
    except (ValueError, UnknownSchemeError, PresetError, FileNotFoundError) as e:
        message = str(e)
        defaults = {"--schemes": "all", "--device": "cpu", "--task": "perplexity"}
        assert _names_one_of(message, args) or any(v in message for v in defaults.values()), (args, message)
        return
    assert names and all(isinstance(n, str) for n in names)
    assert ns.tokens >= 2 and ns.chunk >= 1 and ns.greedy_tokens >= 0 and min(ns.lengths) >= 64


@given(argv(TUNE_FLAGS))
def test_kvarn_tune_arguments_parse_or_are_refused_by_name(args: list[str]) -> None:
    parser = tune_cli.build_parser()
    ns = _parse(lambda a: parser.parse_args(tune_cli._budget_value_joined(a)), args)
    if ns is None:
        return
    config = tune_cli._config(ns)
    if isinstance(config, str):
        assert _names_one_of(config, args) or "--calibration-docs" in config, (args, config)
        return
    assert config.trials >= 1 and config.tokens >= 64 and 0 < config.holdout < 1
    assert config.budget.limit > 0 and config.group_sizes and config.sinks


@pytest.mark.parametrize("flag", ["--text"])
def test_a_text_that_is_a_folder_is_refused_by_name(flag: str, tmp_path: Path) -> None:
    ns = tune_cli.build_parser().parse_args([flag, str(tmp_path)])
    message = tune_cli._config(ns)
    assert isinstance(message, str) and str(tmp_path) in message
    ens = build_parser().parse_args(["eval", flag, str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        checked_schemes(ens)
