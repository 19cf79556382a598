#!/usr/bin/env bash
# Runs dflash-train (default: train on the embedded default) inside the cached venv.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
exec dflash-train "$@"
