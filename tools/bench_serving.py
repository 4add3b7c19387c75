"""Serving benchmark as users run it: ``vllm serve`` with each KV cache, driven by ``vllm bench serve``.

The command line of :mod:`kvarn.bench.serving`, whose docstring says what it measures and how
(``python tools/bench_serving.py --help`` lists the options).
"""

from kvarn.bench.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
