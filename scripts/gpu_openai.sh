#!/usr/bin/env bash
# On the lent GPU machine, after scripts/gpu_setup.sh (with aiohttp's wheels in /tmp/gpu/wheels: the benchmark's HTTP
# client) and scripts/gpu_triton_env.sh: what the OpenAI endpoint costs against Triton's gRPC endpoint (issue 19) on a
# host where the endpoint and the clients have cores of their own (16), E+PD of topologies/checkpoint-gpu.yaml on the
# tiny checkpoint: rounds at concurrency 16, then one request at a time in pairs (clients.bench.openai).
#   scripts/gpu_openai.sh [CHECKPOINT] [LOOP]   (default models/tiny-qwen2-vl; LOOP: the endpoint's event loop,
#                                               auto (uvloop), uvloop or asyncio)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo
export VLLM_ALLOW_LONG_MAX_MODEL_LEN=1  # the tiny checkpoint says 4096 positions, the topology 32768; requests stay below
repo=$(mktemp -d /tmp/openai-repo.XXXX)
.venv/bin/python -m backend.deploy.topology render topologies/checkpoint-gpu.yaml --machine gpu \
    --checkpoint "${1:-models/tiny-qwen2-vl}" --out "$repo" > /dev/null
timeout 580 .venv/bin/python -m clients.bench.openai --repository "$repo" --model epd --concurrency 16 --requests 200 \
    --rounds 3 --paired 300 --openai-loop "${2:-auto}" 2>&1 | tail -24
rm -rf "$repo"
