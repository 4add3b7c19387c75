"""vLLM integration: a plugin that serves kvarn presets as KV-cache dtypes of unmodified vLLM.

Nothing here is imported by the core; importing this package does not import vLLM.
``kvarn.vllm.plugin.register`` is the ``vllm.general_plugins`` entry point; every patch of vLLM
internals is in :mod:`kvarn.vllm.patches`. Where each part lives: ``docs/architecture.md``.

Modules: ``plugin`` (registration), ``registry`` (dtype name -> Scheme, the plugin's settings),
``context`` (one engine's resolved preset and shared state, which every other part receives),
``admission`` (which models are served), ``patches`` (the vLLM seam), ``compat`` (0.32 / 0.33
differences), ``pages`` (page sizes), ``backend`` and ``mla`` (the attention backends), ``planner``,
``staging`` (a request's plan of a step), ``sinks``, ``step`` (a step's slots and tensors),
``forward`` (a layer's op launches), ``tail`` (partial tiles in tail blocks), ``live``, ``pools``,
``engine`` (a CPU ``vllm.LLM`` for tools and tests).
"""
