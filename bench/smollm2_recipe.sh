#!/usr/bin/env bash
# The SmolLM2 recipe of docs/training.md ("Learning on a real model, measured by the
# engine"), every step of it, judged by vLLM on HumanEval, a set the drafter never saw:
#
#   bash bench/smollm2_recipe.sh [WORK]      # WORK: default runs/smollm2-recipe
#
# 1. prompts    WORK/train.jsonl (stdlib signatures + docstrings), WORK/humaneval.jsonl
# 2. regen      vLLM serves the target alone; `regenerate --server` writes its replies
# 3. cache      `cache-hidden --format speculators` from WORK/recipe.yaml into WORK/hs
# 4. train      `train --hidden-cache` into WORK/run (the drafter: WORK/run/drafter)
# 5. judge      bench/learning_run.py serves the drafter in vLLM and measures τ on
#               HumanEval and on the run's held-out prompts: WORK/judge.jsonl
#
# Sizes from the environment: PROMPTS (training prompts, 7200:
# the standard library's stubs, then the installed packages'), STEPS (3700), HUMANEVAL
# (the first N of HumanEval's 164 problems, all of them), EVAL_PROMPTS (the held-out
# prompts training's final evaluation decodes and vLLM judges again; unset: the recipe's
# 16, the slowest part of a tiny run's training). VLLM is a python with vLLM
# (default: the CPU build's venv, made once by tools/vllm/venv.sh); PORT the
# regeneration server's port (default: a free one); VLLM_CPU_KVCACHE_SPACE (GiB, 4).
# The target is SmolLM2-135M-Instruct as tools/vllm/model.sh makes it.
#
# A stage whose output is complete is skipped, so an interrupted recipe continues where it
# stopped (regenerate and cache-hidden continue their own half-written outputs). Each
# stage prints its seconds. The regeneration server runs in a process group of its own
# and is stopped whatever ends the script; the judge's server is learning_run's to stop.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${1:-runs/smollm2-recipe}
PROMPTS=${PROMPTS:-7200}
STEPS=${STEPS:-3700}
HUMANEVAL=${HUMANEVAL:-164}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
mkdir -p "$work"
work=$(cd "$work" && pwd)
cd "$root"
# shellcheck source=scripts/bootstrap.sh
source scripts/bootstrap.sh
VLLM=${VLLM:-$(bash tools/vllm/venv.sh)}
target=$(bash tools/vllm/model.sh)
# vLLM's CPU build: fp32 (SmolLM2's weights as model.sh saves them), no CUDA graphs.
serve="$VLLM -m vllm.entrypoints.openai.api_server --dtype float32 --enforce-eager --max-model-len 1024"

server_pid=""
stop_server() {
  [ -n "$server_pid" ] || return 0
  # Its engine-core and worker processes share its group: all of them, TERM then KILL.
  kill -TERM -- "-$server_pid" 2>/dev/null || true
  for _ in $(seq 30); do
    kill -0 -- "-$server_pid" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT
# Without these a signal would end bash before the EXIT trap could stop the server.
trap 'exit 130' INT
trap 'exit 143' TERM

stage_start=0
begin() {
  stage_start=$(date +%s)
  echo "smollm2-recipe: $1" >&2
}
took() { echo "smollm2-recipe: $1 took $(($(date +%s) - stage_start)) s" >&2; }
skip() { echo "smollm2-recipe: $1 skipped ($2 exists)" >&2; }

# The recipe (docs/training.md shows this file; a test holds the two equal). Paths are
# relative to WORK, where the stages run.
cat > "$work/recipe.yaml" <<EOF
target: $target
data: regen.jsonl
seq-len: 512
batch-size: 2
keep-cut-replies: true
target-layers: [1, 7, 14, 20, 27]
drafter-layers: 3
block-size: 8
num-anchors: 48
draft-vocab-size: 8192
lr: 0.002
warmup-steps: 50
precision: bf16
position-weighting: dpace
drafter-init: target
use-soft-labels: true
eval-prompts: 16
eval-every: 0
EOF
cd "$work"

if [ -f prompts.done ]; then
  skip prompts prompts.done
else
  begin "prompts: $PROMPTS for training, $HUMANEVAL of HumanEval"
  python "$root/bench/coding_prompts.py" train train.jsonl --count "$PROMPTS" --packages
  python "$root/bench/coding_prompts.py" humaneval humaneval.jsonl --count "$HUMANEVAL"
  touch prompts.done
  took prompts
fi

if [ -f regen.done ]; then
  skip regen regen.done
else
  begin "regen: vLLM serves $target (its log: $work/regen-server.log)"
  port=${PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
  # shellcheck disable=SC2086  # $serve is a command line
  setsid $serve --model "$target" --host 127.0.0.1 --port "$port" \
    < /dev/null > regen-server.log 2>&1 &
  server_pid=$!
  deadline=$(($(date +%s) + 900))  # a first start compiles; two busy cores are slow
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if ! kill -0 "$server_pid" 2>/dev/null || [ "$(date +%s)" -gt "$deadline" ]; then
      tail -n 20 regen-server.log >&2
      echo "smollm2-recipe: vLLM is not serving (its log: $work/regen-server.log)" >&2
      exit 1
    fi
    sleep 1
  done
  dflash-train regenerate --server "http://127.0.0.1:$port" --target "$target" \
    --data train.jsonl --output regen.jsonl --max-new-tokens 192 --concurrency 48
  stop_server
  touch regen.done
  took regen
fi

if [ -f cache.done ]; then
  skip cache cache.done
else
  begin "cache: hidden states into $work/hs"
  dflash-train cache-hidden --config recipe.yaml --output hs --format speculators
  touch cache.done
  took cache
fi

if [ -f train.done ]; then
  skip train train.done
else
  begin "train: $STEPS steps into $work/run"
  extra=()
  [ -z "${EVAL_PROMPTS:-}" ] || extra=(--eval-prompts "$EVAL_PROMPTS")
  # An interrupted run continues from its last checkpoint, or starts over.
  if compgen -G "run/checkpoints/*" > /dev/null; then
    extra+=(--resume latest)
  elif [ -e run ]; then
    extra+=(--overwrite)
  fi
  dflash-train train --config recipe.yaml --hidden-cache hs --steps "$STEPS" \
    --output-dir run "${extra[@]}"
  touch train.done
  took train
fi

if [ -f judge.jsonl ]; then
  skip judge judge.jsonl
else
  begin "judge: vLLM serves run/drafter (its log: $work/run/vllm.log)"
  python "$root/bench/learning_run.py" --results judge.jsonl --name smollm2-recipe \
    --run-dir "$work/run" --vllm "$serve" --judge humaneval.jsonl --judge heldout \
    --max-new-tokens 128
  took judge
fi
