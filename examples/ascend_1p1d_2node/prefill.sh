#!/usr/bin/env bash
# On the prefill node: one vLLM-Ascend instance with DP_SIZE engines, PDConnector as kv_producer
# (its DP-rank-0 leader hosts the bootstrap server on BOOTSTRAP_PORT).
set -euo pipefail
. "$(dirname "$0")/env.sh"

serve_instance "$P_IP" "$P_PORT" 12321 kv_producer \
    "{\"bootstrap_port\":$BOOTSTRAP_PORT,\"bootstrap_host\":\"$P_IP\",\"local_ip\":\"$P_IP\",\"protocol\":\"ascend\",
      \"auth_token_env\":\"PD_AUTH_TOKEN\"}" \
    --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --enforce-eager
