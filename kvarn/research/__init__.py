"""Research codecs below 3 bits (issue 36): measured, not served.

:mod:`kvarn.research.vq` (vector quantization), :mod:`kvarn.research.lowrank` (low-rank keys),
:mod:`kvarn.research.metric` (metric-weighted coding) and :mod:`kvarn.research.baselines` (them as
baselines the decode-mode harness measures). Nothing else under ``kvarn`` imports this package, and
its baselines are not in :data:`kvarn.baselines.BASELINES`: ``tools/subbit_eval.py`` resolves their
names. Figures and commands: docs/accuracy.md, "Below 3 bits".
"""
