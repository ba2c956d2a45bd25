#!/usr/bin/env bash
# Time to 0.70 held-out pass, full fine-tuning against LoRA rank 8, areal mode, seeds 0-2.
# The two arms alternate seed by seed, so a drift of the machine's load falls on both.
#
#     bash bench/lora_threshold.sh [OUT]        # default bench/out/lora-threshold; ~40 min on 2 cores
#
# Each arm is bench/time_to_threshold.py's grid (it resumes: finished cells are reused);
# OUT/full/results.json and OUT/lora8/results.json hold the per-seed summaries.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out/lora-threshold}"
LORA_LR="${LORA_LR:-1e-4}"   # the full run's trainer.lr is 1e-5; LoRA's usual is about 10x
for seed in 0 1 2; do
    python bench/time_to_threshold.py --modes areal --seeds "$seed" --threshold 0.70 --max-wall-s 600 \
        --out "$OUT/full"
    python bench/time_to_threshold.py --modes areal --seeds "$seed" --threshold 0.70 --max-wall-s 600 \
        --set lora.rank=8 --set trainer.lr="$LORA_LR" --out "$OUT/lora8"
done
