#!/usr/bin/env bash
# The shared embedding tier's set-up (docs/tier.md, "Set-up"), a step of scripts/setup.sh that also runs alone:
# .venv-mooncake, a venv of its own with the pinned Mooncake Store wheel (requirements/mooncake.txt) and its deps, and
# the libibverbs/libnl it links, extracted from Debian's packages into .venv-mooncake/private-libs: NOT installed
# system-wide (a system-wide libibverbs1 makes NIXL processes segfault at exit). backend.deploy.tier_service finds
# both. Idempotent: a fingerprint of this script and the pin is kept in .venv-mooncake/.epd-mooncake.
# MOONCAKE=0 skips it (the tier is then off wherever a topology asks for it, and says so).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MC="$ROOT/.venv-mooncake"
LIBS="$MC/private-libs"
DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
say() { printf '[setup] %s\n' "$*"; }
[ "${MOONCAKE:-1}" = 0 ] && { say "mooncake skipped (MOONCAKE=0)"; exit 0; }

want="$(cat requirements/mooncake.txt scripts/setup_mooncake.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$MC/.epd-mooncake" 2>/dev/null)" = "$want" ]; then
  say "mooncake tier up to date"
  exit 0
fi
say "installing the embedding tier's Mooncake Store into $MC"
rm -rf "$MC"
BASE_PY="$(command -v python3.11 || command -v python3)"
"$BASE_PY" -m venv "$MC"
"$MC/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q -r requirements/mooncake.txt
mkdir -p "$LIBS"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# apt-get download needs the package lists: update them once if a package is not found
( cd "$work" && { apt-get download "${DEBS[@]}" >/dev/null 2>&1 || { apt-get update -qq && apt-get download "${DEBS[@]}"; }; } )
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$LIBS"; done
# the check: the store client imports with the private libraries, and the master binary is there
LD_LIBRARY_PATH="$(find "$LIBS" -name 'lib*.so.*' -printf '%h\n' | sort -u | paste -sd:)" \
  "$MC/bin/python" -c "from mooncake.store import MooncakeDistributedStore; import mooncake, os; \
assert os.path.exists(os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master'))"
echo "$want" > "$MC/.epd-mooncake"
say "mooncake tier installed"
