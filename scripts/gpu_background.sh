#!/usr/bin/env bash
# On the lent GPU machine: a run that outlives one device call (the machine stays up while calls follow each other),
# started in the background after the checkpoint is built, and waited for call by call.
#   scripts/gpu_background.sh start DIR CHECKPOINT COMMAND...  # once CHECKPOINT has its config.json and $MODEL_LOG
#                                                              # (default /tmp/q2b.log) says "model built", runs
#                                                              # COMMAND in the background; returns at once
#   scripts/gpu_background.sh wait DIR SECONDS                 # waits up to SECONDS for it to end; DIR's files
#                                                              # into $OUT (server.log once it ended)
# The log is DIR/run.log; its last line "job exit status N" says that the run ended.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1
case "${1:?start or wait}" in
start)
    DIR=${2:?run folder} CKPT=${3:?checkpoint}
    shift 3
    mkdir -p "$DIR"
    MODEL_LOG=${MODEL_LOG:-/tmp/q2b.log}  # where scripts/gpu_real_model.sh writes "model built" when it is done
    setsid nohup bash -c 'until [ -f "$0/config.json" ] && { [ ! -f "$1" ] || grep -q "model built" "$1"; }; do sleep 2; done
        "${@:2}"; echo "job exit status $?"' "$CKPT" "$MODEL_LOG" "$@" > "$DIR/run.log" 2>&1 < /dev/null &
    echo "started (log $DIR/run.log)"
    ;;
wait)
    DIR=${2:?run folder}
    deadline=$(( $(date +%s) + ${3:-500} ))
    until grep -q "job exit status" "$DIR/run.log" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; do sleep 5; done
    OUT=${OUT:-/tmp/$(basename "$DIR")-out}
    mkdir -p "$OUT"
    find "$DIR" -maxdepth 1 -type f ! -name server.log -exec cp {} "$OUT"/ \;
    grep -q "job exit status" "$DIR/run.log" && cp "$DIR"/server.log "$OUT"/ 2>/dev/null
    tail -25 "$DIR/run.log"
    ;;
*) echo "usage: $0 start DIR CHECKPOINT COMMAND... | wait DIR SECONDS" >&2; exit 2 ;;
esac
