"""What a ``vllm serve`` log and its ``/metrics`` say about a run: the KV capacity and the concurrency
vLLM logged at start-up, the requests its periodic stats lines show running (at most, and while
others waited), where the time went, and the preemptions."""

from __future__ import annotations

import datetime
import re
import statistics

KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
RUNNING = re.compile(r"Running: (\d+) reqs")
STATS = re.compile(
    r"(\d\d-\d\d \d\d:\d\d:\d\d)\D.*?Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
    r"([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs"
)


def kv_tokens_from_log(log: str) -> int | None:
    """The KV capacity vLLM logged (``KV cache size: 45,656 tokens``; the last one), or None."""
    found = KV_TOKENS.findall(log)
    return int(found[-1].replace(",", "")) if found else None


CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def logged_concurrency(log: str) -> float | None:
    """The "Maximum concurrency for N tokens per request: X.XXx" vLLM logged at start-up (the last), or
    None: how many requests of ``max_model_len`` tokens it plans to hold at once."""
    found = CONCURRENCY.findall(log)
    return float(found[-1][1]) if found else None


def running_while_waiting(log: str) -> float | None:
    """The median of the requests vLLM's stats lines show running while others wait (``Waiting`` > 0):
    how many the cache holds at once when the load asks for more; None without such lines."""
    held = [int(r) for *_, r, q in STATS.findall(log) if int(q) > 0]
    return float(statistics.median(held)) if held else None


def peak_running(log: str) -> int | None:
    """The most requests vLLM's periodic stats lines (``Running: 15 reqs``) show running, or None."""
    found = RUNNING.findall(log)
    return max(int(n) for n in found) if found else None


LOG_PHASES = ("prompt_phase_s", "gen_after_prompts", "decode_only_tok_per_s", "decode_only_running")


def phases(log: str) -> dict[str, float | None]:
    """Where a run's time went, from vLLM's stats lines (one per 10 s: the prompt and generation
    tokens/s of the window it closes, the requests running and waiting), all None without them:

    - ``prompt_phase_s``: from the start of the window (10 s) of the first line with a request
      running or waiting to the last line with prompt tokens (vLLM counts a prompt when its prefill
      ends): how long until every prompt was prefilled;
    - ``gen_after_prompts``: tokens generated after that line (each window's rate x its length);
    - ``decode_only_tok_per_s`` and ``decode_only_running``: the medians of generation tokens/s and
      running requests over the windows after it with none waiting and at least 80% of the most
      requests such windows show running: decode speed at the batch the cache holds.
    """
    none: dict[str, float | None] = dict.fromkeys(LOG_PHASES)
    lines = STATS.findall(log)
    seconds: list[float] = []
    for stamp, *_ in lines:  # vLLM prints no year: a step back in time is a new year
        s = (
            datetime.datetime.strptime("2001-" + stamp, "%Y-%m-%d %H:%M:%S") - datetime.datetime(2001, 1, 1)
        ).total_seconds()
        while seconds and s < seconds[-1]:
            s += 365 * 86400
        seconds.append(s)
    w = [(t, float(p), float(g), int(r), int(q)) for t, (_, p, g, r, q) in zip(seconds, lines, strict=True)]
    busy = [i for i, x in enumerate(w) if x[3] or x[4]]  # requests running or waiting
    prompts = [i for i, x in enumerate(w) if x[1] > 0]
    if not busy or not prompts:
        return none
    first, last = busy[0], prompts[-1]
    out = dict(none)
    out["prompt_phase_s"] = w[last][0] - w[first][0] + 10.0  # vLLM skips lines while idle: not the line before
    out["gen_after_prompts"] = round(sum(w[i][2] * (w[i][0] - w[i - 1][0]) for i in range(last + 1, len(w))))
    decode = [x for x in w[last + 1 :] if x[4] == 0 and x[2] > 0]
    if decode:
        top = max(x[3] for x in decode)
        held = [x for x in decode if x[3] >= 0.8 * top]
        out["decode_only_tok_per_s"] = statistics.median(x[2] for x in held)
        out["decode_only_running"] = statistics.median(x[3] for x in held)
    return out


def preemptions_from_metrics(text: str) -> int:
    """``vllm:num_preemptions`` summed over engines, from Prometheus text (the counter's ``_total``
    sample; ``_created`` timestamps ignored)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"vllm:num_preemptions(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            total += float(m.group(1))
    return int(total)
