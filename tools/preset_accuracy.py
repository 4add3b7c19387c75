"""Gather ``kvarn eval --json`` runs (perplexity task) into the preset measurements the package ships
(``kvarn/data/preset_accuracy.json``, read by ``kvarn presets --model``) and the table of
docs/guide/presets.md.

Each input is a JSON list of rows as ``kvarn eval --json`` writes them (``docs/accuracy_frontier_2k.json``
and ``_8k.json`` hold such rows too, each with its ``source``). Kept: kvarn schemes whose row has
a KL interval; a later file's row replaces an earlier one of the same model, scheme and length::

    python tools/preset_accuracy.py docs/accuracy_frontier_2k.json docs/accuracy_frontier_8k.json \\
        gemma2k.json gemma8k.json --doc docs/guide/presets.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvarn.autotune.recommend import DATA, gather, save, table
from kvarn.bench.doc_section import write_section

OUT = Path(__file__).resolve().parents[1] / "kvarn" / "data" / DATA


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="kvarn eval --json files (perplexity task)")
    ap.add_argument("--out", type=Path, default=OUT, help="the measurements file (default: the package's)")
    ap.add_argument("--doc", type=Path, help="replace the preset-accuracy section of this markdown page")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.runs if not p.exists()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    records = gather(args.runs)
    if not records:
        ap.error("no kvarn row with a KL interval in the given files")
    save(records, args.out)
    text = table(records)
    print(text)
    if args.doc:
        write_section(args.doc, "preset-accuracy", text, title="# Choose a preset")
    return 0


if __name__ == "__main__":
    sys.exit(main())
