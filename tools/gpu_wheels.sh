#!/usr/bin/env bash
# Wheels of the dependencies that a CUDA machine without internet may lack, for tools/gpu_check.sh:
#
#   bash tools/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12) -> .whl/ (git-ignored)
#
# Run it where PyPI is reachable; copy or carry .whl/ to the GPU machine next to the repository, and
# tools/gpu_check.sh installs whatever of hydra-core, omegaconf (and its antlr4 runtime) and pycocotools
# is missing there into a private folder. torch, numpy, opencv, tensorboard, tqdm, matplotlib and scipy
# are expected on that machine already. antlr4-python3-runtime 4.9.3 (omegaconf's pin) is published as
# source only, so its pure-Python wheel is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    "hydra-core==1.3.*" "omegaconf==2.3.*" "pycocotools>=2.0.8"
python3 -m pip wheel --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
ls -l .whl
