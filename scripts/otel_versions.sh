#!/usr/bin/env bash
# The tracing library against OpenTelemetry releases other than the pinned one:
#   bash scripts/otel_versions.sh            the newest the registry serves
#   bash scripts/otel_versions.sh 1.30.0     a given one (e.g. the lowest pyproject allows)
# `tracing` never imports torch or dflash, so a small venv of its own dependencies
# suffices: the OTel packages at that version, `pip check`, then tests/tracing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
want=${1:-newest}
python=${PYTHON:-python3}
cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
venv="$cache/otel-$want"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade "pip>=24"
fi
if [ "$want" = newest ]; then
  spec=""
  upgrade=(--upgrade --upgrade-strategy eager)
else
  spec="==$want"
  upgrade=()
fi
# The OTel packages move together (with importlib-metadata and zipp, which the API's older
# releases cap); everything else as pinned (numpy, pytest, ...).
grep -viE '^(opentelemetry-|protobuf|grpcio|googleapis-common-protos|importlib[-_]metadata|zipp)' "$root/constraints.txt" \
  > "$venv/constraints-rest.txt"
"$venv/bin/python" -m pip install -q "${upgrade[@]}" -c "$venv/constraints-rest.txt" \
  "opentelemetry-api$spec" "opentelemetry-sdk$spec" \
  "opentelemetry-exporter-otlp-proto-grpc$spec" "opentelemetry-exporter-otlp-proto-http$spec" \
  numpy pytest pytest-timeout pyyaml
"$venv/bin/python" -m pip check
"$venv/bin/python" -m pip list 2>/dev/null | grep -E '^opentelemetry-(api|sdk) ' >&2
cd "$root"
PYTHONPATH="$root" exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/tracing
