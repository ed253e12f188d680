#!/usr/bin/env bash
# Builds tools/gpu-lab/kernel_trace.c on the GPU machine into $1 (default /tmp/libktrace.so):
# finds CUPTI's header and library (the CUDA toolkit's extras, or the pip wheel PyTorch
# brought) and the newest kernel and copy records the header defines.
set -euo pipefail
cd "$(dirname "$0")/../.."
dst=${1:-/tmp/libktrace.so}
hdr=$(find /usr/local/cuda*/ /usr/local/lib/python3*/ /usr/lib/python3*/ /opt -name cupti_activity.h 2>/dev/null | head -1 || true)
[ -n "$hdr" ] || { echo "no cupti_activity.h on this machine" >&2; exit 1; }
inc=$(dirname "$hdr")
lib=$(find "$(dirname "$inc")" /usr/local/cuda*/ /usr/local/lib/python3*/ /usr/lib/python3*/ -name 'libcupti.so*' 2>/dev/null | head -1 || true)
[ -n "$lib" ] || { echo "no libcupti.so on this machine" >&2; exit 1; }
krec=$(grep -oh 'CUpti_ActivityKernel[0-9]\+' "$inc"/cupti_activity*.h | sort -V | tail -1)
mrec=$(grep -oh 'CUpti_ActivityMemcpy[0-9]\+' "$inc"/cupti_activity*.h | sort -V | tail -1 || true)
cuda_inc=$(dirname "$(find /usr/local/cuda*/ -name cuda.h -path '*include*' 2>/dev/null | head -1)")
echo "kernel_trace: $hdr, $lib, $krec, ${mrec:-no memcpy record}" >&2
build() {
  gcc -O2 -shared -fPIC -DKREC="$krec" "$@" -I"$inc" -I"$cuda_inc" tools/gpu-lab/kernel_trace.c \
    "$lib" -Wl,-rpath,"$(dirname "$lib")" -o "$dst"
}
# (Kernels alone where the copy record does not build: e.g. a header without its graph ids.)
if [ -n "$mrec" ]; then
  build -DMREC="$mrec" || { echo "kernel_trace: $mrec did not build; kernels only" >&2; build; }
else
  build
fi
