#!/usr/bin/env bash
# AIPerf's set-up (docs/benchmarks.md, "AIPerf"): .venv-aiperf, a venv of its own with the pinned AIPerf
# (requirements/aiperf.txt), for clients/bench/aiperf.py. Its dependencies conflict with .venv's pins (pillow,
# soundfile, pandas, numpy 2.x, dash), so it is kept apart like .venv-mooncake. Not a step of scripts/setup.sh: run it
# by hand when you want the AIPerf benchmark. Idempotent: a fingerprint of this script and the pins is kept in
# .venv-aiperf/.epd-aiperf.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
AP="$ROOT/.venv-aiperf"
say() { printf '[setup] %s\n' "$*"; }

want="$(cat requirements/aiperf.txt scripts/setup_aiperf.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$AP/.epd-aiperf" 2>/dev/null)" = "$want" ]; then
  say "aiperf up to date"
  exit 0
fi
say "installing AIPerf into $AP"
rm -rf "$AP"
BASE_PY="$(command -v python3.11 || command -v python3)"
"$BASE_PY" -m venv "$AP"
"$AP/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q -r requirements/aiperf.txt
# the check: the CLI runs and is the pinned version, and it loads the tiny checkpoint's tokenizer from its directory
pinned="$(sed -n 's/^aiperf==//p' requirements/aiperf.txt)"
[ "$("$AP/bin/aiperf" --version)" = "$pinned" ]
# (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset: with either set, AIPerf 0.13.0 takes a local path for a hub repo id
# and fails, HFValidationError; a directory is read without the hub anyway)
if [ -d models/tiny-qwen2-vl ]; then
  env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$AP/bin/python" -c "from aiperf.common.tokenizer import Tokenizer; \
Tokenizer.from_pretrained('$ROOT/models/tiny-qwen2-vl').encode('ok')"
fi
echo "$want" > "$AP/.epd-aiperf"
say "aiperf $pinned installed"
