#!/usr/bin/env bash
# Runs the whole test suite (unit, slow and the integration tests against the real
# Jaeger and Prometheus).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# Jaeger and Prometheus are built from their Go modules once and cached; without Go
# their tests skip with a reason (CI sets DFLASH_REQUIRE_JAEGER=1 and
# DFLASH_REQUIRE_PROMETHEUS=1 to forbid that).
if command -v go >/dev/null 2>&1; then
  if [ -f tools/jaeger/build.sh ]; then
    DFLASH_JAEGER_BIN=$(bash tools/jaeger/build.sh) && export DFLASH_JAEGER_BIN
  fi
  if [ -f tools/prometheus/build.sh ]; then
    DFLASH_PROMETHEUS_BIN=$(bash tools/prometheus/build.sh) && export DFLASH_PROMETHEUS_BIN
  fi
fi
exec python -m pytest "$@"
