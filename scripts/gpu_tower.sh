#!/usr/bin/env bash
# On the lent GPU machine: the vision tower nearer the GPU's peak (issue 37, item 2; docs/gpu.md, "The tower as CUDA
# graphs").
#   scripts/gpu_tower.sh kernels      where the tower's GPU time goes, eager / compiled / compiled as CUDA graphs, for
#                                     Qwen2.5-VL-7B's and Qwen2-VL-2B's tower shapes (clients.tools.tower_kernels;
#                                     needs only the machine's torch and transformers) -> $OUT/kernels-*.json
#   scripts/gpu_tower.sh bench CKPT   E+PD served with the encoders' images preprocessed on the GPU and their tower
#                                     compiled (epd_gpu_image) or compiled as CUDA graphs (epd_gpu_image_graphs), a
#                                     server each, 4 PNGs of 448-896 px a request (after the set-up of docs/gpu.md)
#                                     -> $OUT/bench-graphs
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
case "${1:-}" in
kernels)
    python3 -m clients.tools.tower_kernels --tower qwen25-7b --cases 448x1,448x4,448x8,896x4 \
        --json "$OUT/kernels-qwen25-7b.json" 2>&1 | grep -v -i warn | cut -c1-400
    python3 -m clients.tools.tower_kernels --tower qwen2-2b --cases 448x1,448x8,896x4 --ways eager,compile,compile+graph \
        --json "$OUT/kernels-qwen2-2b.json" 2>&1 | grep -v -i warn | cut -c1-400
    ;;
bench)
    export VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    timeout 560 .venv/bin/python -m clients.bench.e2e --topology topologies/checkpoint-gpu.yaml --checkpoint "$2" \
        --compile --models epd_gpu_image,epd_gpu_image_graphs --images 4 --image-sizes 448x448,672x672,896x896 \
        --max-tokens 128 --concurrency 8,32 --requests 64 --warmup 6 --no-progress --out "$OUT/bench-graphs" 2>&1 \
        | tee "$OUT/bench-graphs.log" | tail -60
    ;;
*) echo "usage: $0 kernels | bench CHECKPOINT" >&2; exit 2 ;;
esac
