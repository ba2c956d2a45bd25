#!/usr/bin/env bash
# The GPU measurements of docs/rollout.md and docs/big-models.md in one script: the decode step,
# the weight hand-off, memory.
#
#   bench/gpu.sh OUT MODEL_DIR [decode] [sync] [memory]   (no part named: all three)
#
# MODEL_DIR: a model's config.json and tokenizer files (weights random: the shape is what is
# measured), e.g. bench/out/shapes/smollm2-135m as `python bench/shapes.py smollm2-135m` writes it
# (weights too, which the decode bench ignores). Needs a CUDA GPU, torch
# and transformers; run from a checkout (the package importable). Each part writes its results
# JSON and log under OUT:
#   decode  bench/rollout_throughput.py in bf16, 256 sequences x 64 new tokens, 128 slots: the
#           engine (dynamic and static decode, with and without weight updates) against
#           transformers' generate, eager and with a static cache and a compiled decode step;
#           the weight bytes read per second against a device-to-device copy's bandwidth; and
#           bench/decode_step.py: one replayed step alone, eager, dynamic, and with the host's look
#   sync    bench/weight_sync.py: publish + load of one version through /dev/shm, bf16 rollout
#   memory  bench/memory.py --device cuda: peak memory of a 2,048-token trainer step and of the
#           rollout worker at the Qwen2.5-0.5B and Qwen2.5-1.5B shapes, then the 1.5B steps with
#           activation checkpointing (docs/big-models.md's two commands)
set -uo pipefail
out=${1:?OUT folder}
model=${2:?MODEL_DIR}
shift 2
parts=${*:-decode sync memory}
for part in $parts; do  # checked before anything runs: inside the loop's pipe an exit ends only the pipe
  case $part in decode|sync|memory) ;; *) echo "unknown part: $part (decode | sync | memory)" >&2; exit 2 ;; esac
done
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$out/gpu.txt"
status=0
for part in $parts; do
  case $part in
    decode) python3 bench/decode_step.py --device cuda --dtype bfloat16 --model "$model" --random-weights \
              --out "$out/decode_step" &&
            python3 bench/rollout_throughput.py --device cuda --dtype bfloat16 --threads 1 \
              --sequences 256 --max-batch 128 --no-hf-cb --model "$model" --random-weights \
              --only engine,engine+updates,engine/static,engine/static+updates,engine/static/wait4,generate/b128,generate/b128/static \
              --out "$out/decode" ;;
    sync) python3 bench/weight_sync.py --device cuda --model "$model" --random-weights --out "$out/sync" ;;
    memory) python3 bench/memory.py --device cuda --threads 4 --shapes qwen2.5-0.5b,qwen2.5-1.5b --tokens 2048 \
              --gen-rows 32 --gen-prompt 512 --gen-new 256 --out "$out/memory" &&
            python3 bench/memory.py --device cuda --threads 4 --shapes qwen2.5-1.5b --tokens 2048 \
              --variants full,lora-bf16 --checkpointing --no-rollout --no-vocab-sweep --out "$out/memory-checkpointing" ;;
  esac 2>&1 | tee "$out/$part.log" || status=1
done
exit $status
