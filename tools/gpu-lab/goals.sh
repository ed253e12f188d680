#!/usr/bin/env bash
# Issue 5's ratio command on the GPU machine, before and after the PyTorch baseline on the
# same start (the issue asks for it beside any ratio reported), one line per run:
# ms per decode step at b1, b16 and b64 (with how many timed steps were replayed from a
# graph), b1's fraction of the copy bandwidth the run measured, and the 8k prefill;
# then PyTorch eager's 8k prefill and decode lines from its JSON.
#
#   bash tools/gpu-lab/goals.sh [DISAGG] [TORCH_BASELINE]
#   e.g. DISAGG_CACHE=/tmp/dc bash tools/gpu-lab/goals.sh .gpu/bin/disagg .gpu/torch_baseline.py
# (torch_baseline.py is ../shared/tools/vllm-peer/'s, copied into a carried folder; without
# it the ratio command runs once.)
set -euo pipefail
disagg=${1:-.gpu/bin/disagg}
torch_py=${2:-}
ratio=("$disagg" bench engine --device cuda:0 --model random:llama3-8b --json --kv-cache-mib 24000
  --max-num-seqs 64 --context 1024 --gen-tokens 32 --batch 1,16,64 --prompt-tokens 8192 --repeat 2)
here=$(dirname "$0")
line() { python3 "$here/bench_line.py" "$1"; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader || true
{ "${ratio[@]}" 2>/dev/null || true; } | line "ours (before PyTorch):"
if [ -n "$torch_py" ]; then
  # Eager only (TORCH_COMPILE_DISABLE), as the peer README's PyTorch figures; the script
  # ends by printing all its results as one JSON object.
  { TORCH_COMPILE_DISABLE=1 timeout 300 python3 "$torch_py" --quick 2>&1 || true; } | python3 -c '
import json, sys
txt = sys.stdin.read()
at = txt.rfind("\n{\n") + 1 if not txt.startswith("{\n") else 0
try:
    r = json.loads(txt[at:])
except ValueError:
    print("PyTorch: no JSON:", txt[-600:]); sys.exit(0)
p = r.get("prefill_8k", {})
print("PyTorch eager (%s): copy %s GB/s, bf16 GEMM %s TFLOP/s | prefill 8192: %s s, %s TFLOP/s, %s of the GEMM rate"
      % (r.get("gpu"), r.get("copy_GBps_rw"), r.get("gemm_bf16_TFLOPs"), p.get("eager_s"), p.get("TFLOPs"),
         p.get("frac_of_gemm")))
print("PyTorch eager decode:", " | ".join("%s %s ms" % (k[7:], v.get("eager_ms")) for k, v in r.items()
                                         if k.startswith("decode_b")))'
  { "${ratio[@]}" 2>/dev/null || true; } | line "ours (after PyTorch):"
fi
