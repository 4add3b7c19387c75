"""A model's logits at the positions of greedy completions, from transformers: the magnitudes the
bfloat16 tolerance of :mod:`kvarn.testing.greedy` is measured in, and the completion's logprobs as
another implementation rounds them.

A bfloat16 logit ``z`` lies on a grid of step ``2^(floor(log2|z|) - 7)``, so how far a logprob may
move between two summation orders depends on how large the logits are, which the logprobs alone do
not say (they are the logits less one constant). The model is run in float32 on each prompt and its
completion; a bfloat16 model's logits are those within a few percent, and the tolerance takes the
step as at most ``|z| / 128``, which covers that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CARRY = 30.0  # nats below the top: tokens further down hold under e^-30 x vocab of the probability


@dataclass(frozen=True)
class Forced:
    """Per request, per completion position ``i`` (the logits after ``prompt + completion[:i]``):
    ``scales``, the largest ``|z|`` of the logits that carry the probability there (within
    :data:`CARRY` nats of the top), and ``logprobs``, the logprob of ``completion[i]``."""

    scales: list[list[float]]
    logprobs: list[list[float]]


def forced(model: str | Path, prompts: list[list[int]], completions: list[list[int]], dtype: str = "float32") -> Forced:
    """Each completion fed to the model after its prompt (transformers, eager, in ``dtype``)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype))  # in eval mode
    scales, logprobs = [], []
    with torch.inference_mode():
        for prompt, done in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + done[:-1]])
            z = net(ids, logits_to_keep=len(done)).logits[0].float()  # [len(done), vocab]
            carry = z >= z.max(dim=-1, keepdim=True).values - CARRY
            scales.append(torch.where(carry, z.abs(), 0.0).amax(dim=-1).tolist())
            lp = torch.log_softmax(z, dim=-1).gather(1, torch.tensor(done)[:, None])[:, 0]
            logprobs.append(lp.tolist())
    return Forced(scales, logprobs)
