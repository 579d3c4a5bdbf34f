#!/usr/bin/env bash
# The GPU check of docs/BENCHMARKS.md in one command, for a CUDA machine, finishing within 9 minutes:
#
#   bash tools/gpu_check.sh [OUT_DIR]              (default benchmark_out/gpu_check)
#   bash tools/gpu_check.sh OUT_DIR --dry-run      (CPU, tiny sizes: what the test suite runs)
#
# 1. the ROI benchmark table: ResNet-50 C4 at 512, 2,000 and 5,000 ROIs, wsod's strategies (plain /
#    paper / fused / auto) beside the stock ones (a checkpoint per chunk of ROIs, offloading, vmap), fp32
#    and bf16; torch.compile with an activation memory budget in a part of its own (it compiles per ROI
#    count); VGG16 at 256 and 4,096 ROIs; then the most ROIs within 16 GB (the allocator capped at 16 GB);
# 2. 50 training iterations of ResNet-50 C4 at full width from random weights (train-mode BatchNorm in
#    the base, GroupNorm in res5) on generated VOC-size images (500x375 at the VOC training scales,
#    2,000 proposals each), bf16, accumulation 2, chunk_size=auto: every loss must be finite (random
#    labels on random images teach nothing in 50 steps, so the trend is reported, not judged);
# 3. evaluation of that model with the 14-view test-time augmentation on 4 images;
# 4. OUT_DIR/report.md (with rois_*.csv / .png, rois_compile.csv, budget_16gb.csv, gpu_check.log): 8 files.
#
# Each part runs under `timeout` (its own limit, and never past the 9-minute deadline) and the report is
# rewritten after each part, so a part that fails or hangs loses only itself. The machine needs torch
# with CUDA and wsod's other dependencies: this repository runs from its folder (PYTHONPATH, no install);
# when hydra-core, omegaconf or pycocotools are missing and a `.whl/` folder of wheels is present (made
# by `bash tools/gpu_wheels.sh` on a machine with PyPI), they are installed from it into a private folder.
# Exit status: 0 when every part passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
out=benchmark_out/gpu_check
dry=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,/^# Exit status/p' "$0"; exit 0 ;;
        *) out=$arg ;;
    esac
done
python=${PYTHON:-python3}
total=${GPU_CHECK_SECONDS:-520}   # the whole check, under 9 minutes with the python start-ups around it
[ "$dry" = 1 ] && total=${GPU_CHECK_SECONDS:-1800}   # a loaded CPU must not time the dry run out
start=$(date +%s)
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
log="$out/gpu_check.log"
: > "$log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$python" -c "import hydra, omegaconf, pycocotools" 2>/dev/null; then
    if compgen -G ".whl/*.whl" > /dev/null; then
        echo "installing the missing dependencies from .whl/ into $work/site" | tee -a "$log"
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
            .whl/*.whl >> "$log" 2>&1
        export PYTHONPATH="$PYTHONPATH:$work/site"
    fi
    "$python" -c "import hydra, omegaconf, pycocotools" >> "$log" 2>&1 || {
        echo "error: hydra-core, omegaconf and pycocotools are needed: pip install -e . (or make .whl/ with" \
             "tools/gpu_wheels.sh)" | tee -a "$log"
        exit 1
    }
fi

if [ "$dry" = 1 ]; then
    device=cpu tiny=--tiny
    touch "$work/DRY_RUN"
    # one ROI count per model, tiny image, a 1 GB auto budget; the budget search stops at its first probe
    rois_r50=(--model r18_c4 --rois 8 --image-size 96,128 --strategies auto --auto-budget-gb 1 --dtypes fp32
              --steps 0)
    rois_vgg=()
    rois_compile=(--model r18_c4 --rois 8 --image-size 96,128 --strategies compile --dtypes fp32 --steps 1
                  --warmup 1)
    budget=(--model r18_c4 --rois 8 --image-size 96,128 --strategies auto --auto-budget-gb 1 --dtypes fp32
            --steps 0 --budget-gb 4 --budget-max-rois 8)
    limits=(env:120 rois_r50_c4:300 rois_compile:600 rois_vgg16:10 budget_16gb:300 data:120 train:300
            eval:300)
else
    device=cuda tiny=
    rois_r50=(--model r50_c4 --device cuda --image-size 600,1000 --rois 512,2000,5000
              --strategies plain,checkpoint,paper,fused,ckpt_chunk,offload,vmap_chunk,auto --chunk 256
              --dtypes fp32,bf16 --steps 2 --warmup 1)
    rois_compile=(--model r50_c4 --device cuda --image-size 600,1000 --rois 512,2000,5000 --strategies compile
                  --dtypes fp32,bf16 --steps 2 --warmup 1)
    rois_vgg=(--model vgg16 --device cuda --image-size 600,1000 --rois 256,4096
              --strategies plain,paper,fused,auto --chunk 256 --dtypes fp32,bf16 --steps 2 --warmup 1)
    budget=(--model r50_c4 --device cuda --image-size 600,1000 --rois 4096 --strategies plain,fused,ckpt_chunk
            --chunk 256 --dtypes fp32,bf16 --steps 1 --warmup 0 --budget-gb 16 --budget-max-rois 16384)
    # seconds per part (sum 520); each measurement builds its model on the CPU first (VGG16: 138M weights)
    limits=(env:20 rois_r50_c4:160 rois_compile:90 rois_vgg16:60 budget_16gb:70 data:15 train:70 eval:35)
fi
failed=0

limit_of() {  # the part's own limit, cut to what is left before the deadline
    local name=$1 entry own=60
    for entry in "${limits[@]}"; do [ "${entry%%:*}" = "$name" ] && own=${entry#*:}; done
    local left=$(( total - ($(date +%s) - start) ))
    [ "$left" -lt "$own" ] && own=$left
    echo "$own"
}

report() {
    timeout 30 "$python" -m wsod.benchmarks.gpu_check report --work "$work" --out "$out" >> "$log" 2>&1 || true
}

part() {  # part NAME COMMAND...: run under timeout, record name, status, seconds and limit
    local name=$1; shift
    local limit; limit=$(limit_of "$name")
    if [ "$limit" -le 5 ]; then
        printf '%s\t%s\t%s\t%s\n' "$name" 124 0 "$limit" >> "$work/parts.tsv"
        echo "== $name: no time left before the deadline" | tee -a "$log"
        failed=1; report; return
    fi
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    local t0; t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >> "$work/parts.tsv"
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$log"
    [ "$rc" = 0 ] || failed=1
    report
}

skip() {
    printf '%s\t%s\t%s\t%s\n' "$1" skipped 0 0 >> "$work/parts.tsv"
    echo "== $1: skipped ($2)" | tee -a "$log"
}

part env "$python" -m wsod.benchmarks.gpu_check env --work "$work" --device "$device"
part rois_r50_c4 "$python" tools/benchmark_rois.py "${rois_r50[@]}" --out "$work/rois_r50_c4"
part rois_compile "$python" tools/benchmark_rois.py "${rois_compile[@]}" --out "$work/rois_compile"
if [ ${#rois_vgg[@]} -gt 0 ]; then
    part rois_vgg16 "$python" tools/benchmark_rois.py "${rois_vgg[@]}" --out "$work/rois_vgg16"
else
    skip rois_vgg16 "dry run: a full-width VGG16 is too large for the CPU test"
fi
part budget_16gb "$python" tools/benchmark_rois.py "${budget[@]}" --out "$work/budget_16gb"
part data "$python" -m wsod.benchmarks.gpu_check data --work "$work" $tiny
part train "$python" -m wsod.benchmarks.gpu_check train --work "$work" --device "$device" $tiny
part eval "$python" -m wsod.benchmarks.gpu_check eval --work "$work" --device "$device" $tiny
report
echo "report: $out/report.md ($(( $(date +%s) - start )) s in all; work files in $work)" | tee -a "$log"
exit $failed
