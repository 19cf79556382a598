#!/usr/bin/env bash
# Source me: creates (once) and activates this checkout's virtual environment.
# Two layers, both outside the clone:
#   deps      the third-party packages (PyTorch is a multi-GiB install), shared by every
#             checkout and keyed by the pinned constraints and pyproject; the project
#             itself is never installed there
#   checkout  a small venv of this checkout alone, keyed by its path only (never by a
#             DFLASH_VENV another checkout's bootstrap left in the shell): its
#             site-packages adds the deps' (a .pth file) and holds the editable install
#             of this checkout, so two clones used in turn each run their own code; its
#             bin/ runs the deps' console scripts (torchrun, pytest, ...) with its own
#             interpreter, so `torchrun -m dflash.cli` runs this checkout from any folder
# The work runs in a subshell with its own `set -euo pipefail`: sourcing this file
# changes only DFLASH_VENV and PATH of the calling shell, never its options.
_dflash_venv=$(
  set -euo pipefail
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  python=${PYTHON:-python3}
  cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
  key=$(cat "$root/constraints.txt" "$root/pyproject.toml" | sha256sum | cut -c1-12)
  deps=${DFLASH_DEPS_VENV:-$cache/venv-$(sha256sum < "$root/constraints.txt" | cut -c1-12)}
  venv=$cache/checkouts/$(printf %s "$root" | sha256sum | cut -c1-12)
  if [ ! -x "$deps/bin/python" ]; then
    echo "bootstrap: creating $deps (first run downloads PyTorch, a few minutes)" >&2
    "$python" -m venv "$deps"
    "$deps/bin/python" -m pip install -q --upgrade "pip>=24" >&2
  fi
  if [ "$(cat "$deps/.dflash-deps-stamp" 2>/dev/null)" != "$key" ]; then
    # The project's requirements through its own metadata, then the project out again.
    "$deps/bin/python" -m pip install -q -c "$root/constraints.txt" -e "$root[dev,hf,trackers]" >&2
    "$deps/bin/python" -m pip uninstall -q -y dflash-train >&2
    echo "$key" > "$deps/.dflash-deps-stamp"
  fi
  want="$key $deps $root"
  if [ "$(cat "$venv/.dflash-stamp" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    "$deps/bin/python" -m venv --without-pip "$venv"
    purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
    # addsitedir, not a bare path: the deps' own .pth files (setuptools' among them) apply.
    printf 'import site; site.addsitedir(%s)\n' "'$(purelib "$deps/bin/python")'" \
      > "$(purelib "$venv/bin/python")/_dflash_deps.pth"
    "$deps/bin/python" -m pip --python "$venv/bin/python" install -q --no-deps \
      --no-build-isolation -e "$root" >&2
    echo "$want" > "$venv/.dflash-stamp"
  fi
  # Each Python console script of the deps gets a wrapper here that runs it with this
  # venv's interpreter: the deps' own interpreter does not see this checkout's code.
  # Written aside and renamed, so a shell sourcing this meanwhile never runs half a file.
  for script in "$deps"/bin/*; do
    name=${script##*/}
    case $name in pip | pip3 | pip3.* | python | python3 | python3.* | activate* | Activate.ps1) continue ;; esac
    if [ -e "$venv/bin/$name" ] || [ ! -f "$script" ]; then continue; fi
    if ! head -n 2 "$script" 2>/dev/null | grep -qF "$deps/bin/python"; then continue; fi
    printf '#!/bin/sh\n# bootstrap.sh: the deps'"'"' %s, run by this checkout'"'"'s interpreter\nexec %s %s "$@"\n' \
      "$name" "'$venv/bin/python'" "'$script'" > "$venv/bin/.$name.$$"
    chmod 755 "$venv/bin/.$name.$$"
    mv -f "$venv/bin/.$name.$$" "$venv/bin/$name"
  done
  echo "$venv:$deps"
)
# Not `$(...) || ...`: that context would switch errexit off inside the subshell.
if [ $? -ne 0 ]; then
  echo "bootstrap: failed (see the messages above)" >&2
  unset _dflash_venv
  return 1 2>/dev/null || exit 1
fi
export DFLASH_VENV=${_dflash_venv%%:*}
export PATH="$DFLASH_VENV/bin:${_dflash_venv#*:}/bin:$PATH"
unset _dflash_venv
