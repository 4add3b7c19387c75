"""Reporting: Pareto front, table, JSON round trip, plot (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvarn.eval import EvalResult, format_table, pareto_front, plot_pareto, read_json, write_json
from kvarn.eval.metrics import MetricSums, leading_matches


def result(name: str, bits: float, kl: float) -> EvalResult:
    return EvalResult(name, bits, 20.0, 1.0, kl, 0.9, 3, 512, 1.0)


RESULTS = [
    result("fp16", 16.0, 0.0),
    result("kvarn_k4v2_g128", 3.5, 0.01),
    result("fp8", 8.0, 0.02),  # dominated by kvarn_k4v2_g128
    result("kivi2", 3.0, 0.2),
    result("turboquant3", 3.5, 0.3),  # same bits as kvarn_k4v2_g128, worse KL
]


def test_pareto_front() -> None:
    assert pareto_front(RESULTS) == {"fp16", "kvarn_k4v2_g128", "kivi2"}


def test_table_marks_the_front() -> None:
    lines = format_table(RESULTS).splitlines()
    assert lines[0].split()[0] == "scheme" and len(lines) == 6
    row = {ln.split()[0]: ln for ln in lines[1:]}
    assert "*" in row["kivi2"] and "*" not in row["fp8"]
    md = format_table(RESULTS, markdown=True).splitlines()
    assert md[0].startswith("| scheme") and md[1].startswith("|---")


def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_json(RESULTS, path, {"model": "m"})
    assert read_json(path) == RESULTS


def test_plot(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    plot_pareto(RESULTS, path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_pareto(RESULTS[:1], path)


def test_metrics() -> None:
    import torch

    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    same = MetricSums()
    same.add(ref, ref, torch.tensor([0, 2]))
    assert same.mean_kl == pytest.approx(0.0, abs=1e-7) and same.top1_agreement == 1.0
    other = MetricSums()
    flipped = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    other.add(ref, flipped, torch.tensor([0, 2]))
    p = ref[0].exp()
    assert other.mean_kl == pytest.approx(float((p * (ref[0] - flipped[0])).sum()) / 2, rel=1e-5)
    assert other.top1_agreement == 0.5
    assert other.ppl > same.ppl
    assert leading_matches([1, 2, 3], [1, 2, 4, 5]) == 2 and leading_matches([], [1]) == 0


def test_block_bootstrap_is_deterministic_and_brackets_the_mean() -> None:
    import torch

    from kvarn.eval.metrics import block_bootstrap_means, interval

    g = torch.Generator().manual_seed(1)
    noisy = torch.randn(1024, 1, generator=g) + 0.5  # [positions, 1]
    draws = block_bootstrap_means(noisy, block=64)
    assert draws.shape == (2000, 1) and torch.equal(draws, block_bootstrap_means(noisy, block=64))
    lo, hi = interval(draws[:, 0])
    assert lo < float(noisy.mean()) < hi
    # 16 blocks of 64 iid N(0,1): the mean's standard error is 1/32; a 90% interval is about +-1.645/32 wide
    assert hi - lo == pytest.approx(2 * 1.645 / 32, rel=0.25)
    # constant data: no spread at all; a short last block (1000 = 15 x 64 + 40) is weighed by its length
    lo, hi = interval(block_bootstrap_means(torch.full((1000, 1), 2.0), block=64)[:, 0])
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    with pytest.raises(ValueError, match="block >= 1"):
        block_bootstrap_means(noisy, block=0)


def test_metric_sums_intervals_contain_the_point_estimates() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    sums = MetricSums()
    for _ in range(8):  # 8 chunks of 32 positions over a 50-token vocabulary
        ref = torch.randn(32, 50, generator=g).log_softmax(-1)
        logp = (ref + 0.3 * torch.randn(32, 50, generator=g)).log_softmax(-1)
        sums.add(ref, logp, torch.randint(50, (32,), generator=g))
    (p_lo, p_hi), (k_lo, k_hi) = sums.intervals(block=32)
    d = torch.cat(sums.per_position)[:, 0].mean()
    assert p_lo < 100 * float(torch.expm1(d)) < p_hi
    assert 0.0 < k_lo < sums.mean_kl < k_hi


def test_needle_and_drift_tables() -> None:
    from kvarn.eval import DriftResult, NeedleResult, format_drift_table, format_needle_table

    def needle(name: str, lengths: list[int], hits: list[list[bool]]) -> NeedleResult:
        return NeedleResult(name, 3.57, lengths, [0.0, 1.0], [1, 2], hits, [["a", "b"]] * len(lengths), 1.0)

    rows = [needle("fp16", [2048, 8192], [[True, True], [True, False]]), needle("k", [2048], [[False, True]])]
    assert rows[0].rates == [1.0, 0.5] and rows[0].to_dict()["rates"] == [1.0, 0.5]
    table = format_needle_table(rows, markdown=True).splitlines()
    assert table[0] == "| scheme | bits/elem | 2048 tokens | 8192 tokens | seconds |"
    assert table[2] == "| fp16 | 3.570 | 2/2 | 1/2 | 1.0 |" and table[3] == "| k | 3.570 | 1/2 | - | 1.0 |"
    d = DriftResult("fp16", 16.0, 256, 512, [512, 40], [-3e-10, 0.0126], 2.0)
    assert d.mean_divergence == 276.0 and d.mean_kl == pytest.approx(0.0063)
    line = format_drift_table([d]).splitlines()[1].split()
    assert line == ["fp16", "16.000", "276.0", "512", "40", "0.0063", "-3e-10", "0.0126", "2.0"]
