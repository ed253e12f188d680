#!/usr/bin/env bash
# nvcc on a machine without CUDA: builds a gpu-lab program here, so that a device call
# carries the binary instead of spending ~40 s of device time compiling it there. Fetches
# CUDA 13.5's nvcc, cicc (nvvm), the crt headers and the runtime from PyPI once (about
# 320 MB unpacked) into $DISAGG_CACHE/cuda-nvcc (default ~/.cache/disagg/cuda-nvcc).
# A program built so (cudart static: attnlab) ran on the GPU machine's CUDA 13.0 driver
# (docs/PERF.md, fifty-first session). There is no libcuda here, so programs that link the
# driver API (-lcuda: chainlab) still build on the GPU machine.
#   bash tools/gpu-lab/nvcc.sh -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/attnlab.cu -o .gpu3/attnlab
set -euo pipefail
d="${DISAGG_CACHE:-$HOME/.cache/disagg}/cuda-nvcc"
if [ ! -e "$d/.complete" ]; then
  mkdir -p "$d"
  python3 -m pip download --no-deps -q -d "$d" nvidia-cuda-nvcc==13.5.37 nvidia-nvvm==13.5.37 \
    nvidia-cuda-crt==13.5.37 nvidia-cuda-runtime==13.5.37
  for w in "$d"/*.whl; do python3 -m zipfile -e "$w" "$d"; rm "$w"; done
  chmod +x "$d"/nvidia/cu13/bin/* "$d"/nvidia/cu13/nvvm/bin/*
  touch "$d/.complete"
fi
c="$d/nvidia/cu13"
# (nvcc warns that offline compilation for pre-sm_75 targets is going away; not ours.)
exec "$c/bin/nvcc" -I"$c/include" -L"$c/lib" "$@"
