#!/usr/bin/env bash
# Runs the whole test suite (unit, slow and real-Jaeger integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# The real Jaeger is built from its Go module once and cached; without Go the
# Jaeger tests skip with a reason (CI sets DFLASH_REQUIRE_JAEGER=1 to forbid that).
if command -v go >/dev/null 2>&1 && [ -f tools/jaeger/build.sh ]; then
  DFLASH_JAEGER_BIN=$(bash tools/jaeger/build.sh) && export DFLASH_JAEGER_BIN
fi
exec python -m pytest "$@"
