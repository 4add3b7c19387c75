"""A soak run through ``vllm serve``: mixed traffic for minutes to hours against one server, then
whether it is back to idle, what it logged, how its memory grew, and whether greedy answers under
load are the answers it gave alone.

It starts ``vllm serve`` (the ``vllm`` next to this interpreter) on 127.0.0.1 with the cache of
``kv_cache_dtype`` (a kvarn preset, or ``auto`` for vLLM's own cache as a baseline), small KV memory
(:func:`default_kv_bytes` of ``kv_tokens``, by default four full-length requests' worth, so that a
burst preempts; kvarn's float32 tails take 10 blocks more per running request) and its output in a
log, and drives it from a bounded set of client threads:

- prompts of 16 tokens up to ``max_model_len - max_tokens``, slices of the bundled texts
  (``kvarn/data/*.txt``) tokenized by the model's tokenizer and sent as token ids; a quarter of the
  requests start with one of three shared prefixes (3/8 of ``max_model_len``, at most 1,536 tokens)
  and a suffix of their own, so prefix caching hits;
- half of the requests streamed (server-sent events), a tenth of those closed by the client after
  2-4 chunks (the server must abort them: "dropped"), the others whole with greedy logprobs;
- every ``burst_every_s`` each client's next request is a full-length one (a prompt one token short
  of whole blocks, ``max_tokens`` output tokens): all clients at once, more than the KV memory
  holds, so vLLM preempts. vLLM 0.32 admits a request only when its whole prompt fits
  (``scheduler_reserve_full_isl``) and then preempts only when decode outgrows the free blocks,
  which outputs of 128 tokens rarely do (``docs/reliability.md``, Soak); the server runs with ``--no-scheduler-reserve-full-isl`` (unless
  ``reserve_full_prompt``), so a prompt is admitted by its first chunk of 2,048 tokens and a burst's
  second chunks preempt;
- "check" prompts (``checks`` slices of ~300 tokens, 32 greedy tokens each): their answers are first
  recorded on the idle server, each alone, then one in eight requests under load re-asks one of
  them; each answer is compared with its alone answer, token ids exactly. In float32 vLLM's CPU ops
  compute a request alike in any batch (``docs/reliability.md``), so a difference is a fault.

When the time is up (or on Ctrl-C) clients finish the requests they have in flight; then the tool
waits for the server to go idle (``idle_s``) and reads its ``/metrics``: KV-cache usage, running and
waiting requests, preemptions. A thread samples the resident memory (``VmRSS``) of the server's
process tree every ``rss_every_s``; growth is the last sample over the first after warm-up (the
first 10% of the load or 60 s, whichever is longer). The log up to then is scanned for ``ERROR``
lines and tracebacks. :func:`failures` says what makes a run fail. The command line
(``tools/soak.py``) prints progress lines and the table, writes JSON and a section of
``docs/reliability.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvarn.testing.greedy import agree, first_difference
from kvarn.testing.serve import Completion, complete, read_metrics, stream_completion, vllm_server


def _option(default: Any, help: str, **cli: Any) -> Any:
    """A :class:`SoakConfig` field with what its option of ``tools/soak.py`` says: ``help`` (argparse's
    text: ``%(default)s`` is the default) and ``cli`` (``flag`` where it is not the field's name,
    ``choices``)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class SoakConfig:
    """What a soak run serves and sends (see the module doc). Each field is an option of
    ``tools/soak.py``: its name with dashes, less a trailing ``_s`` (``--burst-every``), and its help."""

    minutes: float = _option(60.0, "minutes of traffic (default %(default)s)")
    model: str = _option("smollm2-135m", "model alias or folder (default %(default)s)")
    kv_cache_dtype: str = _option(
        "kvarn_k4v2_g128", "a kvarn preset, or auto for vLLM's own cache as a baseline (default %(default)s)"
    )
    dtype: str = _option(
        "float32",
        "model dtype (default %(default)s: where a greedy answer must not depend on its batch)",
        choices=("float32", "bfloat16"),
    )
    clients: int = _option(12, "client threads (default %(default)s)")
    max_model_len: int = _option(4096, "(default %(default)s)")
    max_num_seqs: int = _option(32, "(default %(default)s)")
    max_tokens: int = _option(
        128,
        "most output tokens of an ordinary request, 16 up to this (default %(default)s); prompts take up to "
        "--max-model-len less this",
    )
    kv_tokens: int | None = _option(
        None,
        "KV memory (--kv-cache-memory-bytes of the server) that holds about this many tokens of the cache "
        "(default 4 x --max-model-len: a burst of --clients full-length requests does not fit, so vLLM "
        "preempts); VLLM_CPU_KVCACHE_SPACE is removed from the server's environment, since it would override it",
    )
    kv_cache_memory_bytes: int | None = _option(None, "KV memory in bytes, instead of --kv-tokens")
    burst_every_s: float = _option(
        300.0, "seconds between bursts: each client's next request a full-length prompt (default %(default)s)"
    )
    checks: int = _option(8, "check prompts (default %(default)s)")
    check_len: int = _option(300, "tokens of a check prompt (default %(default)s)")
    check_tokens: int = _option(32, "greedy tokens of a check (default %(default)s)")
    idle_s: float = _option(
        20.0, "seconds to wait after the load for no running request and no used KV block (default %(default)s)"
    )
    rss_every_s: float = _option(10.0, "seconds between RSS samples")
    progress_every_s: float = _option(60.0, "seconds between progress lines")
    seed: int = _option(0, "seed of the clients' choices (default %(default)s)")
    reserve_full_prompt: bool = _option(
        False,
        "keep vLLM's admission (a request only when its whole prompt fits: it then rarely preempts); by "
        "default the server runs with --no-scheduler-reserve-full-isl, so that bursts preempt",
    )
    serve_args: tuple[str, ...] = _option((), "extra `vllm serve` argument (repeatable)", flag="--serve-arg")


SCHEDULE = ("check", "plain", "stream", "prefix", "stream", "plain", "prefix-stream", "stream")  # one in 8: a check
DROP_EVERY = 10  # one streamed request in ten is closed by its client mid-stream
PREFIXES = 3


def default_kv_bytes(model_dir: Path, kv_cache_dtype: str, dtype: str, tokens: int, max_num_seqs: int) -> int:
    """KV memory (``--kv-cache-memory-bytes``) that holds about ``tokens`` tokens of ``model_dir``'s
    model in ``kv_cache_dtype``: a kvarn preset's tiles plus its sink pools (one slot per sequence),
    or vLLM's own cache at the model's ``dtype`` (1 byte per element for ``fp8*``)."""
    import json

    import torch

    cfg = json.loads((model_dir / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    torch_dtype = getattr(torch, dtype)
    if kv_cache_dtype.startswith("kvarn"):
        from kvarn.schemes import get_scheme
        from kvarn.vllm.pools import pool_bytes

        sc = get_scheme(kv_cache_dtype)
        tiles = -(-tokens // sc.group_size)
        pools = layers * pool_bytes(sc, heads, head_dim, torch_dtype, max_num_seqs)
        return int(tiles * layers * heads * sc.tile_bytes(head_dim) + pools)
    element = 1 if kv_cache_dtype.startswith("fp8") else torch_dtype.itemsize
    return int(tokens * layers * heads * 2 * head_dim * element)


def corpus_ids(model_dir: Path) -> list[int]:
    """The bundled texts (``kvarn/data/*.txt``, in name order) tokenized by the model's tokenizer,
    one stream of token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    data = resources.files("kvarn").joinpath("data")
    texts = [
        f.read_text(encoding="utf-8") for f in sorted(data.iterdir(), key=lambda f: f.name) if f.name.endswith(".txt")
    ]
    return [int(t) for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class Prompts:
    """Token-id prompts drawn from one corpus stream: random slices, shared prefixes, checks."""

    ids: list[int]
    longest: int  # the longest prompt: max_model_len less the most output tokens
    prefix_len: int
    check_len: int
    checks: int

    @property
    def burst_len(self) -> int:
        """A burst's prompt: one token short of whole 128-token blocks, so that its first output
        tokens need a new block while the burst holds the KV memory."""
        return max(16, self.longest // 128 * 128 - 1)

    def slice(self, rng: random.Random, length: int) -> list[int]:
        start = rng.randrange(0, len(self.ids) - length + 1)
        return self.ids[start : start + length]

    def any_length(self, rng: random.Random) -> list[int]:
        """16 tokens up to :attr:`longest`, log-uniform (short prompts as often as long ones)."""
        return self.slice(rng, round(16 * (self.longest / 16) ** rng.random()))

    def prefix(self, i: int) -> list[int]:
        start = 1000 * i + 500
        return self.ids[start : start + self.prefix_len]

    def shared(self, rng: random.Random) -> list[int]:
        """A shared prefix (one of :data:`PREFIXES`) with a suffix of its own, 16-512 tokens."""
        suffix = min(rng.randint(16, 512), self.longest - self.prefix_len)
        return self.prefix(rng.randrange(PREFIXES)) + self.slice(rng, suffix)

    def check(self, i: int) -> list[int]:
        start = 50 + i * (len(self.ids) - self.check_len - 50) // self.checks
        return self.ids[start : start + self.check_len]


def prompts_for(ids: list[int], cfg: SoakConfig) -> Prompts:
    """The prompt source of ``cfg``: prefixes 3/8 of ``max_model_len`` (at most 1,536 tokens).

    Raises:
        ValueError: the corpus is shorter than the longest prompt, or the sizes leave no room.
    """
    longest = cfg.max_model_len - max(cfg.max_tokens, cfg.check_tokens)
    prefix_len = min(1536, cfg.max_model_len * 3 // 8)
    check_len = min(cfg.check_len, longest)
    if longest < 64 or prefix_len + 16 > longest or len(ids) < max(longest, 1000 * PREFIXES + prefix_len) + 1:
        raise ValueError(f"max_model_len={cfg.max_model_len} with max_tokens={cfg.max_tokens}: prompts do not fit "
                         f"(corpus {len(ids)} tokens, longest prompt {longest})")  # fmt: skip
    return Prompts(ids, longest, prefix_len, check_len, cfg.checks)


@dataclass
class Tally:
    """What the clients did, updated under :attr:`lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    served: int = 0
    streamed: int = 0
    dropped: int = 0
    errors: int = 0
    bursts: int = 0
    burst_requests: int = 0
    prefix_requests: int = 0
    in_flight: int = 0
    error_samples: list[str] = field(default_factory=list)
    check_results: list[dict[str, Any]] = field(default_factory=list)

    def next_request(self) -> int:
        with self.lock:
            self.sent += 1
            self.in_flight += 1
            return self.sent - 1

    def next_stream(self) -> int:
        with self.lock:
            self.streamed += 1
            return self.streamed - 1


@dataclass
class _Load:
    """What the client threads share: the server, the prompts, the alone answers, the clock."""

    url: str
    name: str
    cfg: SoakConfig
    prompts: Prompts
    alone: list[Completion]
    start: float
    deadline: float
    stop: threading.Event
    tally: Tally


def _client(i: int, load: _Load) -> None:
    """One client: requests back to back until the deadline or the stop event (see the module doc)."""
    rng = random.Random(load.cfg.seed * 1000 + i)
    joined = 0  # the last burst this client took part in
    t = load.tally
    while not load.stop.is_set() and time.monotonic() < load.deadline:
        n = t.next_request()
        kind = SCHEDULE[n % len(SCHEDULE)]
        burst = int((time.monotonic() - load.start) // load.cfg.burst_every_s)
        try:
            tokens = rng.randint(16, load.cfg.max_tokens)
            if burst > joined and kind != "check":
                joined = burst
                with t.lock:
                    t.bursts = max(t.bursts, burst)
                    t.burst_requests += 1
                kind = "stream" if i % 2 else "plain"
                ids, tokens = load.prompts.slice(rng, load.prompts.burst_len), load.cfg.max_tokens
            elif kind.startswith("prefix"):
                with t.lock:
                    t.prefix_requests += 1
                ids = load.prompts.shared(rng)
            else:
                ids = load.prompts.any_length(rng)
            if kind == "check":
                _check(rng.randrange(load.cfg.checks), load)
            elif kind.endswith("stream"):
                s = t.next_stream()
                close = 2 + s // DROP_EVERY % 3 if s % DROP_EVERY == 1 else None
                got = stream_completion(load.url, load.name, ids, tokens, close_after=close)
                if not got.done and close is None:
                    raise ValueError(f"stream of {len(ids)} tokens ended after {got.chunks} chunks without [DONE]")
                if not got.done:
                    with t.lock:
                        t.dropped += 1
                    continue
            else:
                complete(load.url, load.name, ids, tokens)
            with t.lock:
                t.served += 1
        except Exception as e:  # every failure is counted and the client goes on
            with t.lock:
                t.errors += 1
                if len(t.error_samples) < 20:
                    t.error_samples.append(f"{kind} at {time.monotonic() - load.start:.0f} s: {e!r}"[:600])
        finally:
            with t.lock:
                t.in_flight -= 1


def _check(j: int, load: _Load) -> None:
    """Check prompt ``j`` under load, compared with its alone answer (token ids)."""
    got = complete(load.url, load.name, load.prompts.check(j), load.cfg.check_tokens)
    alone = load.alone[j].greedy
    diff = first_difference(alone, got.greedy)
    row = {"check": j, "at_s": round(time.monotonic() - load.start, 1), "cached_tokens": got.cached,
           "first_difference": diff, "near_tie": diff is not None and agree(alone, got.greedy) is None}  # fmt: skip
    with load.tally.lock:
        load.tally.check_results.append(row)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, from ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def tree_rss(root: int) -> int:
    """Bytes resident (``VmRSS``) in ``root``'s process tree, ``root`` itself not counted."""
    total = 0
    for pid in _descendants(root)[1:]:
        with contextlib.suppress(OSError):
            m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
            total += int(m.group(1)) * 1024 if m else 0
    return total


@contextlib.contextmanager
def _sampling(every_s: float, origin: Callable[[], float], samples: list[tuple[float, int]]) -> Iterator[None]:
    """Appends ``(seconds since origin(), bytes)`` of this process's children's tree every ``every_s``
    (the tool starts no process but the server)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            samples.append((round(time.monotonic() - origin(), 1), tree_rss(os.getpid())))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)")
KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def _wait_idle(url: str, idle_s: float) -> dict[str, float]:
    """``/metrics`` once no request runs or waits and no KV block is used, or after ``idle_s``."""
    deadline = time.monotonic() + idle_s
    while True:
        m = read_metrics(url)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if (busy == 0 and m.get("vllm:kv_cache_usage_perc", 0) == 0) or time.monotonic() > deadline:
            return m
        time.sleep(1)


def run(cfg: SoakConfig, log: Path, env: Mapping[str, str], progress: Callable[[str], None] = print) -> dict[str, Any]:
    """One soak run (module doc); ``log`` receives the server's output, ``env`` is its environment.
    Ctrl-C (``KeyboardInterrupt``) during the load ends it early; the rest runs and the result says
    ``interrupted``. Returns the result (:func:`failures` and :func:`table` read it)."""
    from kvarn.models import resolve_model

    model_dir = resolve_model(cfg.model, dtype=None if cfg.dtype == "float32" else cfg.dtype)
    name = cfg.model if not Path(cfg.model).is_dir() else Path(cfg.model).name
    kv_bytes = cfg.kv_cache_memory_bytes or default_kv_bytes(
        model_dir, cfg.kv_cache_dtype, cfg.dtype, cfg.kv_tokens or 4 * cfg.max_model_len, cfg.max_num_seqs
    )
    prompts = prompts_for(corpus_ids(model_dir), cfg)
    args = [str(model_dir), "--served-model-name", name, "--kv-cache-dtype", cfg.kv_cache_dtype, "--dtype", cfg.dtype,
            "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(cfg.max_model_len),
            "--max-num-seqs", str(cfg.max_num_seqs), "--seed", "0", "--enforce-eager",
            "--enable-prompt-tokens-details", *([] if cfg.reserve_full_prompt else ["--no-scheduler-reserve-full-isl"]),
            *cfg.serve_args]  # fmt: skip
    server_env = {k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the bytes
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()
    clock = {"origin": t0}
    with vllm_server(args, log, env=server_env) as url, _sampling(cfg.rss_every_s, lambda: clock["origin"], rss):
        start_s = time.monotonic() - t0
        progress(f"server healthy after {start_s:.0f} s; recording {cfg.checks} check answers alone")
        alone = [complete(url, name, prompts.check(j), cfg.check_tokens) for j in range(cfg.checks)]
        before = read_metrics(url)
        start = time.monotonic()
        clock["origin"] = start
        load = _Load(url, name, cfg, prompts, alone, start, start + cfg.minutes * 60, threading.Event(), Tally())
        threads = [threading.Thread(target=_client, args=(i, load), daemon=True) for i in range(cfg.clients)]
        for th in threads:
            th.start()
        interrupted = _drive(load, threads, rss, progress)
        duration = time.monotonic() - start
        progress(f"load over after {duration:.0f} s; waiting up to {cfg.idle_s:.0f} s for the server to go idle")
        metrics = _wait_idle(url, cfg.idle_s)
        rss.append((round(time.monotonic() - start, 1), tree_rss(os.getpid())))
        text = log.read_text(errors="replace")  # before the server stops: its shutdown logs engine errors
    t = load.tally
    warm_s = max(0.1 * duration, 60.0)
    warm = next((b for s, b in rss if s >= warm_s), None)
    end = rss[-1][1] if rss else None
    kv = KV_TOKENS.findall(text)
    return {
        "config": {**dataclasses.asdict(cfg), "serve_args": list(cfg.serve_args)},
        "kv_cache_memory_bytes": kv_bytes, "kv_tokens": int(kv[-1].replace(",", "")) if kv else None,
        "server_start_s": round(start_s, 1), "duration_s": round(duration, 1), "interrupted": interrupted,
        "requests": t.sent, "served": t.served, "streamed": t.streamed, "dropped": t.dropped, "errors": t.errors,
        "abandoned": t.in_flight, "error_samples": t.error_samples, "bursts": t.bursts,
        "burst_requests": t.burst_requests, "prefix_requests": t.prefix_requests,
        "preemptions": int(metrics.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)),
        "checks_compared": len(t.check_results),
        "checks_differing": sum(r["first_difference"] is not None for r in t.check_results),
        "check_results": t.check_results,
        "alone_cached_tokens": [a.cached for a in alone],
        "idle_kv_usage": metrics.get("vllm:kv_cache_usage_perc"),
        "idle_running": metrics.get("vllm:num_requests_running"),
        "idle_waiting": metrics.get("vllm:num_requests_waiting"),
        "prefix_cache_hits": metrics.get("vllm:prefix_cache_hits_total"),
        "prefix_cache_queries": metrics.get("vllm:prefix_cache_queries_total"),
        "rss_samples": rss, "rss_warm_s": warm_s, "rss_warm_bytes": warm, "rss_end_bytes": end,
        "rss_growth_pct": None if warm is None or end is None else round(100 * (end - warm) / warm, 1),
        "error_lines": [line[:400] for line in text.splitlines() if ERROR_LINE.search(line)][:50],
        "error_line_count": sum(1 for line in text.splitlines() if ERROR_LINE.search(line)),
    }  # fmt: skip


def _drive(load: _Load, threads: list[threading.Thread], rss: list[tuple[float, int]],
           progress: Callable[[str], None]) -> bool:  # fmt: skip
    """Waits for the clients, printing progress; the first Ctrl-C stops new requests, a second one
    stops waiting for those in flight. Returns whether it was interrupted."""
    t, every = load.tally, load.cfg.progress_every_s
    interrupted = False
    next_line = time.monotonic() + every
    while any(th.is_alive() for th in threads):
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            if interrupted:
                progress(f"stopped waiting for {t.in_flight} requests in flight")
                break
            interrupted = True
            load.stop.set()
            progress(f"interrupted: waiting for {t.in_flight} requests in flight (Ctrl-C again: stop waiting)")
        if time.monotonic() >= next_line:
            next_line += every
            preempted = "?"
            with contextlib.suppress(OSError, ValueError):
                preempted = f"{read_metrics(load.url).get('vllm:num_preemptions_total', 0):.0f}"
            with t.lock:
                differ = sum(r["first_difference"] is not None for r in t.check_results)
                line = (f"{time.monotonic() - load.start:6.0f} s: {t.sent} requests ({t.served} served, "
                        f"{t.streamed} streamed, {t.dropped} dropped, {t.errors} errors), {len(t.check_results)} "
                        f"checks ({differ} differing), {t.bursts} bursts, {preempted} preemptions, {t.in_flight} in flight")  # fmt: skip
            progress(line + (f", RSS {rss[-1][1] / 2**30:.2f} GiB" if rss else ""))
    return interrupted
