"""Plot ``kvarn eval --json`` files as one bits-per-element vs KL frontier (docs/accuracy.md).

Usage: python tools/plot_accuracy.py RESULTS.json [MORE.json ...] OUT.png [TITLE]

Several files are merged into one plot (a scheme in a later file replaces the same name in an
earlier one), so runs measured on the same tokens at different times can share a frontier.
"""

from __future__ import annotations

import sys

from kvarn.eval import EvalResult, plot_pareto, read_json


def main(argv: list[str]) -> int:
    inputs = [a for a in argv if a.endswith(".json")]
    outputs = [a for a in argv if a.endswith(".png")]
    rest = [a for a in argv if a not in inputs and a not in outputs]
    if not inputs or len(outputs) != 1 or len(rest) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    merged: dict[str, EvalResult] = {}
    for path in inputs:
        merged.update((r.scheme, r) for r in read_json(path))
    plot_pareto(list(merged.values()), outputs[0], title=rest[0] if rest else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
