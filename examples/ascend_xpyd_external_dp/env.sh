# Shared settings of the external-DP xPyD example (2 prefill instances, 1 decode instance
# over 4 nodes); sourced by prefill_node.sh, decode_node.sh and router.sh.
P_IPS=(${P_IPS:-192.0.0.1 192.0.0.2})   # one prefill instance per node: DP 2 x TP 8
D_IPS=(${D_IPS:-192.0.0.3 192.0.0.4})   # one decode instance over both nodes: DP 32 x TP 1
NIC_NAME=${NIC_NAME:-eth0}
MODEL=${MODEL:-/path_to_weight/DeepSeek-r1_w8a8_mtp}
SERVED_NAME=${SERVED_NAME:-ds_r1}
START_PORT=${START_PORT:-7100}          # API port of a node's first DP rank (+1 per rank)
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-18800} # each prefill instance's bootstrap server (on its DP rank 0)
DP_RPC_PORT=${DP_RPC_PORT:-12321}
ROUTER_PORT=${ROUTER_PORT:-8000}
P_DP=${P_DP:-2}
P_TP=${P_TP:-8}
D_DP=${D_DP:-32}
D_TP=${D_TP:-1}
D_DP_LOCAL=${D_DP_LOCAL:-16}

# PDConnector's control-plane token: the same on every node, from the environment (never on a command
# line); without it P and D would refuse to start on a non-loopback local_ip. Make one once:
#   export PD_AUTH_TOKEN=$(openssl rand -hex 32)
require_token() {
    : "${PD_AUTH_TOKEN:?set PD_AUTH_TOKEN to the shared control-plane token (the same on every node)}"
    export PD_AUTH_TOKEN
}
# D contacts only these bootstrap hosts (every prefill node), as a JSON list.
TRUSTED_P_HOSTS=$(printf '"%s",' "${P_IPS[@]}")
TRUSTED_P_HOSTS="[${TRUSTED_P_HOSTS%,}]"

unset http_proxy https_proxy ftp_proxy HTTP_PROXY HTTPS_PROXY FTP_PROXY
# Read by run_dp_template.sh for every rank (HCCL_IF_IP, GLOO/TP/HCCL socket NICs); other
# HCCL / HIXL variables exported here reach every rank unchanged.
export PD_NIC_NAME=$NIC_NAME
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-256}
export HCCL_OP_EXPANSION_MODE=${HCCL_OP_EXPANSION_MODE:-AIV}
if [[ -n "${ASCEND_A5:-}" ]]; then  # Atlas 850/950 SuperPod: HIXL's own UB endpoints
    export ASCEND_LOCAL_COMM_RES=${ASCEND_LOCAL_COMM_RES:-'{"version":"1.3"}'}
fi
