#!/usr/bin/env bash
# A real multi-process Ray cluster on loopback: a head node and a second node, each with its own
# Ray processes (GCS, raylet, dashboard agent, workers), on one machine. Jobs reach it through
# the job-submission API, exactly as on a remote cluster. The README's "Run on a cluster" uses
# it, and tests/deploy/test_cluster.py runs these very commands.
#
#   deploy/local_cluster.sh up DIR              start the head and a second node (state in DIR)
#   deploy/local_cluster.sh submit DIR -- CMD   ray job submit CMD, with this repo as working dir
#   deploy/local_cluster.sh down DIR            stop every process of this cluster, and only those
#
# Run it with the project's environment active (`ray` and `vlcurate` on PATH). Every port is
# chosen free at start-up, so it never collides with another Ray on the machine. Everything is
# addressed through 127.0.0.1 and the job API is bound to it; Ray itself registers the nodes
# under the machine's own IP (`ray start` rewrites a loopback --node-ip-address), and its GCS and
# raylets listen on every interface. Every process of the cluster carries
# VLCURATE_LOCAL_CLUSTER=DIR in its environment (workers and the job driver inherit it), and
# `down` stops exactly those processes. It never runs a bare `ray stop`, which would stop every
# Ray instance of this user on the machine. Use a short DIR (Ray's socket paths live under it).
set -euo pipefail

usage() { grep '^#   deploy/local_cluster.sh' "$0" | sed 's/^#   //' >&2; exit 2; }
[ $# -ge 2 ] || usage
CMD=$1
DIR=$(realpath -m "$2")
shift 2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS
HEAD_CPUS=${HEAD_CPUS:-2}
NODE_CPUS=${NODE_CPUS:-1}
OBJECT_STORE_BYTES=${OBJECT_STORE_BYTES:-300000000}
UP_TIMEOUT=${UP_TIMEOUT:-120}
SUBMIT_TIMEOUT=${SUBMIT_TIMEOUT:-900}

free_ports() {  # N distinct free TCP ports on 127.0.0.1
  python - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

marked_pids() {  # processes whose environment names this cluster (never this script)
  local f pid
  for f in $(grep -lzxF "VLCURATE_LOCAL_CLUSTER=$DIR" /proc/[0-9]*/environ 2>/dev/null); do
    pid=${f#/proc/}; pid=${pid%/environ}
    [ "$pid" = "$$" ] || [ "$pid" = "${BASHPID:-}" ] || echo "$pid"
  done
}

up() {
  if [ -n "$(marked_pids)" ]; then echo "a cluster for $DIR is already running" >&2; exit 1; fi
  mkdir -p "$DIR"
  local p; read -r -a p <<<"$(free_ports 17)"
  export VLCURATE_LOCAL_CLUSTER="$DIR"
  # the autoscaler's and the dashboard's metrics servers have no flag and fixed defaults (44217,
  # 44227), which a port picked free below may be: they come from the environment instead
  export AUTOSCALER_METRIC_PORT="${p[15]}" DASHBOARD_METRIC_PORT="${p[16]}"
  # the head: GCS on ${p[0]}, dashboard and job API on ${p[1]}, two CPUs
  ray start --head --port "${p[0]}" \
    --dashboard-host 127.0.0.1 --dashboard-port "${p[1]}" --num-cpus "$HEAD_CPUS" \
    --temp-dir "$DIR/head" --object-store-memory "$OBJECT_STORE_BYTES" --disable-usage-stats \
    --ray-client-server-port "${p[2]}" --node-manager-port "${p[3]}" \
    --object-manager-port "${p[4]}" --dashboard-agent-listen-port "${p[5]}" \
    --dashboard-agent-grpc-port "${p[6]}" --runtime-env-agent-port "${p[7]}" \
    --metrics-export-port "${p[8]}"
  # a second node process joining it, one CPU
  ray start --address "127.0.0.1:${p[0]}" --num-cpus "$NODE_CPUS" \
    --temp-dir "$DIR/node2" --object-store-memory "$OBJECT_STORE_BYTES" --disable-usage-stats \
    --node-manager-port "${p[9]}" --object-manager-port "${p[10]}" \
    --dashboard-agent-listen-port "${p[11]}" --dashboard-agent-grpc-port "${p[12]}" \
    --runtime-env-agent-port "${p[13]}" --metrics-export-port "${p[14]}"
  cat >"$DIR/cluster.env" <<EOF
GCS_ADDRESS=127.0.0.1:${p[0]}
DASHBOARD=http://127.0.0.1:${p[1]}
EOF
  # wait (bounded) until both nodes are alive and the job API accepts a job: the nodes can be
  # alive before the head's job agent has registered, when a submission fails with "No available
  # agent to submit job" (seen in CI), so a no-op job (entrypoint `true`) is submitted until one
  # is accepted
  python - "http://127.0.0.1:${p[1]}" "$UP_TIMEOUT" <<'EOF'
import sys, time
from ray.job_submission import JobSubmissionClient
from ray.util.state import list_nodes
address, deadline = sys.argv[1], time.time() + float(sys.argv[2])
while True:
    try:
        alive = [n for n in list_nodes(address=address) if n.state == "ALIVE"]
        if len(alive) >= 2:
            JobSubmissionClient(address).submit_job(entrypoint="true")
            break
    except Exception as e:  # the dashboard or its job agent is still starting
        alive = e
    if time.time() > deadline:
        sys.exit(f"cluster not up after {sys.argv[2]}s: {alive}")
    time.sleep(1)
print(f"cluster up: {len(alive)} nodes, job API at {address}")
EOF
  echo "submit: $0 submit $DIR -- CMD, or RAY_ADDRESS=http://127.0.0.1:${p[1]} deploy/submit.sh CONFIG"
}

submit() {
  [ "${1:-}" = "--" ] && shift
  [ $# -ge 1 ] || usage
  # shellcheck disable=SC1091
  . "$DIR/cluster.env"
  # the working dir is uploaded without .git, .venv and what .gitignore lists (runs/)
  timeout "$SUBMIT_TIMEOUT" ray job submit --address "$DASHBOARD" --working-dir "$REPO" \
    --log-style record -- "$@"
}

down() {
  local pids i
  pids=$(marked_pids)
  [ -z "$pids" ] && { echo "no process of the cluster in $DIR is running"; return 0; }
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for i in $(seq 1 25); do   # 5 s of grace (the GCS may ignore SIGTERM)
    sleep 0.2
    pids=$(marked_pids)
    [ -z "$pids" ] && { echo "cluster in $DIR stopped"; return 0; }
  done
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 0.5
  pids=$(marked_pids)
  [ -z "$pids" ] || { echo "still running: $pids" >&2; return 1; }
  echo "cluster in $DIR stopped (some processes needed SIGKILL)"
}

case "$CMD" in
  up) up ;;
  submit) submit "$@" ;;
  down) down ;;
  *) usage ;;
esac
