"""The evaluation text's beginning-of-sequence token, under ``kvarn eval --bos``.

``auto`` keeps what the tokenizer's own configuration does, ``yes`` makes the text start with the
BOS token (prepending it when the tokenizer did not), ``no`` drops it when the tokenizer added it.
"""

from __future__ import annotations

from typing import Any

import torch

BOS_CHOICES = ("auto", "yes", "no")


def tokenize(tokenizer: Any, text: str, bos: str) -> tuple[torch.Tensor, bool]:
    """``([1, n] int64 ids, whether they start with a BOS token)`` under the ``bos`` policy.

    Raises:
        ValueError: ``bos`` is not one of :data:`BOS_CHOICES`, or ``yes`` with a tokenizer that
            defines no BOS token.
    """
    if bos not in BOS_CHOICES:
        raise ValueError(f"bos={bos!r} is not one of: {', '.join(BOS_CHOICES)}")
    ids: torch.Tensor = tokenizer(text, return_tensors="pt").input_ids
    bos_id = tokenizer.bos_token_id
    has = bos_id is not None and ids.shape[1] > 0 and int(ids[0, 0]) == bos_id
    if bos == "yes" and not has:
        if bos_id is None:
            raise ValueError("bos='yes': the tokenizer defines no BOS token")
        ids, has = torch.cat([torch.tensor([[bos_id]]), ids], dim=1), True
    elif bos == "no" and has:
        ids, has = ids[:, 1:], False
    return ids, has
