#!/usr/bin/env bash
# On the lent GPU machine, after the set-up (docs/gpu.md: scripts/gpu_setup.sh pieces + install,
# scripts/gpu_triton_env.sh, scripts/gpu_real_model.sh /tmp/q2b): the crossover map (issue 37, item 5; docs/gpu.md,
# "The crossover map"), E+PD against llm over images 0/1/2/4/8 x tokens 16/128/512 at c=32, every engine compiled,
# the encoders' images preprocessed on the GPU. The run outlives one call (the machine stays up while calls follow
# each other), so it runs in the background:
#   scripts/gpu_crossover.sh start CHECKPOINT      # starts it (first waits for \$MODEL_LOG, default /tmp/q2b.log,
#                                                  # to say "model built"); returns at once
#   scripts/gpu_crossover.sh wait SECONDS          # waits up to SECONDS for it to end; results so far into $OUT
# TOPOLOGY, ENGINES (compile|eager), IMAGE_PREPROCESS, IMAGES, TOKENS, C, N: other settings; on two GPUs
# (nvidia-h100-x2) TOPOLOGY=topologies/checkpoint-gpu2.yaml: llm as a replica per GPU against E+PD's encoders on GPU 1
# and pd on GPU 0. DIR (default /tmp/crossover): where the run keeps its rows (a second run needs another).
# Results: crossover.md, crossover.png, results.json, run.log (and server.log when it ended).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1
DIR=${DIR:-/tmp/crossover}  # a run with the same settings and DIR goes on from the rows there
case "${1:?start or wait}" in
start)
    CKPT=${2:?checkpoint}
    mkdir -p "$DIR"
    MODEL_LOG=${MODEL_LOG:-/tmp/q2b.log}  # where scripts/gpu_real_model.sh writes "model built" when it is done
    setsid nohup bash -c "until [ -f $CKPT/config.json ] && { [ ! -f $MODEL_LOG ] || grep -q 'model built' $MODEL_LOG; }; do sleep 2; done
        .venv/bin/python -m clients.bench.crossover --topology ${TOPOLOGY:-topologies/checkpoint-gpu.yaml} --checkpoint $CKPT \
            --${ENGINES:-compile} --image-preprocess ${IMAGE_PREPROCESS:-gpu} --images ${IMAGES:-0,1,2,4,8} \
            --max-tokens ${TOKENS:-16,128,512} --concurrency ${C:-32} --requests ${N:-64} --out $DIR
        echo \"crossover exit status \$?\"" > "$DIR/run.log" 2>&1 < /dev/null &
    echo "started (log $DIR/run.log)"
    ;;
wait)
    deadline=$(( $(date +%s) + ${2:-500} ))
    until grep -q "crossover exit status" "$DIR/run.log" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; do sleep 5; done
    OUT=${OUT:-/tmp/crossover-out}
    mkdir -p "$OUT"
    cp "$DIR"/crossover.md "$DIR"/crossover.png "$DIR"/results.json "$DIR"/run.log "$OUT"/ 2>/dev/null
    grep -q "crossover exit status" "$DIR/run.log" && cp "$DIR"/server.log "$OUT"/ 2>/dev/null
    tail -25 "$DIR/run.log"
    ;;
*) echo "usage: $0 start CHECKPOINT | wait SECONDS" >&2; exit 2 ;;
esac
