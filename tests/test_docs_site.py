"""The documentation site builds with no warning, and the user guide stays short and self-contained.

``mkdocs build --strict`` fails on a broken link, a missing anchor, a page left out of the nav or a
docstring mkdocstrings cannot render (``mkdocs.yml``: ``strict``, ``validation``). The site is written
to a temporary folder, never into the repository.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
MAX_GUIDE_LINES = 200
# A user cannot resolve the project's internal issue numbers: the guide names none.
ISSUE_REF = re.compile(r"\bissue\s", re.IGNORECASE)


def _guide_pages() -> list[Path]:
    return sorted(GUIDE.glob("*.md"))


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed: `pip install -e '.[docs]'` (make setup installs it)",
)
def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert (tmp_path / "site" / "guide" / "serve" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "schemes" / "index.html").is_file()


def test_guide_pages_exist() -> None:
    names = {p.name for p in _guide_pages()}
    assert {"install.md", "serve.md", "presets.md", "troubleshooting.md"} <= names, names


@pytest.mark.parametrize("page", _guide_pages(), ids=lambda p: p.name)
def test_guide_page_is_short(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_GUIDE_LINES, f"{page.name}: {len(lines)} lines (at most {MAX_GUIDE_LINES})"


@pytest.mark.parametrize("page", _guide_pages(), ids=lambda p: p.name)
def test_guide_page_names_no_issue(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if ISSUE_REF.search(line)]
    assert not hits, f"{page.name} refers to issues a user cannot look up:\n" + "\n".join(hits)


def test_guide_preset_table_matches_the_builtins() -> None:
    """The table in guide/presets.md is every built-in, with the sizes ``Scheme`` computes."""
    from kvarn.schemes import BUILTINS

    text = (GUIDE / "presets.md").read_text(encoding="utf-8")
    text = re.sub(r"<!-- preset-accuracy -->.*?<!-- /preset-accuracy -->", "", text, flags=re.S)  # measured rows
    rows = re.findall(r"^\| `(kvarn_\w+)` \| (.+) \|$", text, re.MULTILINE)
    assert {name for name, _ in rows} == set(BUILTINS), rows
    for name, rest in rows:
        s = BUILTINS[name]
        k, v, tile, scales, at64, at128 = (c.strip() for c in rest.split("|"))
        assert (int(k), int(v), int(tile), scales) == (s.key_bits, s.value_bits, s.group_size, s.scale_dtype), name
        for cell, head_dim in ((at64, 64), (at128, 128)):
            bits = s.bits_per_element(head_dim=head_dim)
            assert cell == f"{bits:.4f}".rstrip("0").rstrip(".") + f" ({16 / bits:.2f}x)", (name, head_dim, cell)
