#!/usr/bin/env bash
# A saved drafter through vllm-project/speculators' own DFlash converter:
#   bash scripts/speculators_check.sh
# speculators 0.9.0 pins torch<=2.14.1 and transformers<=5.19, older than this project's,
# and pulls torchvision and torchaudio: it cannot join the project's environment. A small
# venv adds it without its pins (and its light dependencies, pinned here) on top of this
# checkout's venv, then runs the tests that need it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/bootstrap.sh"
cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
venv="$cache/speculators-0.9.0-$(printf %s "$DFLASH_VENV" | sha256sum | cut -c1-8)"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ ! -f "$venv/.ready" ]; then
  rm -rf "$venv"
  python -m venv "$venv"
  printf 'import site; site.addsitedir(%s)\n' "'$(purelib "$DFLASH_VENV/bin/python")'" \
    > "$(purelib "$venv/bin/python")/_dflash_checkout.pth"
  "$venv/bin/python" -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
  "$venv/bin/python" -m pip install -q "datasets==5.1.0" \
    "loguru==0.7.3" "openai==3.57.0" "pydantic-settings==2.16.3"
  touch "$venv/.ready"
fi
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs \
  tests/dflash/drafter/test_speculators_conversion.py
