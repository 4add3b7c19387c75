"""kvarn for MLA (DeepSeek-style latent attention) on vLLM's CPU backend: a quantized latent cache.

An MLA layer caches one row per token, the latent ``c`` (``kv_lora_rank``) and the RoPE key part
``k_pe``. Decode scores the query, absorbed into latent space, against ``[c, k_pe]`` and sums ``c``
as values: multi-query attention over one 576-wide row. kvarn stores each tile of ``group_size``
rows as one record of :mod:`kvarn.codec.latent` (latent at ``key_bits``, RoPE 16-bit, as KVarN
does): one vLLM block = one tile, its page one record (``[num_blocks, 1, record_bytes]`` uint8).

Everything else is kvarn's standard machinery, planned once per step by the shared planner
(:mod:`kvarn.vllm.planner`): partial tiles wait unquantized in each request's own lookahead blocks
(:mod:`kvarn.vllm.tail`: a page of one record holds ``rows_per_page`` latent rows, loaded into the
step's scratch tiles and saved back by :meth:`KvarnMLAImpl.store`), exact first tokens in the sink
pool (``max_num_seqs`` slots, allocated before vLLM sizes the KV cache).
What is vLLM's: the layer (weight absorption, the up-projection of prefill), the metadata, and the
prefill attention over the step's own tokens (vLLM's CPU MLA prefill, SDPA).

Limits, all checked at start-up (:mod:`kvarn.vllm.admission`): vLLM's CPU platform only (attention
here is PyTorch: each decode step dequantizes the tiles it reads; there are no Triton kernels for
this layout), one scheme on every layer (no per-layer overrides), a latent width that is a
multiple of 128, no sparse MLA. Chunked prefill and prefix caching are turned off (vLLM's CPU
platform does the same for its own MLA backend): a prefill then attends only its own tokens.
vLLM hands an MLA impl's cache update only slot ids, so kvarn layers' ``MLAAttention.update_kv_cache``
is routed to :meth:`KvarnMLAImpl.store` (:func:`kvarn.vllm.patches.patch_mla_update_kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm.model_executor.layers.attention.mla_attention import (  # isort: skip
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)

from kvarn.codec.latent import dequantize_latent, quantize_latent, rope_dtype
from kvarn.vllm.backend import PackedTileBackend
from kvarn.vllm.context import EngineSpec, EngineState, current_config, engine_state, tail_counted
from kvarn.vllm.forward import gather_full_tiles, write_rows
from kvarn.vllm.pages import packed_spec
from kvarn.vllm.planner import Planner, shared_planner
from kvarn.vllm.step import StepTensors, Writes
from kvarn.vllm.tail import read_rows, write_page_rows
from kvarn.vllm.tail_spec import with_tail


@dataclass
class MLAStep:
    """One step of a kvarn MLA group: the writes of :class:`StepTensors`, and what decode rows read.

    Decode rows are the step's first requests (vLLM orders decodes first), one new token each.
    """

    writes: StepTensors  # tail/sink writes, the tail moves and the tiles that became full (attention rows unused)
    table: torch.Tensor  # [D, W] int64 blocks of the full tiles each decode row reads (0-padded)
    tiles: torch.Tensor  # [D] int64 full tiles read
    tail_slot: torch.Tensor  # [D] int64 scratch tile of the partial tile (0 when tail_lens is 0)
    tail_lens: torch.Tensor  # [D] int64 rows of it read (the new token included)
    sink_slot: torch.Tensor  # [D] int64 sink slot read
    sink_rows: torch.Tensor  # [D] int64 exact rows replacing tile 0's first rows (0: none)
    scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [S, T, L + R] set by store


class MLAPlanner(Planner[MLAStep]):
    """The shared planner of an MLA model's kvarn layers: a step is one :class:`MLAStep`.

    Raises ``NotImplementedError`` for a request that computes several tokens after cached ones.
    """

    def plan(self, m: CommonAttentionMetadata) -> MLAStep:
        plans, decode = self.plan_requests(m)
        t = self.scheme.group_size
        for p in plans:
            if p.ctx and p.q_len > 1:
                raise NotImplementedError(
                    f"kvarn {self.scheme.name} (MLA): a request computes {p.q_len} tokens after {p.ctx} cached "
                    "ones (chunked prefill, prefix caching or speculative decoding), which the MLA path does "
                    "not serve: its prefill attends the step's own tokens only"
                )
        table = m.block_table_tensor[: m.num_reqs]
        writes = self.writes(plans, m, decode)
        rows = plans[: next((i for i, p in enumerate(plans) if p.q_len > 1), len(plans))]  # decodes lead
        n_full = [0 if p.dummy else (p.ctx + 1) // t for p in rows]
        width = max(n_full, default=0) or 1
        blocks = [p.row[:n] + [0] * (width - n) for p, n in zip(rows, n_full, strict=True)]
        tail = [0 if p.dummy else (p.ctx + 1) % t for p in rows]
        slot = [(p.read_slot if p.staged(t) else p.new_slot) if n else 0 for p, n in zip(rows, tail, strict=True)]
        sink = [p.sink_read if p.sink_slot >= 0 and n else 0 for p, n in zip(rows, n_full, strict=True)]

        def i64(x: list[Any]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long).to(table.device)

        return MLAStep(
            writes=writes,
            table=i64(blocks).view(len(rows), width),
            tiles=i64(n_full),
            tail_slot=i64(slot),
            tail_lens=i64(tail),
            sink_slot=i64([max(p.sink_slot, 0) for p in rows]),
            sink_rows=i64(sink),
        )


class KvarnMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata[Any]]):
    """vLLM's MLA metadata, plus the step's :class:`MLAStep` (``metadata.kvarn``)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.planner = shared_planner(engine_state(vllm_config), kv_cache_spec.block_size, layer_names, MLAPlanner)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> MLACommonMetadata[Any]:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.kvarn = self.planner.build(common_attn_metadata)  # type: ignore[attr-defined]
        return md


def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as ``[blocks, 1, page_bytes]`` uint8 (vLLM binds it ``[blocks, 1, bytes]`` or ``[blocks, bytes]``)."""
    pages = kv_cache.view(torch.uint8)
    return pages if pages.dim() == 3 else pages.unsqueeze(1)


class KvarnMLAImpl(CPUMLAImpl):
    """vLLM's CPU MLA, with the latent cache stored as kvarn tiles and each request's partial tile in
    its own lookahead blocks; owns the layer's sink pool (allocated by :meth:`process_weights_after_loading`)."""

    kvarn_pools = True  # see kvarn.vllm.live

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state: EngineState = engine_state(get_current_vllm_config(), create=True)
        self.spec = self.state.spec
        self.scheme = self.spec.scheme
        self.width = self.kv_lora_rank + self.qk_rope_head_dim
        self.rope_type = rope_dtype(self.spec.dtype)
        self.nbytes = self.spec.record_bytes
        self.layout = self.spec.layout
        self.sink: torch.Tensor | None = None  # [slots, capacity, L + R] for schemes with a sink
        self.allocated = False

    def layer_spec(self, spec: AttentionSpec, layer_name: str) -> AttentionSpec:
        """The layer's packed spec: a page of one tile record of the latent and RoPE rows."""
        return packed_spec(spec, self.scheme, self.nbytes)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM's (weight absorption), then the layer's sink pool (once), allocated before vLLM measures
        memory for the KV cache and counted against it."""
        super().process_weights_after_loading(act_dtype)
        if self.allocated:
            return
        spec, cap = self.spec, self.spec.sink_capacity
        if cap:
            self.sink = torch.zeros(spec.slots, cap, self.width, dtype=spec.dtype, device=spec.device)
        self.state.reserve(spec.slots * cap * self.width * spec.dtype.itemsize)
        self.allocated = True

    # ---- store ---------------------------------------------------------------------------------
    @staticmethod
    def _write(pool: torch.Tensor | None, rows: torch.Tensor, w: Writes | None) -> None:
        """:func:`kvarn.vllm.forward.write_rows` of rows ``[N, L + R]`` into a pool ``[S, R, L + R]``."""
        if pool is not None:
            write_rows(pool.unsqueeze(1), rows.unsqueeze(1), w)

    def store(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, step: MLAStep) -> None:
        """Commit the step's rows: the staged rows of partial tiles from their pages into the step's
        scratch tiles, this step's rows into them and the sink, tiles that became full into their
        pages, and this step's rows of partial tiles into their lookahead pages. The scratch tiles
        then hold what :meth:`forward_mqa` reads of each partial tile."""
        st = step.writes
        assert st.tail is not None and st.scratch is not None
        n = st.num_tokens
        rows = torch.cat([kv_c_normed[:n], k_pe[:n].reshape(n, -1).to(kv_c_normed.dtype)], dim=1)
        pages = _pages(kv_cache)
        stage = step.scratch = st.scratch.rows(st.tail.slots, rows, self.scheme.group_size)  # [S, T, L + R]
        if st.tail.loads is not None:
            slot, row = st.tail.loads[:2]
            stage[slot, row] = read_rows(pages, st.tail, self.layout)[:, 0].to(stage.dtype)
        self._write(stage, rows, st.stage_pre)
        self._write(stage, rows, st.stage_post)  # scratch slots are the step's own: no slot is read and reused
        self._write(self.sink, rows, st.sink_writes)
        if st.full_blocks is not None:
            tiles = gather_full_tiles(stage, rows, st, self.scheme.group_size, token_dim=1)  # [F, T, L + R]
            latent, rope = torch.split(tiles, [self.kv_lora_rank, self.qk_rope_head_dim], dim=2)
            pages[st.full_blocks, 0, : self.nbytes] = quantize_latent(latent, rope, self.scheme, self.rope_type)
        if st.tail.saves is not None:
            write_page_rows(pages, rows.index_select(0, st.tail.saves[0]).unsqueeze(1), st.tail, self.layout)

    # ---- decode --------------------------------------------------------------------------------
    def forward_mqa(
        self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata[Any], layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Absorbed queries ``[B, heads, L + R]`` over packed tiles, then the staged partial tile."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        step: MLAStep = attn_metadata.kvarn  # type: ignore[attr-defined]
        b, t = q.shape[0], self.scheme.group_size
        pages = _pages(kv_c_and_k_pe_cache)[:, 0]
        table, tiles = step.table[:b], step.tiles[:b]
        w = table.shape[1]
        rec = pages.index_select(0, table.reshape(-1))[:, : self.nbytes]
        keys = dequantize_latent(rec, self.scheme, self.kv_lora_rank, self.qk_rope_head_dim, self.rope_type)
        keys = keys.view(b, w * t, self.width)
        if self.sink is not None:  # exact first rows over tile 0's
            rows = torch.arange(self.sink.shape[1], device=q.device)
            exact = (rows[None, :] < step.sink_rows[:b, None]).unsqueeze(-1)
            head = keys[:, : self.sink.shape[1]]
            keys[:, : self.sink.shape[1]] = torch.where(exact, self.sink[step.sink_slot[:b]].float(), head)
        stage = step.scratch if step.scratch.numel() else keys.new_zeros(1, t, self.width)  # no store: warm-up
        keys = torch.cat([keys, stage[step.tail_slot[:b]].float()], dim=1)  # [B, W*T + T, L + R]
        pos = torch.arange(keys.shape[1], device=q.device)
        valid = torch.where(
            pos[None, :] < w * t, pos[None, :] < tiles[:, None] * t, pos[None, :] - w * t < step.tail_lens[:b, None]
        )
        keys = keys.masked_fill(~valid[..., None], 0.0)  # rows no one wrote (scratch, padding) may hold NaN
        scores = torch.einsum("bhd,bnd->bhn", q.float(), keys) * self.scale
        probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)  # warm-up rows
        out = torch.einsum("bhn,bnl->bhl", probs, keys[..., : self.kv_lora_rank])
        return out.to(q.dtype), None


class KvarnMLABackend(PackedTileBackend, CPUMLABackend):
    """Selected by the plugin for MLA models on the CPU when ``kv_cache_dtype`` is a kvarn preset."""

    backend_name = "KVARN_MLA"
    impl_cls = KvarnMLAImpl
    builder_cls = KvarnMLAMetadataBuilder
    block_multiple = 16

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent + RoPE width; the plugin checks the latent is a multiple of 128

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % 16 == 0

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """A layer's spec is kept: it arrives packed and with its tail (:meth:`KvarnMLAImpl.layer_spec`,
        through :func:`kvarn.vllm.patches.patch_attention_kv_cache_spec`); a spec of no particular layer
        becomes the packed spec (:meth:`PackedTileBackend.customize_spec`) as a
        :class:`kvarn.vllm.tail.TailMLASpec`: each request holds its tail's lookahead blocks."""
        if spec.state_content_bytes is not None:
            return spec
        config = current_config()
        engine = EngineSpec.from_config(config)
        packed = packed_spec(spec, engine.scheme, cls.record_bytes(engine, spec))
        return with_tail(packed, engine.layout, config, counted=tail_counted(config))  # type: ignore[no-any-return]

    @classmethod
    def record_bytes(cls, engine: EngineSpec, spec: AttentionSpec) -> int:
        """The record of one tile at the MLA layers' widths (:attr:`EngineSpec.record_bytes`)."""
        return engine.record_bytes
