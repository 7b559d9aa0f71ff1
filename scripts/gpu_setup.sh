#!/usr/bin/env bash
# On the lent GPU machine (no network; Python 3.12 with torch 2.11+cu130 preinstalled): install vLLM 0.26.0 (lean
# set), NIXL 1.5.1 and, optionally, the Triton 2.51 Python-backend environment, from the pieces that
# scripts/gpu_pieces.sh made here. Each step is one short device call; the machine keeps /tmp only while it stays
# warm (30 s after a call), so the calls follow each other at once:
#   scripts/gpu_setup.sh piece FILE   a call carrying FILE (one piece, e.g. .cache/gpu/pieces/vllm.03) stores it in
#                                     /tmp/gpu/pieces (a carried path is gone in the next call)
#   scripts/gpu_setup.sh install      joins the pieces, installs the wheels with --no-deps into /tmp/site and registers
#                                     the project's vLLM plugin there; unpacks tri/ into /tmp/gpu/tri when its pieces
#                                     came (then: TRI=/tmp/gpu/tri scripts/gpu_triton_env.sh)
#   scripts/gpu_setup.sh check        imports vLLM, NIXL's connector and the plugin entry point
# Afterwards: export PYTHONPATH=/tmp/site:SRC (SRC: the checkout this script is in, the working tree that travels
# with every device call).
set -euo pipefail
STORE=${STORE:-/tmp/gpu}
SITE=${SITE:-/tmp/site}
SRC=$(realpath "$(dirname "$0")/..")  # the project's code: the checkout this script is in

plugin_entry_point() {
    # vLLM loads general plugins through entry points; the project is not pip-installed there, so a minimal
    # distribution in SITE declares pyproject.toml's entry point (backend.engine.patches:register)
    local info="$SITE/triton_epd_gpu-0.0.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: triton-epd-gpu\nVersion: 0.0\n' > "$info/METADATA"
    # and the server's in-process OpenAI endpoint (pyproject's triton_epd.endpoints; without it a topology with
    # openai_port fails to load: "no in-process endpoint 'openai' is installed", H200 2026-12-05)
    printf '[vllm.general_plugins]\nepd_patches = backend.engine.patches:register\n\n[triton_epd.endpoints]\nopenai = frontend.openai.in_process:serve_for\n' \
        > "$info/entry_points.txt"
    : > "$info/RECORD"
}

case "${1:-}" in
piece)
    mkdir -p "$STORE/pieces"
    cp "$2" "$STORE/pieces/"
    ls -l "$STORE/pieces" | tail -n +2
    ;;
install)
    started=$(date +%s)
    cat "$STORE"/pieces/vllm.* | tar xf - -C "$STORE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$STORE"/wheels/*.whl
    if ls "$STORE"/pieces/tri.* > /dev/null 2>&1; then
        cat "$STORE"/pieces/tri.* | tar xf - -C "$STORE"
    fi
    plugin_entry_point
    echo "installed in $(( $(date +%s) - started )) s into $SITE"
    ;;
check)
    PYTHONPATH="$SITE:$SRC" python3 - <<'EOF'
from importlib.metadata import entry_points
import torch, vllm
import importlib
for name in ("nixl", "nixl_connector"):  # vLLM 0.26: package v1.nixl; 0.32: module v1.nixl_connector
    try:
        connector = importlib.import_module(f"vllm.distributed.kv_transfer.kv_connector.v1.{name}").NixlConnector
        break
    except ModuleNotFoundError:
        continue
plugins = [e.value for e in entry_points(group="vllm.general_plugins")]
print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "plugins", plugins,
      "connector", connector.__module__)
EOF
    ;;
*)
    echo "usage: $0 piece FILE | install | check" >&2
    exit 2
    ;;
esac
