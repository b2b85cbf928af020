#!/usr/bin/env bash
# Second test line: .venv-vllm023 with vLLM 0.23.0, the vLLM that vLLM-Ascend 0.23.0.post1 runs on
# (idempotent). vLLM 0.23.0's PyPI wheel is its CUDA build: it is installed --no-deps on this
# machine's CPU torch, then its requirements minus the CUDA torch stack and GPU kernels
# (scripts/vllm_requirements.py), then this package with the test extra and Mooncake (TCP).
# Its compiled kernels do not load here; config, scheduler, KV-connector API and the Python
# around them do, which is what the unit tests and the real-Scheduler round trip need.
# Usage: bash scripts/setup_vllm023.sh        (env PYTHON=python3.11 picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup-vllm023] %s\n' "$*"; }

VENV=.venv-vllm023
PYTHON="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip install -q "$@"; }

log "pip, the CPU torch and packaging"
pip_q -U pip
pip_q "torch==2.13.0+cpu" packaging
log "vllm==0.23.0 without its dependencies"
pip_q --no-deps "vllm==0.23.0"
log "vLLM 0.23.0's requirements that have a CPU build"
"$VPY" scripts/vllm_requirements.py > "$VENV/vllm-cpu-requirements.txt"
pip_q -r "$VENV/vllm-cpu-requirements.txt"
log "this package (test extra) and Mooncake's TCP build"
pip_q -e ".[test]" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

"$VPY" -c "import torch, vllm, mooncake.engine, pd_connector.connector; print('[setup-vllm023] ok: vllm', vllm.__version__, 'torch', torch.__version__)"
