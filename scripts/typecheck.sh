#!/usr/bin/env bash
# mypy on the packages it holds to strict rules (pyproject's [tool.mypy]: tracing/,
# dflash/config/ and the dflash modules listed there; the other dflash modules they import
# are read, not reported), with the project's pinned dependencies. mypy lives in a small
# venv of its own, cached, so the project's dependency pins (and the large venv keyed by
# them) do not move with it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
pins=(mypy==2.4.1 mypy_extensions==1.2.0 pathspec==1.1.1 librt==0.17.0 ast_serialize==0.13.1
  typing_extensions==4.16.0)
venv=$cache/mypy-$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-12)
if [ ! -x "$venv/bin/mypy" ]; then
  rm -rf "$venv.tmp"
  "${PYTHON:-python3}" -m venv "$venv.tmp"
  "$venv.tmp/bin/python" -m pip install -q --no-deps "${pins[@]}" >&2
  "$venv.tmp/bin/python" -m mypy --version >/dev/null  # an incomplete install is never cached
  mv "$venv.tmp" "$venv"
fi
# The checkout's interpreter: it sees the project (editable) and its pinned packages.
exec "$venv/bin/python" -m mypy --python-executable "$(command -v python)" "$@"
