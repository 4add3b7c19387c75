"""Plot a ``kvarn eval --json`` file as the bits-per-element vs KL frontier (docs/accuracy.md).

Usage: python tools/plot_accuracy.py RESULTS.json OUT.png [TITLE]
"""

from __future__ import annotations

import sys

from kvarn.eval import plot_pareto, read_json


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    plot_pareto(read_json(argv[0]), argv[1], title=argv[2] if len(argv) == 3 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
