#!/usr/bin/env bash
# On prefill node N (1 or 2): this node's prefill instance, DP ranks 0..P_DP-1 (TP P_TP each).
#   bash examples/ascend_xpyd_external_dp/prefill_node.sh 1
set -euo pipefail
. "$(dirname "$0")/env.sh"
node=${1:?usage: prefill_node.sh NODE (1..${#P_IPS[@]})}
ip=${P_IPS[$((node - 1))]}
export PD_LOCAL_IP=$ip
require_token

python -m launch.launch_online_dp --dp-size "$P_DP" --tp-size "$P_TP" --dp-size-local "$P_DP" --dp-rank-start 0 \
    --dp-address "$ip" --dp-rpc-port "$DP_RPC_PORT" --vllm-start-port "$START_PORT" \
    --model "$MODEL" --dp-mode vllm --device npu ${DRY_RUN:+--dry-run} -- \
    --served-model-name "$SERVED_NAME" --enable-expert-parallel --trust-remote-code --enforce-eager \
    --max-model-len 40000 --max-num-batched-tokens 16384 --max-num-seqs 8 --gpu-memory-utilization 0.9 \
    --no-enable-prefix-caching \
    --middleware pd_connector.api_server.validation.KVParamsValidationMiddleware \
    --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"kv_producer\",
        \"kv_connector_extra_config\":{\"bootstrap_port\":$BOOTSTRAP_PORT,\"bootstrap_host\":\"$ip\",\"local_ip\":\"$ip\",
        \"protocol\":\"ascend\",\"auth_token_env\":\"PD_AUTH_TOKEN\"}}"
