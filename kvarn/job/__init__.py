"""kvarn's main job (``make run``, ``python -m kvarn.job``): presets, accuracy, tune and serve steps.

Modules: :mod:`kvarn.job.steps` (the steps and the CLI), :mod:`kvarn.job.tune` (the tune step's
fast ``kvarn-tune`` setting), :mod:`kvarn.job.serve` (the vLLM step: capacity and a sample).
"""
