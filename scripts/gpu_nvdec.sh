#!/usr/bin/env bash
# On the lent GPU machine, after scripts/gpu_setup.sh (pieces, the PyNvVideoCodec and PyAV wheels in /tmp/gpu/wheels,
# install) and scripts/gpu_triton_env.sh: NVDEC in the encoder (issue 21, item 5; docs/gpu.md).
#   scripts/gpu_nvdec.sh tests          the GPU tests of the decode (bit-exact frames, threads, fall-back), then llm and
#                                       epd served with the encoder's video_decoder nvdec (same tokens)
#   scripts/gpu_nvdec.sh bench WxH FPS  epd (videos decoded on the CPU) against epd_nvdec, 30-frame H.264 clips at FPS
#                                       (fps 2: all 30 frames sampled; 30: 2), one run; results in $OUT/nvdec-WxH
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo
case "${1:-}" in
tests)
    timeout 560 .venv/bin/python -m pytest -q -s tests/component/test_nvdec_gpu.py ${2:+-k "$2"} 2>&1 \
        | grep -E "ms|video|decodes|levels|passed|failed|Error|assert" | tail -40
    ;;
bench)
    size=${2:-448x448}; fps=${3:-2}
    # the log is written as it goes, so a run cut short by the device's time still brings back how far it got
    export PYTHONUNBUFFERED=1
    export VLLM_ALLOW_LONG_MAX_MODEL_LEN=1  # the tiny checkpoint says 4096 positions, the topology 32768; requests stay below
    timeout 580 .venv/bin/python -m clients.bench.e2e --topology topologies/checkpoint-gpu.yaml --compile \
        --models epd,epd_nvdec --modalities video --video-codec h264 --video-size "$size" --video-frames 30 \
        --video-fps "$fps" --max-tokens 64 --concurrency 4,16 --requests 32 --warmup 8 --no-progress \
        --out "${OUT:-/tmp}/nvdec-$size-$fps" 2>&1 | tee "${OUT:-/tmp}/nvdec-$size-$fps.log" | tail -40
    ;;
*) echo "usage: $0 tests | bench WxH FPS" >&2; exit 2 ;;
esac
