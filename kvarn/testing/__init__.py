"""Small models and model folders that tests, tools and docs share; nothing is downloaded.

* :mod:`kvarn.testing.builders`: random-weight models built from configs (Gemma-3-like, Llama-like,
  hybrid, MLA) and a byte-level tokenizer; ``python -m kvarn.testing.builders`` writes one.
* :mod:`kvarn.testing.synthetic`: model folders for vLLM engines (a tiny Llama of any head_dim, or a
  ``config.json`` alone for front-end checks).
* :mod:`kvarn.testing.greedy`: greedy completions of an engine and the rule by which two agree.
* :mod:`kvarn.testing.logits`: the logits' magnitudes at a completion's positions (the bfloat16 bound
  of :mod:`kvarn.testing.greedy` is measured in them).
* :mod:`kvarn.testing.layer_pages`: each layer's packed records of a request, read from an engine.
* :mod:`kvarn.testing.serve`: ``vllm serve`` on a free port, waited for and stopped.

The library never imports this package.
"""
