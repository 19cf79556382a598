#!/usr/bin/env bash
# Source me: creates (once) and activates the cached virtual environment.
# The venv lives outside the clone because PyTorch is a multi-GiB install; it is
# keyed by the pinned constraints so a dependency change builds a fresh one.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_python=${PYTHON:-python3}
_key=$(sha256sum < "$_root/constraints.txt" | cut -c1-12)
_cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
export DFLASH_VENV=${DFLASH_VENV:-$_cache/venv-$_key}
# Editable installs point at one checkout; re-install when this checkout is another one.
_stamp="$DFLASH_VENV/.dflash-stamp"
_want="$(cat "$_root/constraints.txt" "$_root/pyproject.toml" | sha256sum | cut -c1-12) $_root"
if [ ! -x "$DFLASH_VENV/bin/python" ]; then
  echo "bootstrap: creating $DFLASH_VENV (first run downloads PyTorch, a few minutes)" >&2
  "$_python" -m venv "$DFLASH_VENV"
  "$DFLASH_VENV/bin/python" -m pip install -q --upgrade "pip>=24" >&2
fi
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
  "$DFLASH_VENV/bin/python" -m pip install -q -c "$_root/constraints.txt" -e "$_root[dev,hf]" >&2
  echo "$_want" > "$_stamp"
fi
export PATH="$DFLASH_VENV/bin:$PATH"
unset _root _python _key _cache _stamp _want
