# Shared settings of the 2-node 1P1D example; sourced by prefill.sh, decode.sh and router.sh.
# Edit these for your cluster (or set them in the environment before running a script).
P_IP=${P_IP:-192.0.2.10}          # prefill node
D_IP=${D_IP:-192.0.2.20}          # decode node
NIC_NAME=${NIC_NAME:-eth0}        # NIC of the node's own address (HCCL / Gloo sockets)
MODEL=${MODEL:-/path/to/Qwen3-30B-A3B}   # MoE, one KV cache group: vLLM 0.23 + vLLM-Ascend serve it with PDConnector
SERVED_NAME=${SERVED_NAME:-qwen3-moe}
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-18800}  # P's bootstrap server (hosted by P's DP-rank-0 leader)
ROUTER_PORT=${ROUTER_PORT:-8000}
DP_SIZE=${DP_SIZE:-4}             # internal DP engines per instance (one NPU each, TP 1)

# PDConnector's control-plane token: the same on P and D, from the environment (never on a command
# line); without it P and D would refuse to start on a non-loopback local_ip. Make one once:
#   export PD_AUTH_TOKEN=$(openssl rand -hex 32)
require_token() {
    : "${PD_AUTH_TOKEN:?set PD_AUTH_TOKEN to the shared control-plane token (the same on P and D)}"
    export PD_AUTH_TOKEN
}

# A proxy exported for pip or model downloads must not sit between P, D and the Router.
unset http_proxy https_proxy ftp_proxy HTTP_PROXY HTTPS_PROXY FTP_PROXY

ascend_env() {  # local_ip
    export HCCL_IF_IP=$1
    export GLOO_SOCKET_IFNAME=$NIC_NAME
    export TP_SOCKET_IFNAME=$NIC_NAME
    export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-512}
    export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-120}
    export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
    export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-1}
    export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-0,1,2,3}
    # Atlas 850/950 (A5) SuperPod: HIXL generates its UB endpoints itself (HIXL >= 9.1.0).
    # These are read by Mooncake's ascend transport; PDConnector passes them through untouched.
    if [[ -n "${ASCEND_A5:-}" ]]; then
        export ASCEND_LOCAL_COMM_RES=${ASCEND_LOCAL_COMM_RES:-'{"version":"1.3"}'}
        export ASCEND_GLOBAL_RESOURCE_CONFIG=${ASCEND_GLOBAL_RESOURCE_CONFIG:-'{"comm_resource_config.protocol_desc":["uboe:device"]}'}
    fi
}

# One instance: serve_instance IP PORT DP_RPC_PORT KV_ROLE EXTRA_CONFIG_JSON [more vllm serve flags...]
serve_instance() {
    local ip=$1 port=$2 rpc_port=$3 role=$4 extra=$5
    shift 5
    require_token
    ascend_env "$ip"
    vllm serve "$MODEL" \
        --host "$ip" --port "$port" \
        --served-model-name "$SERVED_NAME" \
        --data-parallel-size "$DP_SIZE" --data-parallel-address "$ip" --data-parallel-rpc-port "$rpc_port" \
        --tensor-parallel-size 1 --enable-expert-parallel \
        --max-model-len 32768 --max-num-seqs 32 --block-size 128 --trust-remote-code \
        --middleware pd_connector.api_server.validation.KVParamsValidationMiddleware \
        --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"$role\",\"kv_connector_extra_config\":$extra}" \
        "$@"
}
