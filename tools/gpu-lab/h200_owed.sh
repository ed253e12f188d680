#!/usr/bin/env bash
# The runs issue 5 still owes on an H200 (docs/PERF.md, seventy-fourth and seventy-fifth
# sessions), as two device calls that each fit the 600 s limit. Both carry `.gpu`, staged here
# first (it is git-ignored, so a fresh checkout has none):
#   bash tools/gpu-lab/stage.sh --no-model && cp ../shared/tools/vllm-peer/torch_baseline.py .gpu/
#
#   bash tools/gpu-lab/h200_owed.sh 1   # the ratio command beside PyTorch eager (goals.sh), then
#                                       # DISAGG_CUDA_SPLITK_NORM=9 against the default at b32-b128
#   bash tools/gpu-lab/h200_owed.sh 2   # the cluster floor at 5 against the default, b12-b16 at
#                                       # 1k and 4k keys (split_ab.sh, two rounds, orders alternated)
#
# It stops at once on any other card (the H100's figures for both are in PERF.md already);
# H200_OWED_ANY_CARD=1 runs it anyway. END (default 575) is the second, in this script's run,
# at which part 1's A/B is cut (part 2's 15 s sooner), so that what it printed comes back
# within the call's limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
part=${1:-}
gpu=${GPU_DIR:-.gpu}
end=${END:-575}
case "$part" in
  1 | 2) ;;
  *) echo "which part? bash tools/gpu-lab/h200_owed.sh 1|2" >&2; exit 2 ;;
esac
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
if [[ "$card" != *H200* && -z "${H200_OWED_ANY_CARD:-}" ]]; then
  echo "not an H200 (${card:-no nvidia-smi}); set H200_OWED_ANY_CARD=1 to run anyway" >&2
  exit 3
fi
[ -x "$gpu/bin/disagg" ] || { echo "no $gpu/bin/disagg: stage it here and carry it (see the head of this script)" >&2; exit 1; }
echo "$gpu built from $(cat "$gpu/BUILT_FROM" 2>/dev/null || echo '?')"
export DISAGG_CACHE=${DISAGG_CACHE:-/tmp/dc}
start=$SECONDS
if [ "$part" = 1 ]; then
  goals=("$gpu/bin/disagg")
  if [ -f "$gpu/torch_baseline.py" ]; then
    goals+=("$gpu/torch_baseline.py")
  else
    echo "no $gpu/torch_baseline.py: the ratio command runs once, without PyTorch" >&2
  fi
  timeout 370 bash tools/gpu-lab/goals.sh "${goals[@]}" || echo "goals.sh: rc $?"
  left=$((end - (SECONDS - start)))
  if [ "$left" -gt 30 ]; then
    SPLIT_AB_B=DISAGG_CUDA_SPLITK_NORM=9 timeout "$left" \
      bash tools/gpu-lab/split_ab.sh "$gpu/bin/disagg" 32,64,128 1024 2 || echo "split_ab.sh: rc $? (cut at ${left} s)"
  else
    echo "no time left for the SPLITK_NORM=9 A/B (${left} s)"
  fi
else
  SPLIT_AB_B=DISAGG_CUDA_ATTN_CLUSTER_FROM=5 timeout $((end - 15)) \
    bash tools/gpu-lab/split_ab.sh "$gpu/bin/disagg" 12,13,14,15,16 1024,4096 2 || echo "split_ab.sh: rc $?"
fi
echo "part $part: $((SECONDS - start)) s"
