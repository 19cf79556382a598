#!/usr/bin/env bash
# Runs the whole test suite (unit, slow and the integration tests against the real
# Jaeger, Prometheus and llama-server).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# Jaeger, Prometheus and the OpenTelemetry Collector are built from their Go modules
# once and cached; without Go their tests skip with a reason (CI sets
# DFLASH_REQUIRE_JAEGER=1, DFLASH_REQUIRE_PROMETHEUS=1 and DFLASH_REQUIRE_OTELCOL=1 to
# forbid that).
if command -v go >/dev/null 2>&1; then
  if [ -f tools/jaeger/build.sh ]; then
    DFLASH_JAEGER_BIN=$(bash tools/jaeger/build.sh) && export DFLASH_JAEGER_BIN
  fi
  if [ -f tools/prometheus/build.sh ]; then
    DFLASH_PROMETHEUS_BIN=$(bash tools/prometheus/build.sh) && export DFLASH_PROMETHEUS_BIN
  fi
  if [ -f tools/otelcol/build.sh ]; then
    DFLASH_OTELCOL_BIN=$(bash tools/otelcol/build.sh) && export DFLASH_OTELCOL_BIN
  fi
fi
# llama.cpp's llama-server (regenerate --server's tests) is built from source once and
# cached; without cmake and a C++ compiler its tests skip (CI sets
# DFLASH_REQUIRE_LLAMA_SERVER=1).
if command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 \
    && [ -z "${DFLASH_LLAMA_SERVER_BIN:-}" ]; then
  DFLASH_LLAMA_SERVER_BIN=$(bash tools/llama_server/build.sh) && export DFLASH_LLAMA_SERVER_BIN
fi
exec python -m pytest "$@"
