#!/usr/bin/env bash
# On the decode node: one vLLM-Ascend instance with DP_SIZE engines, PDConnector as kv_consumer.
set -euo pipefail
. "$(dirname "$0")/env.sh"
ascend_env "$D_IP"

vllm serve "$MODEL" \
    --host "$D_IP" --port "$D_PORT" \
    --served-model-name "$SERVED_NAME" \
    --data-parallel-size "$DP_SIZE" --data-parallel-address "$D_IP" --data-parallel-rpc-port 12322 \
    --tensor-parallel-size 1 --enable-expert-parallel \
    --max-model-len 32768 --max-num-batched-tokens 1024 --max-num-seqs 32 --block-size 128 \
    --gpu-memory-utilization 0.9 --trust-remote-code \
    --middleware pd_connector.http_validation.KVParamsValidationMiddleware \
    --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"kv_consumer\",
        \"kv_connector_extra_config\":{\"local_ip\":\"$D_IP\",\"protocol\":\"ascend\"}}"
