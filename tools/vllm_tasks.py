"""Needle retrieval and drift served by vLLM: kvarn presets against the default cache, the harness's prompts.

The command line of :mod:`kvarn.bench.vllm_tasks`, whose docstring says what it measures and how
(``python tools/vllm_tasks.py --help`` lists the options).
"""

from kvarn.bench.vllm_tasks import main

if __name__ == "__main__":
    raise SystemExit(main())
