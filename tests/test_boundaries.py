"""What imports what: served code never imports the research codecs or the benchmarks, and each tool is
a command line over ``kvarn`` (no sibling tool, no ``sys.path`` edit)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted((ROOT / "tools").glob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``from a.b import c`` gives ``a.b``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package", ["kvarn.research", "kvarn.bench"])
def test_served_code_never_imports(package: str) -> None:
    own = ROOT / Path(*package.split("."))
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "kvarn").rglob("*.py"))
        if own not in p.parents and any(m == package or m.startswith(package + ".") for m in _imports(p))
    ]
    assert offenders == []


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_a_tool_imports_kvarn_not_a_sibling_nor_the_path(tool: Path) -> None:
    siblings = {p.stem for p in TOOLS} | {p.name for p in (ROOT / "tools").iterdir() if p.is_dir()}
    assert not {m.split(".")[0] for m in _imports(tool)} & (siblings | {"tools", "tests"})
    assert "sys.path" not in tool.read_text()
