"""Render the README's table of measured figures from ``docs/results.json``; ``--check`` exits 1
naming each figure the README, the JSON and the docs sections disagree on.

The command line of :mod:`kvarn.bench.results`, whose docstring says what is checked.
"""

from kvarn.bench.results import main

if __name__ == "__main__":
    raise SystemExit(main())
