"""A griffe extension for the API pages: kvarn's docstrings as Markdown reads them.

kvarn's docstrings are Google style with a few reStructuredText habits, which mkdocstrings would
print literally. In the text griffe parses (never in the source) this

- renames ``Example:`` to ``Examples:``: Google style reads doctests only under ``Examples:``;
  under ``Example:`` their ``>>>`` lines become nested Markdown quotes;
- turns Sphinx roles (``:class:`~kvarn.Scheme```, ``:func:``, ``:meth:``, ...) into code spans;
- ends a line that ends in ``::`` (reST's "a literal block follows") with one colon.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")
_LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


class ExampleAsExamples(griffe.Extension):
    """Rewrites every docstring before it is parsed (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            text = _ROLE.sub(r"`\1`", text)
            obj.docstring.value = _LITERAL.sub(r"\1:", text)
