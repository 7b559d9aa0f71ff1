#!/usr/bin/env bash
# On the lent GPU machine, after the set-up (docs/gpu.md: scripts/gpu_setup.sh pieces + install,
# scripts/gpu_triton_env.sh, scripts/gpu_real_model.sh /tmp/q2b): the crossover map (issue 37, item 5; docs/gpu.md,
# "The crossover map"), E+PD against llm over images 0/1/2/4/8 x tokens 16/128/512 at c=32, every engine compiled,
# the encoders' images preprocessed on the GPU. The run outlives one call, so it runs in the background
# (scripts/gpu_background.sh):
#   scripts/gpu_crossover.sh start CHECKPOINT      # starts it once the checkpoint is built; returns at once
#   scripts/gpu_crossover.sh wait SECONDS          # waits up to SECONDS for it to end; results so far into $OUT
# TOPOLOGY, ENGINES (compile|eager), IMAGE_PREPROCESS, IMAGES, TOKENS, C, N, KV_GIB (each engine's KV budget: 8 for
# a 7B on one 80 GB card, whose weights leave the topology's 16 GiB no room for the encoders): other settings; on two GPUs
# (nvidia-h100-x2) TOPOLOGY=topologies/checkpoint-gpu2.yaml: llm as a replica per GPU against E+PD's encoders on GPU 1
# and pd on GPU 0. DIR (default /tmp/crossover): where the run keeps its rows (a second run needs another).
# Results: crossover.md, crossover.png, results.json, run.log (and server.log when it ended).
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-/tmp/crossover}  # a run with the same settings and DIR goes on from the rows there
case "${1:?start or wait}" in
start)
    CKPT=${2:?checkpoint}
    exec bash scripts/gpu_background.sh start "$DIR" "$CKPT" .venv/bin/python -m clients.bench.crossover \
        --topology "${TOPOLOGY:-topologies/checkpoint-gpu.yaml}" --checkpoint "$CKPT" --"${ENGINES:-compile}" \
        --image-preprocess "${IMAGE_PREPROCESS:-gpu}" --images "${IMAGES:-0,1,2,4,8}" --max-tokens "${TOKENS:-16,128,512}" \
        --concurrency "${C:-32}" --requests "${N:-64}" ${KV_GIB:+--kv-cache-gib "$KV_GIB"} --out "$DIR"
    ;;
wait) OUT=${OUT:-/tmp/crossover-out} exec bash scripts/gpu_background.sh wait "$DIR" "${2:-500}" ;;
*) echo "usage: $0 start CHECKPOINT | wait SECONDS" >&2; exit 2 ;;
esac
