#!/usr/bin/env bash
# On the lent GPU machine, after the set-up (scripts/gpu_setup.sh pieces + install, scripts/gpu_triton_env.sh):
# images preprocessed on the encoder's GPU (issue 37, item 1; docs/gpu.md, "Images preprocessed on the GPU").
#   scripts/gpu_image.sh models       the three tiny checkpoints the tests read (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
#   scripts/gpu_image.sh tests [K]    tests/component/test_gpu_image_gpu.py (-k K): bounds, tokens, the CPU table;
#                                     the whole log in $OUT/gpu_image_tests.log
#   scripts/gpu_image.sh cpu          the encoder's host CPU per 896 px image by mode (clients.tools.image_cpu,
#                                     the processor capped at the 2B's 12,845,056 pixels) -> $OUT/image_cpu.json
#   scripts/gpu_image.sh bench CKPT   E+PD with the encoder's images on the CPU (epd) and on the GPU with nvJPEG
#                                     (epd_nvjpeg), a server each, 4 JPEGs of 448-896 px a request -> $OUT/bench-image
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
case "${1:-}" in
models)
    for pair in qwen2_vl:tiny-qwen2-vl qwen2_5_vl:tiny-qwen2.5-vl qwen3_vl:tiny-qwen3-vl; do
        python3 -m devtools.tiny --family "${pair%%:*}" --out "models/${pair#*:}" | tail -1
    done
    ;;
tests)
    set -o pipefail
    timeout 560 .venv/bin/python -m pytest -q -s tests/component/test_gpu_image_gpu.py ${2:+-k "$2"} 2>&1 \
        | tee "$OUT/gpu_image_tests.log" | grep -E "torch |grids|nvjpeg |embedding|tokens|TTFT|CPU|\| |passed|failed|Error|assert" \
        | tail -70
    ;;
cpu)
    .venv/bin/python -m clients.tools.image_cpu models/tiny-qwen2-vl --device cuda:0 --size 896 --batch 8 \
        --repeats 5 --max-pixels 12845056 --json "$OUT/image_cpu.json" 2>&1 | tail -12
    ;;
bench)
    export VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    timeout 560 .venv/bin/python -m clients.bench.e2e --topology topologies/checkpoint-gpu.yaml --checkpoint "$2" \
        --compile --models epd,epd_nvjpeg --images 4 --image-sizes 448x448,672x672,896x896 --image-format JPEG \
        --max-tokens 128 --concurrency 8,32 --requests 64 --warmup 6 --no-progress --out "$OUT/bench-image" 2>&1 \
        | tee "$OUT/bench-image.log" | tail -60
    ;;
*) echo "usage: $0 models | tests [K] | cpu | bench CHECKPOINT" >&2; exit 2 ;;
esac
