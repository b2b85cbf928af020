#!/usr/bin/env bash
# 1 prefill + 1 decode vLLM instance and the Router on one CPU machine, started by plain
# commands (what `python -m launch.local` does for you), then one streamed request.
#
#   bash examples/cpu_1p1d/run.sh                 # from the repository root, after scripts/setup.sh
#   KEEP_RUNNING=1 bash examples/cpu_1p1d/run.sh  # stay up until Ctrl-C
#
# Every setting can be overridden from the environment:
#   MODEL (default: SmolLM2-135M-Instruct, built offline into ./models/smollm2-135m-instruct by
#   `python -m launch.real_model`; MODEL=tiny: a tiny random Llama in ./models/tiny-llama), PYTHON (.venv/bin/python),
#   P_PORT 8100, BOOTSTRAP_PORT 18800, D_PORT 8200, ROUTER_PORT 8000, P_CPUS 0, D_CPUS 1, LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-.venv/bin/python}
P_PORT=${P_PORT:-8100}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-18800}
D_PORT=${D_PORT:-8200}
ROUTER_PORT=${ROUTER_PORT:-8000}
P_CPUS=${P_CPUS:-0}
D_CPUS=${D_CPUS:-1}
LOG_DIR=${LOG_DIR:-logs/cpu_1p1d-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOG_DIR"

if [[ -z "${MODEL:-}" ]]; then
    MODEL=models/smollm2-135m-instruct
    "$PYTHON" -m launch.real_model "$MODEL" >/dev/null  # reused when built
elif [[ "$MODEL" == tiny ]]; then
    MODEL=models/tiny-llama
    [[ -f "$MODEL/config.json" ]] || "$PYTHON" -m launch.tiny_model "$MODEL"
fi

pids=()
remember() {  # every started pid, also in $LOG_DIR/pids for whoever has to clean up after us
    pids+=("$1")
    echo "$1" >>"$LOG_DIR/pids"
}
stop_all() {
    # Each instance runs in its own process group (setsid): stop the whole tree, and wait
    # until every member (vLLM's engine and worker processes too) is gone; SIGKILL after 30 s.
    local pid deadline=$((SECONDS + 30))
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        while kill -0 -- "-$pid" 2>/dev/null; do
            if ((SECONDS >= deadline)); then kill -KILL -- "-$pid" 2>/dev/null || true; fi
            sleep 0.2
        done
    done
    echo "stopped P, D and the Router; logs in $LOG_DIR"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

# One vLLM instance with PDConnector: serve NAME CPUS PORT KV_ROLE EXTRA_CONFIG_JSON.
# taskset pins the instance's whole process tree (API server, engine, worker) to its cores,
# VLLM_CPU_OMP_THREADS_BIND its OpenMP threads; setsid gives it its own process group.
serve() {
    VLLM_CPU_OMP_THREADS_BIND=$2 VLLM_CPU_KVCACHE_SPACE=1 PYTHONUNBUFFERED=1 \
    setsid taskset -c "$2" "$PYTHON" -m launch.vllm_cli serve "$MODEL" \
        --host 127.0.0.1 --port "$3" --dtype float32 --block-size 32 --max-model-len 2048 \
        --middleware pd_connector.api_server.validation.KVParamsValidationMiddleware \
        --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"$4\",\"kv_connector_extra_config\":$5}" \
        >"$LOG_DIR/$1.log" 2>&1 &
    remember $!
}

# Prefill (kv_producer); its leader hosts the bootstrap server on BOOTSTRAP_PORT.
serve prefill "$P_CPUS" "$P_PORT" kv_producer \
    "{\"bootstrap_port\":$BOOTSTRAP_PORT,\"local_ip\":\"127.0.0.1\",\"protocol\":\"tcp\"}"
# Decode (kv_consumer) on its own cores.
serve decode "$D_CPUS" "$D_PORT" kv_consumer '{"local_ip":"127.0.0.1","protocol":"tcp"}'

# The Router: one P (with its bootstrap port) and one D.
PYTHONUNBUFFERED=1 setsid "$PYTHON" -m proxy --host 127.0.0.1 --port "$ROUTER_PORT" \
    --prefiller-hosts 127.0.0.1 --prefiller-ports "$P_PORT" --prefiller-bootstrap-ports "$BOOTSTRAP_PORT" \
    --decoder-hosts 127.0.0.1 --decoder-ports "$D_PORT" \
    >"$LOG_DIR/router.log" 2>&1 &
remember $!

wait_healthy() {  # name url
    local deadline=$((SECONDS + ${START_TIMEOUT_S:-300}))
    until curl -sf -o /dev/null "$2"; do
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null || { echo "a process exited; see $LOG_DIR" >&2; tail -n 20 "$LOG_DIR"/*.log >&2; exit 1; }
        done
        ((SECONDS < deadline)) || { echo "$1 not healthy in time; see $LOG_DIR" >&2; exit 1; }
        sleep 1
    done
    echo "$1 healthy"
}
echo "starting; logs in $LOG_DIR"
wait_healthy prefill "http://127.0.0.1:$P_PORT/health"
wait_healthy decode "http://127.0.0.1:$D_PORT/health"
wait_healthy router "http://127.0.0.1:$ROUTER_PORT/health"

# One streamed completion through the Router: its events, then their text joined.
curl -sN "http://127.0.0.1:$ROUTER_PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"The three primary colors are\",\"max_tokens\":16,\"temperature\":0,\"stream\":true}" \
    | tee "$LOG_DIR/answer.sse"
echo
"$PYTHON" -c '
import json, sys
events = [line[6:] for line in open(sys.argv[1]) if line.startswith("data: {")]
print("answer:", repr("".join(c.get("text") or "" for e in events for c in json.loads(e)["choices"])))
' "$LOG_DIR/answer.sse"
grep -h "pushed\|KV received" "$LOG_DIR/prefill.log" "$LOG_DIR/decode.log" | tail -n 2

if [[ -n "${KEEP_RUNNING:-}" ]]; then
    echo "router: http://127.0.0.1:$ROUTER_PORT (Ctrl-C stops everything)"
    wait
fi
