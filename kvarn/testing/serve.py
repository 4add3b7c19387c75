"""``vllm serve`` started for a test or a tool: on a free loopback port, waited for, and stopped with
every process it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
