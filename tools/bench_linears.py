"""The model's own compute per token on this CPU: what a serving run costs whatever its KV cache.

The command line of :mod:`kvarn.bench.linears`, whose docstring says what it measures and how
(``python tools/bench_linears.py --help`` lists the options).
"""

from kvarn.bench.linears import main

if __name__ == "__main__":
    raise SystemExit(main())
