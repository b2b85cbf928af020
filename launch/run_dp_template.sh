#!/usr/bin/env bash
# Start ONE data-parallel (DP) rank of an external-DP deployment as its own `vllm serve`.
#
# launch/launch_online_dp.py runs this script once per local DP rank. The seven positional
# arguments keep the order of vLLM-Ascend's run_dp_template.sh, so per-node copies written
# for that launcher keep working:
#
#   $1  devices of this rank: NPU ids for ASCEND_RT_VISIBLE_DEVICES (npu), or the CPU cores
#       for VLLM_CPU_OMP_THREADS_BIND (cpu; "" leaves vLLM's default binding)
#   $2  HTTP port of this rank's API server
#   $3  DP size      $4  DP rank      $5  DP address (master node)
#   $6  DP RPC port  $7  tensor-parallel size
#   $8… passed to `vllm serve` unchanged (e.g. --kv-transfer-config '{...}')
# $3-$6 become vLLM's --data-parallel-size/-rank/-address/-rpc-port, except with
# PD_DP_MODE=independent (below), where they are checked but not passed on.
#
# Environment (the launcher sets the PD_* ones; edit the defaults below for a fixed node):
#   PD_MODEL       model path or name (required unless MODEL below is edited)
#   PD_HOST        address the API server binds (default 0.0.0.0)
#   PD_DEVICE      npu | cpu (default: npu when `npu-smi` is on PATH, else cpu)
#   PD_DP_MODE     vllm (default): external DP through vLLM's --data-parallel-* flags (MoE
#                  models); independent: plain `vllm serve` with no --data-parallel-* flag, as
#                  vLLM requires for dense models (the launcher then puts dp_rank, dp_size and
#                  bootstrap_host into kv_connector_extra_config of --kv-transfer-config)
#   PD_SERVE_CMD   command that runs vLLM's CLI, split on whitespace (default: `vllm` when
#                  its console script works, else `$PD_PYTHON -m launch.vllm_cli`)
#   PD_PYTHON      interpreter for the checks and the fallback (default python3)
#   PD_NIC_NAME    npu: network interface for GLOO/TP/HCCL sockets
#   PD_LOCAL_IP    npu: this node's address for HCCL_IF_IP
# Other NPU settings below (HCCL_BUFFSIZE, OMP_NUM_THREADS, ...) take a value already in the
# environment over the default written here.
set -euo pipefail

MODEL=${PD_MODEL:-}
HOST=${PD_HOST:-0.0.0.0}
NIC_NAME=${PD_NIC_NAME:-}
LOCAL_IP=${PD_LOCAL_IP:-}

die() {
    echo "run_dp_template.sh: error: $*" >&2
    exit 2
}

if [[ "$#" -lt 7 ]]; then
    die "expected 7 arguments (devices port dp_size dp_rank dp_address dp_rpc_port tp_size), got $#"
fi
devices=$1
port=$2
dp_size=$3
dp_rank=$4
dp_address=$5
dp_rpc_port=$6
tp_size=$7
shift 7

for name in port dp_size dp_rank dp_rpc_port tp_size; do
    case ${!name} in
        '' | *[!0-9]*) die "$name must be a non-negative integer, got '${!name}'" ;;
        *) ;;
    esac
done
[[ -n "$dp_address" ]] || die "dp_address is empty"
[[ -n "$MODEL" ]] || die "no model: set PD_MODEL (launch_online_dp.py --model) or edit MODEL in $0"
dp_mode=${PD_DP_MODE:-vllm}
case $dp_mode in
    vllm | independent) ;;
    *) die "PD_DP_MODE must be 'vllm' or 'independent', got '$dp_mode'" ;;
esac

device=${PD_DEVICE:-}
if [[ -z "$device" ]]; then
    if command -v npu-smi >/dev/null 2>&1; then device=npu; else device=cpu; fi
fi

case $device in
    npu)
        export ASCEND_RT_VISIBLE_DEVICES="$devices"
        if [[ -n "$LOCAL_IP" ]]; then
            export HCCL_IF_IP="$LOCAL_IP"
        fi
        if [[ -n "$NIC_NAME" ]]; then
            export GLOO_SOCKET_IFNAME="$NIC_NAME"
            export TP_SOCKET_IFNAME="$NIC_NAME"
            export HCCL_SOCKET_IFNAME="$NIC_NAME"
        fi
        export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
        export HCCL_BUFFSIZE="${HCCL_BUFFSIZE:-1024}"
        export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-1}"
        export OMP_PROC_BIND="${OMP_PROC_BIND:-false}"
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-10}"
        ;;
    cpu)
        # No device pinning on CPU; the cores given here become this rank's OpenMP binding.
        if [[ -n "$devices" ]]; then
            export VLLM_CPU_OMP_THREADS_BIND="$devices"
        fi
        ;;
    *)
        die "PD_DEVICE must be 'npu' or 'cpu', got '$device'"
        ;;
esac
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}"
export PYTHONUNBUFFERED=1

python=${PD_PYTHON:-python3}
if [[ -n "${PD_SERVE_CMD:-}" ]]; then
    read -r -a serve_cmd <<<"$PD_SERVE_CMD"
elif command -v vllm >/dev/null 2>&1 \
    && "$python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    serve_cmd=(vllm)
else
    # vLLM installed as another distribution (vllm-cpu): its console script fails, so run
    # the CLI through this repository's wrapper, importable from the directory above.
    script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    repo_dir=$(dirname "$script_dir")
    export PYTHONPATH="$repo_dir${PYTHONPATH:+:$PYTHONPATH}"
    serve_cmd=("$python" -m launch.vllm_cli)
fi

cmd=("${serve_cmd[@]}" serve "$MODEL" --host "$HOST" --port "$port")
if [[ "$dp_mode" == vllm ]]; then
    cmd+=(
        --data-parallel-size "$dp_size"
        --data-parallel-rank "$dp_rank"
        --data-parallel-address "$dp_address"
        --data-parallel-rpc-port "$dp_rpc_port"
    )
fi
cmd+=(--tensor-parallel-size "$tp_size" "$@")
echo "run_dp_template.sh: dp rank $dp_rank/$dp_size ($device, devices '${devices}', dp mode $dp_mode): ${cmd[*]}" >&2
exec "${cmd[@]}"
