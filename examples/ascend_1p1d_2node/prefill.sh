#!/usr/bin/env bash
# On the prefill node: one vLLM-Ascend instance with DP_SIZE engines, PDConnector as kv_producer.
set -euo pipefail
. "$(dirname "$0")/env.sh"
ascend_env "$P_IP"

vllm serve "$MODEL" \
    --host "$P_IP" --port "$P_PORT" \
    --served-model-name "$SERVED_NAME" \
    --data-parallel-size "$DP_SIZE" --data-parallel-address "$P_IP" --data-parallel-rpc-port 12321 \
    --tensor-parallel-size 1 --enable-expert-parallel \
    --max-model-len 32768 --max-num-batched-tokens 8192 --max-num-seqs 32 --block-size 128 \
    --gpu-memory-utilization 0.9 --trust-remote-code --enforce-eager \
    --middleware pd_connector.http_validation.KVParamsValidationMiddleware \
    --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"kv_producer\",
        \"kv_connector_extra_config\":{\"bootstrap_port\":$BOOTSTRAP_PORT,\"local_ip\":\"$P_IP\",\"protocol\":\"ascend\"}}"
