"""The decode-mode harness on the real SmolLM2-135M with a short context (320 tokens, chunk 64)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvarn.eval import EvalResult, Evaluator
from kvarn.models import ModelNotFoundError
from kvarn.schemes import Scheme, UnknownSchemeError

TOKENS, CHUNK, GREEDY = 320, 64, 16


@pytest.fixture(scope="module")
def ev() -> Evaluator:
    return Evaluator("smollm2-135m", tokens=TOKENS, chunk=CHUNK, greedy_tokens=GREEDY)


@pytest.fixture(scope="module")
def k4v4(ev: Evaluator) -> EvalResult:
    return ev.evaluate("kvarn_k4v4_g64", progress=False)


def test_reference_matches_one_shot_perplexity(ev: Evaluator) -> None:
    ref = ev.reference()
    assert ref.shape == (TOKENS - 1, ev.model.config.vocab_size)
    with torch.inference_mode():
        logits = ev.model(ev.ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ev.ids[0, 1:])
    r = ev.evaluate("fp16", progress=False)
    assert r.ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert (r.kl, r.top1_agreement, r.delta_ppl_pct, r.bits_per_element) == (0.0, 1.0, 0.0, 16.0)
    assert r.greedy_agreement_tokens == GREEDY and r.tokens == TOKENS


def test_quantized_tiles_are_read_and_accuracy_is_bounded(ev: Evaluator, k4v4: EvalResult) -> None:
    # proof that quantized tiles were read: the numbers differ from fp16
    assert k4v4.kl > 1e-4 and k4v4.top1_agreement < 1.0
    # measured 2026-11-30: KL ~0.01, delta ppl within about +-2% at this length; bound with margin
    assert k4v4.kl < 0.05
    assert abs(k4v4.delta_ppl_pct) < 5.0
    assert k4v4.top1_agreement > 0.9
    # 5 full tiles, and the exact copy of token 0 (the default) spread over the text
    assert k4v4.bits_per_element == pytest.approx(
        Scheme.from_name("kvarn_k4v4_g64").bits_per_element(64, context=TOKENS)
    )
    assert k4v4.greedy_agreement_tokens is not None and 0 <= k4v4.greedy_agreement_tokens <= GREEDY


def test_fewer_bits_cost_accuracy(ev: Evaluator, k4v4: EvalResult) -> None:
    k2v2 = ev.evaluate("kvarn_k2v2_g64", greedy=False, progress=False)
    assert k2v2.kl > k4v4.kl
    assert k2v2.greedy_agreement_tokens is None


def test_prefix_and_baseline(ev: Evaluator) -> None:
    r = ev.evaluate("int8", max_tokens=192, progress=False)
    assert r.tokens == 192
    assert 0.0 < r.kl < 0.01  # int8 per token is nearly lossless
    assert r.bits_per_element > 8.0  # scales counted
    assert r.greedy_agreement_tokens is not None


def test_bad_input_errors(ev: Evaluator) -> None:
    with pytest.raises(UnknownSchemeError) as e:
        ev.evaluate("kvarn_k4v2_g127", progress=False)
    msg = str(e.value)
    assert all(name in msg for name in ("fp16", "kivi2", "kvarn_k4v2_g128"))
    with pytest.raises(ValueError, match="chunk"):
        Evaluator(chunk=0)
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        Evaluator("no-such-model")
    short = Evaluator(text="The GNU General Public License is a free license. " * 8, chunk=CHUNK)
    with pytest.raises(ValueError, match="too short"):
        short.evaluate("kvarn_k4v2_g128", progress=False)


def test_default_text_is_long_enough_for_smollm2s_context() -> None:
    from transformers import AutoTokenizer

    from kvarn.eval.harness import default_text
    from kvarn.models import resolve_model

    text = default_text()
    gpl = (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_text(encoding="utf-8")
    assert text.startswith(gpl.strip("\n")) and "Apache License" in text[len(gpl) :]
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    assert len(tok(text).input_ids) >= 8192  # --tokens 8192 evaluates SmolLM2's whole context
