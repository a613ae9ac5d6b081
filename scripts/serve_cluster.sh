#!/usr/bin/env bash
# Serve K sluice workers on this machine behind the SGLang Model Gateway (smg), the cores
# split between them: scripts/serve_cluster.sh K [sluice serve flags...]
#   workers on 127.0.0.1:$((BASE_PORT + 1)) .. $((BASE_PORT + K)), the gateway on $HOST:$BASE_PORT
#   (BASE_PORT default 30000, HOST default 127.0.0.1, POLICY default cache_aware; with
#   API_KEY set, the workers and the gateway all require it).
# Ctrl-C stops all of them. See docs/scale-out.md.
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:?usage: scripts/serve_cluster.sh K [sluice serve flags...]}
shift
BASE_PORT=${BASE_PORT:-30000}
HOST=${HOST:-127.0.0.1}
POLICY=${POLICY:-cache_aware}
# The CPUs this shell may use (a cpuset need not start at 0), split between the workers.
read -r -a CPUS <<< "$(.venv/bin/python -c 'import os; print(*sorted(os.sched_getaffinity(0)))')"
CORES=${#CPUS[@]}
THREADS=$(( CORES / K > 0 ? CORES / K : 1 ))
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait' EXIT INT TERM
URLS=()
for i in $(seq 1 "$K"); do
  PORT=$((BASE_PORT + i))
  FIRST=$(( (i - 1) * THREADS % CORES ))
  MINE=$(IFS=,; echo "${CPUS[*]:$FIRST:$THREADS}")
  # Each worker on its own cores (taskset), with as many threads as cores.
  taskset -c "$MINE" .venv/bin/python -m sluice serve --port "$PORT" --num-threads "$THREADS" \
    ${API_KEY:+--api-key "$API_KEY"} "$@" &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$PORT")
done
for i in "${!URLS[@]}"; do
  until curl -sf "${URLS[$i]}/health" >/dev/null; do
    kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "worker ${URLS[$i]} exited during start-up" >&2; exit 1; }
    sleep 1
  done
done
.venv/bin/smg launch --host "$HOST" --port "$BASE_PORT" --policy "$POLICY" ${API_KEY:+--api-key "$API_KEY"} \
  --worker-urls "${URLS[@]}" &
PIDS+=($!)
echo "gateway on http://$HOST:$BASE_PORT in front of ${URLS[*]}"
wait
