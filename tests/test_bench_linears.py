"""tools/bench_linears.py on tiny shapes: the linears a config names, and their per-token timing."""

from __future__ import annotations

from kvarn.bench import linears as lin

LLAMA_1B = {  # Llama-3.2-1B's layer shapes, as tools/realistic_model.py writes them (4 layers, SmolLM2's vocab)
    "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 49152,
}  # fmt: skip


def test_linear_shapes_follow_grouped_query_attention() -> None:
    layer, head, layers = lin.linear_shapes(LLAMA_1B)
    assert layer == [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
    assert head == (49152, 2048) and layers == 4
    # without head_dim and num_key_value_heads: head_dim = hidden / heads, as many KV heads as query heads
    layer, _, _ = lin.linear_shapes({**LLAMA_1B, "head_dim": None, "num_key_value_heads": None} | {
        "hidden_size": 576, "num_attention_heads": 9, "intermediate_size": 1536})  # fmt: skip
    assert layer[0] == (576, 576) and layer[1] == (576, 576)
    layer, _, _ = lin.linear_shapes({k: v for k, v in LLAMA_1B.items() if k != "num_key_value_heads"})
    assert layer[1] == (2048, 2048)


def test_time_linears_reports_each_row_count_per_token() -> None:
    tiny = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3, "vocab_size": 256}  # fmt: skip
    out = lin.time_linears(tiny, [16, 1], repeats=2)
    assert [r["rows"] for r in out] == [16, 1]
    for r in out:
        assert r["layers_ms_per_token"] > 0 and r["head_ms_per_token"] > 0
        # the two figures describe the same timing: ms per token x GFLOP/s = FLOPs per token
        flops_per_token = 3 * 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3)
        assert abs(r["layers_ms_per_token"] * 1e-3 * r["layers_gflops"] * 1e9 / flops_per_token - 1) < 1e-9
    text = lin.table(out)
    assert text.splitlines()[2].startswith("| 16 | ") and len(text.splitlines()) == 4
