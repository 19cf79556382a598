#!/usr/bin/env bash
# Source me: creates (once) and activates the cached virtual environment.
# The venv lives outside the clone because PyTorch is a multi-GiB install; it is
# keyed by the pinned constraints so a dependency change builds a fresh one.
# The work runs in a subshell with its own `set -euo pipefail`: sourcing this file
# changes only DFLASH_VENV and PATH of the calling shell, never its options.
_dflash_venv=$(
  set -euo pipefail
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  python=${PYTHON:-python3}
  key=$(sha256sum < "$root/constraints.txt" | cut -c1-12)
  cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
  venv=${DFLASH_VENV:-$cache/venv-$key}
  # Editable installs point at one checkout; re-install when this checkout is another one.
  stamp="$venv/.dflash-stamp"
  want="$(cat "$root/constraints.txt" "$root/pyproject.toml" | sha256sum | cut -c1-12) $root"
  if [ ! -x "$venv/bin/python" ]; then
    echo "bootstrap: creating $venv (first run downloads PyTorch, a few minutes)" >&2
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade "pip>=24" >&2
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install -q -c "$root/constraints.txt" -e "$root[dev,hf]" >&2
    echo "$want" > "$stamp"
  fi
  echo "$venv"
)
# Not `$(...) || ...`: that context would switch errexit off inside the subshell.
if [ $? -ne 0 ]; then
  echo "bootstrap: failed (see the messages above)" >&2
  unset _dflash_venv
  return 1 2>/dev/null || exit 1
fi
export DFLASH_VENV=$_dflash_venv
export PATH="$DFLASH_VENV/bin:$PATH"
unset _dflash_venv
