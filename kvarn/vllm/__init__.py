"""vLLM integration: a plugin that serves kvarn presets as KV-cache dtypes of unmodified vLLM.

Nothing here is imported by the core; importing this package does not import vLLM.
``kvarn.vllm.plugin.register`` is the ``vllm.general_plugins`` entry point.
"""
