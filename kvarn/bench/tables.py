"""The Markdown table the benchmark modules print and write into ``docs/``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]], left: int = 0) -> str:
    """``head`` and ``rows`` (cells already formatted) as a Markdown table: the first ``left``
    columns aligned left, the others (numbers) right.

    Example:
        >>> print(markdown_table(["scheme", "ms"], [["`a`", "1.5"]], left=1))
        | scheme | ms |
        |---|---:|
        | `a` | 1.5 |
    """
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * left + "---:|" * (len(head) - left)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
