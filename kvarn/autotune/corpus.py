"""Tuning documents of different kinds, by name: what the tuner calibrates on and confirms on.

A budget tuned on one kind of text may not hold on another, so the default search calibrates on
documents of two kinds and confirms its winner on a document of a third kind that it never saw
(docs/tuning.md, "A budget that holds on unseen text"). Every document is text the package may
ship or that every Python installation carries:

========================  ======  ==========================================================
name                      kind    text
========================  ======  ==========================================================
``gpl-3``                 legal   the GNU GPL v3 (bundled; verbatim copies are allowed)
``apache-2.0``            legal   the Apache License 2.0 (bundled)
``kvarn-code``            code    kvarn's own Python source, files sorted by path
``kvarn-code:<package>``  code    the Python source of one subpackage, e.g. ``kvarn-code:vllm``
``python-docs``           docs    the Python reference manual's topics that ``help()`` shows
                                  (``pydoc_data.topics`` of the running interpreter)
``python-docs:<i>/<n>``   docs    the ``i``-th of ``n`` equal parts of those topics
``<kind>=<path>``         kind    any text file, e.g. ``legal=/usr/share/common-licenses/GPL-2``
========================  ======  ==========================================================

Example:
    >>> [d.kind for d in documents(("gpl-3", "kvarn-code"))]
    ['legal', 'code']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

CALIBRATION_DOCS: tuple[str, ...] = ("gpl-3", "kvarn-code")  # legal and code
HELDOUT_DOCS: tuple[str, ...] = ("python-docs:1/2", "python-docs:2/2")  # a kind the calibration never saw
BUNDLED: dict[str, str] = {"gpl-3": "gpl-3.txt", "apache-2.0": "apache-2.0.txt"}


@dataclass(frozen=True)
class Document:
    """One tuning document: its ``name`` (as given), ``kind`` and ``text``."""

    name: str
    kind: str
    text: str


def _code(package: str | None) -> str:
    root = Path(str(resources.files("kvarn")))
    base = root / package if package else root
    if not base.is_dir():
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
        raise ValueError(f"kvarn-code:{package}: no such subpackage; known: {', '.join(names)}")
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(base.rglob("*.py")))


def _python_docs(part: str | None) -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions strip it from the standard library
        raise ValueError(f"python-docs: this Python has no pydoc_data ({e}); choose other documents") from None
    texts = [topics[k] for k in sorted(topics)]
    if part is None:
        return "\n\n".join(texts)
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ValueError(f"python-docs:{part}: write the part as <i>/<n>, e.g. python-docs:2/4") from None
    if not 1 <= i <= n:
        raise ValueError(f"python-docs:{part}: the part must be between 1 and {n}")
    total = sum(map(len, texts))
    lo, hi = total * (i - 1) // n, total * i // n
    out, pos = [], 0
    for t in texts:  # the topics whose first character falls in [lo, hi)
        if lo <= pos < hi:
            out.append(t)
        pos += len(t)
    return "\n\n".join(out)


def document(name: str) -> Document:
    """The document called ``name`` (see the module docstring).

    Raises:
        ValueError: an unknown name (the message lists the forms), or a file that cannot be read.
    """
    if "=" in name:
        kind, path = name.split("=", 1)
        try:
            return Document(name, kind, Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"document {name!r}: {e.strerror or e}") from None
    base, _, arg = name.partition(":")
    if base in BUNDLED and not arg:
        text = resources.files("kvarn").joinpath("data", BUNDLED[base]).read_text(encoding="utf-8")
        return Document(name, "legal", text)
    if base == "kvarn-code":
        return Document(name, "code", _code(arg or None))
    if base == "python-docs":
        return Document(name, "docs", _python_docs(arg or None))
    known = [*BUNDLED, "kvarn-code[:<package>]", "python-docs[:<i>/<n>]", "<kind>=<path>"]
    raise ValueError(f"unknown document {name!r}; known: {', '.join(known)}")


def documents(names: Sequence[str]) -> list[Document]:
    """:func:`document` of every name, in order."""
    return [document(n) for n in names]


def parse_names(text: str) -> tuple[str, ...]:
    """A comma list of document names -> a tuple (blanks dropped)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())
