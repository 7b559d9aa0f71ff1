#!/usr/bin/env bash
# On the lent GPU machine, after the set-up (docs/gpu.md) and scripts/gpu_real_model.sh /tmp/q2b: the GPU stage
# profile and its validation row (issue 40; docs/planning.md, "The GPU profile"): one tritonserver serving
# topologies/checkpoint-gpu.yaml's E+PD (engines compiled, the encoders' images preprocessed on the GPU), its profile
# measured (clients.plan.measure_gpu), then closed loops at LEVELS measured and predicted side by side.
#   scripts/gpu_plan.sh start CHECKPOINT     # in the background (scripts/gpu_background.sh); returns at once
#   scripts/gpu_plan.sh wait SECONDS         # results so far into $OUT: validation.md/.json, profile-single.json
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-/tmp/plan-gpu}
case "${1:?start or wait}" in
start)
    CKPT=${2:?checkpoint}
    exec bash scripts/gpu_background.sh start "$DIR" "$CKPT" .venv/bin/python -m clients.plan.validate \
        --deployments single --topology "${TOPOLOGY:-topologies/checkpoint-gpu.yaml}" --checkpoint "$CKPT" --compile \
        --image-preprocess gpu --measure-profile --levels "${LEVELS:-1,8,32}" --requests "${N:-64}" \
        --repeats "${REPEATS:-2}" --image-sizes 448x448,672x672,896x896 --max-tokens "${TOKENS:-64}" --out "$DIR"
    ;;
wait) OUT=${OUT:-/tmp/plan-gpu-out} exec bash scripts/gpu_background.sh wait "$DIR" "${2:-500}" ;;
*) echo "usage: $0 start CHECKPOINT | wait SECONDS" >&2; exit 2 ;;
esac
