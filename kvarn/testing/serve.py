"""``vllm serve`` started for a test or a tool: on a free loopback port, waited for, and stopped with
every process it started; a server with ``KvarnStorageConnector`` in a role, and greedy completions
with their logprobs over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarn.testing.greedy import TOP, Greedy

VLLM = Path(sys.executable).with_name("vllm")  # the console script next to this interpreter


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 60) -> None:
    """SIGINT to ``proc``'s process group (server, engine core, workers), SIGKILL after ``grace_s``;
    returns once no process of the group is left."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def vllm_server(args: list[str], log: Path, env: dict[str, str] | None = None, ready_s: float = 600) -> Iterator[str]:
    """``vllm serve *args --host 127.0.0.1 --port P`` (P free), its output in ``log``, with ``env``
    (default: this process's); yields its base URL once ``/health`` answers and stops its process
    group on exit.

    Raises:
        RuntimeError: the server exited, or was not healthy within ``ready_s`` seconds (with the
            end of its log).
    """
    port = free_port()
    cmd = [str(VLLM), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy in {ready_s:.0f} s:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        yield url
    finally:
        stop_group(proc)


@contextlib.contextmanager
def connector_server(
    model: str,
    kv_cache_dtype: str,
    role: str,
    store: Path,
    log: Path,
    *,
    dtype: str = "auto",
    max_model_len: int = 1024,
    max_num_seqs: int = 4,
    prefix_caching: bool = True,
) -> Iterator[str]:
    """``vllm serve MODEL`` with ``KvarnStorageConnector`` in ``role`` (``kv_producer``,
    ``kv_consumer`` or ``kv_both``) over the record folder ``store``, block size 128, eager, 1 GiB
    of KV space (``VLLM_CPU_KVCACHE_SPACE``) and the CPU settings of
    ``kvarn.vllm.engine.cpu_engine``; yields its URL once ``/health`` answers (see
    :func:`vllm_server`). Prompt token details are on, so that a completion reports the prompt
    tokens it did not compute."""
    transfer = {"kv_connector": "KvarnStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"storage_path": str(store)}}  # fmt: skip
    args = [model, "--kv-cache-dtype", kv_cache_dtype, "--block-size", "128", "--enforce-eager", "--dtype", dtype]
    args += ["--gpu-memory-utilization", "0.3", "--max-model-len", str(max_model_len), "--seed", "0"]
    args += ["--max-num-seqs", str(max_num_seqs), "--enable-prompt-tokens-details"]
    args += ["--kv-transfer-config", json.dumps(transfer)]
    args += [] if prefix_caching else ["--no-enable-prefix-caching"]
    with vllm_server(args, log, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}) as url:
        yield url


@dataclass(frozen=True)
class Completion:
    """A greedy completion over HTTP: its tokens with their top candidates, and the prompt tokens
    the server did not compute (``usage.prompt_tokens_details.cached_tokens``: its prefix cache
    and its KV connector)."""

    greedy: Greedy
    cached: int


def complete(url: str, model: str, ids: list[int], max_tokens: int) -> Completion:
    """``POST /v1/completions`` of the token ids ``ids``, greedy, ``max_tokens`` tokens, with the
    top :data:`~kvarn.testing.greedy.TOP` logprobs per position as token ids."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP,
            "return_tokens_as_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=900) as r:
        out = json.load(r)
    lp = out["choices"][0]["logprobs"]
    tokens = [_token_id(t) for t in lp["tokens"]]
    top = [{_token_id(t): float(v) for t, v in d.items()} for d in lp["top_logprobs"]]
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return Completion(Greedy(tokens, top), int(details.get("cached_tokens") or 0))


def _token_id(token: str) -> int:
    """The id of a token that vLLM returns as ``token_id:N`` (``return_tokens_as_token_ids``)."""
    return int(token.removeprefix("token_id:"))


@dataclass(frozen=True)
class Streamed:
    """A streamed completion as its client saw it: the chunks that carried a choice, and whether
    the server ended the stream (``data: [DONE]``; False when the client closed it first)."""

    chunks: int
    done: bool


def stream_completion(
    url: str, model: str, ids: list[int], max_tokens: int, *, close_after: int | None = None, timeout_s: float = 900
) -> Streamed:
    """``POST /v1/completions`` of the token ids ``ids`` with ``"stream": true``, greedy, ``max_tokens``
    tokens, read chunk by chunk; with ``close_after`` the client closes the connection after that
    many chunks (a client that goes away mid-stream; the server must abort the request).

    Raises:
        urllib.error.HTTPError: the server refused the request.
        ValueError: a chunk that is not a completion chunk (an error event, say).
    """
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    chunks = 0
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return Streamed(chunks, True)
            event = json.loads(data)
            if "choices" not in event:
                raise ValueError(f"not a completion chunk: {data[:500]}")
            chunks += 1
            if close_after is not None and chunks >= close_after:
                break  # leaving the block closes the socket
    return Streamed(chunks, False)


def read_metrics(url: str, timeout_s: float = 30) -> dict[str, float]:
    """The server's ``/metrics`` (Prometheus text) as ``{name: value}``, each name's samples summed
    over their labels (engines, models); ``*_created`` timestamps left out."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out
