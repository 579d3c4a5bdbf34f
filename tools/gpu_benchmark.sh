#!/usr/bin/env bash
# The GPU table of docs/BENCHMARKS.md in one command, ready for the moment a GPU is at hand:
#
#   bash tools/gpu_benchmark.sh [OUT_DIR]        (default benchmark_out/gpu)
#
# ResNet-50 C4, one 600x1000 image, every back-propagation strategy at fp32 and bf16 autocast, then the
# largest ROI count that fits 16 GB per strategy (the allocator capped at 16 GB: a real out-of-memory).
# Sized to finish in well under 8 minutes on one recent data-centre GPU. Writes results.csv,
# results.md and memory_time.png into OUT_DIR and prints the table.
set -euo pipefail
out=${1:-benchmark_out/gpu}
cd "$(dirname "$0")/.."
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
python tools/benchmark_rois.py --model r50_c4 --device cuda --image-size 600,1000 \
    --rois 256,512,1024,2048,4096 --strategies plain,checkpoint,paper,fused --chunk 256,512 \
    --dtypes fp32,bf16 --steps 5 --warmup 2 --budget-gb 16 --budget-max-rois 65536 --out "$out"
