"""GPU benchmark of kvarn's Triton kernels: decode attention vs 16-bit attention, and the store kernel.

The command line of :mod:`kvarn.bench.kernels`, whose docstring says what it measures and how
(``python tools/bench_kernels.py --help`` lists the options).
"""

from kvarn.bench.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
