#!/usr/bin/env bash
# One-command set-up on a fresh machine (make setup). Idempotent: a second run checks stamps and
# takes seconds. Installs the venv (.venv), the pinned Python stack, the real tritonserver with its
# Python backend, and builds the tiny random-weight Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen2-Audio models under
# models/. The shared embedding tier's Mooncake Store goes into .venv-mooncake (scripts/setup_mooncake.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
MODEL_DIR="$ROOT/models/tiny-qwen2-vl"
started=$(date +%s)

say() { printf '[setup] %s\n' "$*"; }
LOG="$ROOT/.setup.log"
# Run a step with its output in $LOG; show the log's tail only if it fails. (pip's resolver prints
# expected conflict warnings here: steps 2 and 3 override what step 1 resolved, on purpose.)
quiet() { "$@" >>"$LOG" 2>&1 || { echo "[setup] failed: $*" >&2; tail -n 40 "$LOG" >&2; exit 1; }; }

if [ ! -x "$PY" ]; then
  BASE_PY="$(command -v python3.11 || command -v python3)"
  "$BASE_PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || { echo "[setup] Python 3.11 is required (found $("$BASE_PY" --version))" >&2; exit 1; }
  say "creating $VENV"
  "$BASE_PY" -m venv "$VENV"
fi

stamp="$VENV/.epd-packages"
# requirements/mooncake.txt is the tier venv's (scripts/setup_mooncake.sh), not this one's
want="$(cat $(ls requirements/*.txt | grep -v mooncake.txt) scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  : > "$LOG"
  pip=("$PY" -m pip install --disable-pip-version-check --progress-bar off)
  say "installing the engine stack (vLLM CPU, torch CPU, NIXL, tritonclient deps); the first run takes minutes; log: $LOG"
  quiet "$PY" -m pip install --disable-pip-version-check --upgrade "pip>=24"
  quiet "${pip[@]}" -r requirements/main.txt -c requirements/constraints.txt
  quiet "${pip[@]}" -r requirements/overrides.txt
  quiet "${pip[@]}" --no-deps -r requirements/nodeps.txt
  # PyPI's torchaudio/torchcodec fail to load beside CPU torch; transformers would still find and import them.
  quiet "$PY" -m pip uninstall -y torchaudio torchcodec
  quiet "${pip[@]}" --no-deps -e .
  echo "$want" > "$stamp"
else
  say "packages up to date"
fi

"$PY" scripts/post_install.py
bash scripts/setup_mooncake.sh  # .venv-mooncake: the shared embedding tier (docs/tier.md)
"$PY" -m devtools.tiny --out "$MODEL_DIR"
for family in qwen2_5_vl qwen3_vl; do "$PY" -m devtools.tiny --family "$family"; done  # models/tiny-<family>
"$PY" -m devtools.tiny.audio --out "$ROOT/models/tiny-qwen2-audio"
"$PY" -c "import numpy, vllm, tritonclient.grpc, nixl._api; assert numpy.__version__ == '1.26.4', numpy.__version__" 2>/dev/null \
  || { echo "[setup] import check failed" >&2; "$PY" -c "import numpy, vllm, tritonclient.grpc, nixl._api"; exit 1; }
say "done in $(( $(date +%s) - started )) s"
