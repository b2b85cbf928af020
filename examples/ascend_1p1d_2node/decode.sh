#!/usr/bin/env bash
# On the decode node: one vLLM-Ascend instance with DP_SIZE engines, PDConnector as kv_consumer.
set -euo pipefail
. "$(dirname "$0")/env.sh"

serve_instance "$D_IP" "$D_PORT" 12322 kv_consumer \
    "{\"local_ip\":\"$D_IP\",\"protocol\":\"ascend\",\"auth_token_env\":\"PD_AUTH_TOKEN\",
      \"trusted_bootstrap_hosts\":[\"$P_IP\"]}" \
    --max-num-batched-tokens 1024 --gpu-memory-utilization 0.9
