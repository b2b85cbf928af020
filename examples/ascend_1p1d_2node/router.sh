#!/usr/bin/env bash
# On any host that reaches both nodes: the Router in front of P and D.
set -euo pipefail
. "$(dirname "$0")/env.sh"

curl --fail -s "http://$P_IP:$P_PORT/health" >/dev/null || echo "warning: prefill $P_IP:$P_PORT not healthy yet" >&2
curl --fail -s "http://$D_IP:$D_PORT/health" >/dev/null || echo "warning: decode $D_IP:$D_PORT not healthy yet" >&2
python -m proxy --host 0.0.0.0 --port "$ROUTER_PORT" \
    --prefiller-hosts "$P_IP" --prefiller-ports "$P_PORT" --prefiller-bootstrap-ports "$BOOTSTRAP_PORT" \
    --decoder-hosts "$D_IP" --decoder-ports "$D_PORT"
