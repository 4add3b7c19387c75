"""Run under vLLM 0.33.0's modules (first on PYTHONPATH): write vLLM's own outputs for the checks of
``test_vllm033_formats.py`` to the file named by argv[1] (``torch.save`` of a dict)."""

from __future__ import annotations

import sys

import torch


def main(out: str) -> None:
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS, TurboQuantConfig
    from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim
    from vllm.v1.attention.ops.ultraquant.format import slot_size
    from vllm.v1.attention.ops.ultraquant.reference import ultraquant_encode

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 17, 64, generator=g) * torch.logspace(-3, 1, 17)[:, None]
    x[0, 0, 0] = 0.0  # a zero group
    res: dict[str, object] = {"x": x}
    for rotate in (True, False):
        enc = ultraquant_encode(x, rotate=rotate)
        res[f"uq_codes_{rotate}"], res[f"uq_scales_{rotate}"] = enc.codes_packed, enc.scale_bytes
    res["tq_slot"] = {
        (p, d): TurboQuantConfig.from_cache_dtype(p, d).slot_size_aligned for p in TQ_PRESETS for d in (64, 128)
    }
    res["tq_centroids"] = {(d, b): get_centroids(d, b) for d in (64, 128) for b in (3, 4)}
    res["uq_slot"] = {d: slot_size(d) for d in (64, 128)}
    res["nvfp4_side"] = {d: nvfp4_kv_cache_full_dim(d) for d in (64, 128)}
    try:  # needs vllm.platforms and Triton importable; recorded as missing otherwise
        from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

        res["rht_signs"] = {d: _get_rht_signs(d, 0, torch.device("cpu")) for d in (64, 128)}
    except Exception as e:  # noqa: BLE001 - report, do not fail the other checks
        res["rht_signs_error"] = repr(e)
    torch.save(res, out)


if __name__ == "__main__":
    main(sys.argv[1])
