"""A griffe extension for the API pages: kvarn's docstrings title their doctests ``Example:``.

Google style reads doctests only under ``Examples:``; under ``Example:`` griffe renders them as an
admonition of plain text, whose ``>>>`` lines Markdown turns into nested quotes. This renames the
heading in the text griffe parses (never in the source), so the doctests render as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleAsExamples(griffe.Extension):
    """``Example:`` -> ``Examples:`` in every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
