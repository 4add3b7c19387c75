"""Where does the first tile's damage come from? Proxy ablations without the fp16 sink tile.

Each variant round-trips all tiles with the reference kvarn_k4v2_g128 codec, then restores part of
the first tile exactly: its keys, its values, or only token 0 (the attention sink of this text);
``token0 apart`` also quantizes tile 0 with token 0 replaced by token 1 (as if token 0 were stored
on its own in fp16 and left out of the tile's ranges).
"""

from __future__ import annotations

import torch

from tools.experiments.attn_proxy import TILE, capture, layer_error
from tools.experiments.decode_eval import scheme_roundtrip


def run(mode: str, name: str = "kvarn_k4v2_g128") -> float:
    rt = scheme_roundtrip(name)
    errs = []
    for q, k, v in capture():
        h, t, d = k.shape
        k_in, v_in = k.clone(), v.clone()
        if mode == "token0 apart":
            k_in[:, 0], v_in[:, 0] = k[:, 1], v[:, 1]
        kq, vq = rt(k_in.reshape(-1, TILE, d), v_in.reshape(-1, TILE, d))
        kq, vq = kq.reshape(h, t, d), vq.reshape(h, t, d)
        if mode == "keys of tile 0":
            kq[:, :TILE] = k[:, :TILE]
        elif mode == "values of tile 0":
            vq[:, :TILE] = v[:, :TILE]
        elif mode in ("token0", "token0 apart"):
            kq[:, 0], vq[:, 0] = k[:, 0], v[:, 0]
        elif mode == "key of token0":
            kq[:, 0] = k[:, 0]
        errs.append(layer_error(q, k, v, kq, vq))
    return sum(errs) / len(errs)


if __name__ == "__main__":
    q, k, v = capture()[5]
    norms = k.norm(dim=-1)
    print("layer 5 key norm token0 / median:", (norms[:, 0] / norms.median(dim=1).values).tolist())
    print("layer 5 value norm token0 / median:", (v.norm(dim=-1)[:, 0] / v.norm(dim=-1).median(dim=1).values).tolist())
    for mode in ("keys of tile 0", "values of tile 0", "token0", "key of token0", "token0 apart"):
        print(f"{mode:20s} attn-err {run(mode):.5f}", flush=True)
    torch.set_printoptions(precision=3)
