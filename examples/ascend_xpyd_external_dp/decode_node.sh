#!/usr/bin/env bash
# On decode node N (1 or 2): D_DP_LOCAL ranks of the one decode instance (DP D_DP, TP D_TP);
# node 1 holds ranks 0..15 and is the DP master, node 2 ranks 16..31.
#   bash examples/ascend_xpyd_external_dp/decode_node.sh 1
set -euo pipefail
. "$(dirname "$0")/env.sh"
node=${1:?usage: decode_node.sh NODE (1..${#D_IPS[@]})}
ip=${D_IPS[$((node - 1))]}
export PD_LOCAL_IP=$ip
require_token

python -m launch.launch_online_dp --dp-size "$D_DP" --tp-size "$D_TP" --dp-size-local "$D_DP_LOCAL" \
    --dp-rank-start $(((node - 1) * D_DP_LOCAL)) \
    --dp-address "${D_IPS[0]}" --dp-rpc-port "$DP_RPC_PORT" --vllm-start-port "$START_PORT" \
    --model "$MODEL" --dp-mode vllm --device npu ${DRY_RUN:+--dry-run} -- \
    --served-model-name "$SERVED_NAME" --enable-expert-parallel --trust-remote-code \
    --max-model-len 40000 --max-num-batched-tokens 256 --max-num-seqs 40 --gpu-memory-utilization 0.94 \
    --no-enable-prefix-caching \
    --middleware pd_connector.api_server.validation.KVParamsValidationMiddleware \
    --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"kv_consumer\",
        \"kv_connector_extra_config\":{\"local_ip\":\"$ip\",\"protocol\":\"ascend\",\"auth_token_env\":\"PD_AUTH_TOKEN\",
        \"trusted_bootstrap_hosts\":$TRUSTED_P_HOSTS}}"
