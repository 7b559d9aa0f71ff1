#!/usr/bin/env bash
# On the lent GPU machine, after the set-up (docs/gpu.md: scripts/gpu_setup.sh pieces + install,
# scripts/gpu_triton_env.sh, scripts/gpu_real_model.sh /tmp/q2b): vLLM's own stack beside ours, one client, the same
# requests, one table (issue 37, item 3; docs/gpu.md, "vLLM's own stack beside ours on the H200").
#   scripts/gpu_side_by_side.sh CHECKPOINT [CONCURRENCY [REQUESTS [ROWS [SECONDS]]]]
# vLLM's example proxy is vLLM's file, never committed here: the call carries it in .cache/vllm-proxy/ (ignored) and
# it is copied outside the repository (side_by_side refuses a proxy inside it). Every engine of both sides eager
# (--eager: the cheapest start that is the same on both; ours' GPU encoder tower then runs eager too), the topology's
# other engine settings (bf16, max_num_seqs 64, max_model_len 32768, 16 GiB of KV each). Results into $OUT: side.log,
# tables.md, results.json, logs.tgz (every server's and the proxy's log); SECONDS (default 540) bounds the run, which
# then reports the rows that finished. IMAGE_PREPROCESS=gpu|nvjpeg: ours' encoders preprocess images on the GPU
# (side_by_side --image-preprocess; vLLM's encoder has no such choice). ENGINES=compile: every engine of both sides
# compiled with CUDA graphs (--compile; ours' GPU encoder towers torch.compiled) instead of eager. PROFILE=1: py-spy
# every Python process of each row (side_by_side --profile; the call carries py-spy's binary in .cache/py-spy/, ignored)
# -> profile.md, the collapsed stacks in logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.cache/py-spy:$PATH PYTHONPATH=/tmp/site:$PWD UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
OUT=${OUT:-/tmp/side-out}
CKPT=${1:?checkpoint}
C=${2:-32}
N=${3:-64}
ROWS=${4:-vllm-single,llm,vllm-e-pd,epd,vllm-e-p-d,epd_disagg}
SECONDS_MAX=${5:-540}
mkdir -p /tmp/vllm-proxy "$OUT"
cp .cache/vllm-proxy/disagg_epd_proxy.py /tmp/vllm-proxy/
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu-before.txt" 2>&1
timeout -s TERM -k 30 "$SECONDS_MAX" .venv/bin/python -m clients.bench.side_by_side \
    --topology topologies/checkpoint-gpu.yaml --checkpoint "$CKPT" "--${ENGINES:-eager}" --parallel-start --interleave \
    --images-per-request 4 --image-size 448,672,896 --max-tokens 128 --concurrency "$C" --requests "$N" \
    --warmup 4 --no-grpc --start-timeout 300 --proxy /tmp/vllm-proxy/disagg_epd_proxy.py --rows "$ROWS" \
    ${IMAGE_PREPROCESS:+--image-preprocess "$IMAGE_PREPROCESS"} ${PROFILE:+--profile} --out "$OUT/side" 2>&1 | tee "$OUT/side.log"
rc=${PIPESTATUS[0]}
# $OUT returns at most 8 files, 2 folders down: the servers' logs as one archive
tar czf "$OUT/logs.tgz" -C "$OUT/side" logs $([ -d "$OUT/side/profile" ] && echo profile) 2>/dev/null \
    && rm -rf "$OUT/side/logs" "$OUT/side/profile"
mv "$OUT/side/tables.md" "$OUT/side/results.json" "$OUT/side/profile.md" "$OUT/" 2>/dev/null; rmdir "$OUT/side" 2>/dev/null
ls -la "$OUT"
echo "side_by_side exit status $rc"
