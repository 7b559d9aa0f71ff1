#!/usr/bin/env bash
# Here (PyPI reachable, no GPU): build what scripts/gpu_setup.sh installs on the lent GPU machine, as pieces that
# each fit one device call (64 MiB with the working tree):
#   DEST/pieces/vllm.NN   one tar of wheels/ (vLLM 0.26.0's lean set + nixl/nixl-cu13 1.5.1, cp312 manylinux; simpy), split
#   DEST/pieces/tri.NN    one tar of tri/ (tritonserver 2.51 files from this venv's nvidia-pytriton 0.7.0 wheel,
#                         numpy 1.26.4, tritonclient 2.51.0, python-rapidjson, protobuf 4.25.8 cp312 wheels), split
#   DEST/extra/           the NVDEC path's two wheels (PyNvVideoCodec 2.2.4, PyAV 18.1.0), one call each
# The code itself needs no staging: the working tree travels with every call (docs/gpu.md, "Set-up").
# Usage: scripts/gpu_pieces.sh [DEST]   (DEST defaults to .cache/gpu). LEAN names the lean requirement list (one
# pinned name a line: vLLM 0.26 pins torch 2.11, the GPU machine's own torch, so only vLLM's pure-Python and small
# compiled dependencies travel; the optional CUDA kernel packages stay out); default: ../shared/gpu/vllm-0.26-lean.txt.
# Downloads are kept in DEST/wheels and DEST/tri, so a second run only re-packs.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$(realpath -m "${1:-.cache/gpu}")
LEAN=${LEAN:-/work/shared/gpu/vllm-0.26-lean.txt}
PIECE=${PIECE:-45M}  # the tree that travels was 4.9 MiB on 2026-12-04 (59 MiB pieces refused), 8.6 MiB on 2026-12-06 (55 refused)
PY=${PY:-.venv/bin/python}
PLATFORMS=()
for n in 2_35 2_34 2_31 2_28 2_27 2_24 2_17; do PLATFORMS+=(--platform "manylinux_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
download() {  # download DIR ARGS...: cp312 wheels for the GPU machine, no dependencies resolved here
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        -d "$dir" "$@"
}
mkdir -p "$DEST/wheels" "$DEST/tri" "$DEST/pieces"
download "$DEST/wheels" -r <(grep -v '^#' "$LEAN")
download "$DEST/wheels" simpy==4.1.2  # the planner's simulator (clients.plan; scripts/gpu_plan.sh), pure Python
download "$DEST/tri" numpy==1.26.4 tritonclient==2.51.0 python-rapidjson protobuf==4.25.8
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the server, the Python backend and the 3.12 stub only (the other stubs and the bundled libpython are not needed)
tar cJf "$DEST/tri/triton-gpu.tar.xz" -C "$SP" --exclude='libpython3-*' --exclude='python_backend_stubs/3.[0-9]' \
    --exclude='python_backend_stubs/3.1[013]' pytriton/tritonserver nvidia_pytriton.libs
rm -f "$DEST"/pieces/*
tar cf - -C "$DEST" wheels | split -b "$PIECE" -d - "$DEST/pieces/vllm."
tar cf - -C "$DEST" tri | split -b "$PIECE" -d - "$DEST/pieces/tri."
mkdir -p "$DEST/extra"
download "$DEST/extra" pynvvideocodec==2.2.4 av==18.1.0
ls -l "$DEST/pieces" "$DEST/extra"
