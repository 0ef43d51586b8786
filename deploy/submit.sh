#!/usr/bin/env bash
# Submit a vlcurate run to a running Ray cluster through its job API (`ray job submit`).
#
#   RAY_ADDRESS=http://HEAD:8265 deploy/submit.sh CONFIG [--set key=value ...]
#
# CONFIG is read by the job's driver on the head node: give a path on the shared volume (with
# KubeRay: /config/config.yaml, from the ConfigMap), or a path relative to the working dir, which
# is uploaded with the job (WORKING_DIR, default: the current directory, without what .gitignore
# lists). The code itself comes from the image the cluster runs (deploy/Dockerfile).
# Every path in the config must be one every node sees (deploy/README.md).
#
# KubeRay:  kubectl port-forward svc/vlcurate-head-svc 8265:8265 &
#           RAY_ADDRESS=http://127.0.0.1:8265 deploy/submit.sh /config/config.yaml
# The job keeps running if this script is interrupted; follow it again with
# `ray job logs --address "$RAY_ADDRESS" -f SUBMISSION_ID`, stop it with `ray job stop`.
set -euo pipefail

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster job API, e.g. http://127.0.0.1:8265}"
CONFIG=$1
shift
WORKING_DIR=${WORKING_DIR:-.}
SUBMISSION_ID=${SUBMISSION_ID:-vlcurate-$(date -u +%Y%m%d-%H%M%S)}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

exec ray job submit --address "$RAY_ADDRESS" --working-dir "$WORKING_DIR" \
  --submission-id "$SUBMISSION_ID" -- vlcurate run "$CONFIG" "$@"
