"""``--bos {auto,yes,no}``: the harness prepends, keeps or drops the BOS token and says which."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvarn.eval.bos import tokenize


class Tok:
    """A tokenizer stand-in: ``adds`` says whether its config prepends BOS (id 1) itself."""

    def __init__(self, adds: bool, bos_token_id: int | None = 1) -> None:
        self.adds, self.bos_token_id = adds, bos_token_id

    def __call__(self, text: str, return_tensors: str) -> Any:
        ids = [5 + len(w) for w in text.split()]
        return SimpleNamespace(input_ids=torch.tensor([([1] if self.adds else []) + ids]))


@pytest.mark.parametrize(
    ("adds", "bos", "first", "prepended"),
    [(False, "auto", 8, False), (True, "auto", 1, True), (False, "yes", 1, True), (True, "yes", 1, True)]
    + [(True, "no", 8, False), (False, "no", 8, False)],
)
def test_bos_policy(adds: bool, bos: str, first: int, prepended: bool) -> None:
    ids, has = tokenize(Tok(adds), "the GPL text", bos)
    assert has is prepended and int(ids[0, 0]) == first
    assert ids[0, -2:].tolist() == [8, 9]  # the text itself is untouched
    assert ids.shape[1] == 3 + int(prepended)


def test_bos_errors() -> None:
    with pytest.raises(ValueError, match="defines no BOS"):
        tokenize(Tok(False, bos_token_id=None), "text", "yes")
    with pytest.raises(ValueError, match="auto, yes, no"):
        tokenize(Tok(False), "text", "maybe")
