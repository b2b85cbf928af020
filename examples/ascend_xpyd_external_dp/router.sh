#!/usr/bin/env bash
# The Router: every prefill DP rank is a prefiller (its DP rank and its instance's bootstrap
# host given, so D asks the right rank at once); every decode DP rank is a decoder.
set -euo pipefail
. "$(dirname "$0")/env.sh"

p_hosts=() p_ports=() p_bootstrap_hosts=() p_dp_ranks=() d_hosts=() d_ports=()
for ip in "${P_IPS[@]}"; do
    for ((r = 0; r < P_DP; r++)); do
        p_hosts+=("$ip") p_ports+=($((START_PORT + r))) p_bootstrap_hosts+=("$ip") p_dp_ranks+=("$r")
    done
done
for ip in "${D_IPS[@]}"; do
    for ((r = 0; r < D_DP_LOCAL; r++)); do
        d_hosts+=("$ip") d_ports+=($((START_PORT + r)))
    done
done

python -m proxy --host 0.0.0.0 --port "$ROUTER_PORT" --routing least-loaded \
    --prefiller-hosts "${p_hosts[@]}" --prefiller-ports "${p_ports[@]}" \
    --prefiller-bootstrap-hosts "${p_bootstrap_hosts[@]}" --prefiller-bootstrap-ports "$BOOTSTRAP_PORT" \
    --prefiller-dp-ranks "${p_dp_ranks[@]}" \
    --decoder-hosts "${d_hosts[@]}" --decoder-ports "${d_ports[@]}"
