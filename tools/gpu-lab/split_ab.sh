#!/usr/bin/env bash
# The decode attention's split rule against every launch unsplit, alternated in one start
# (the default first in odd rounds, the other side first in even ones):
# for each context, `disagg bench engine` at the default split choice, then with
# DISAGG_CUDA_ATTN_CHUNK above the context (so every attention launch stays unsplit), ROUNDS
# times, printing ms per step for each batch (and how many timed steps were replayed).
# Where the two differ, the default's splits or the lone rule (`attn_splits`,
# kernels/src/cuda/backend.rs) chose wrong for that batch; docs/PERF.md, sixtieth session.
#
#   bash tools/gpu-lab/split_ab.sh [DISAGG] [BATCHES] [CONTEXTS] [ROUNDS]
#   SPLIT_AB_B=VAR=VALUE: the B side sets that variable instead (e.g. DISAGG_CUDA_ATTN_LONE=0,
#   the split rule without its lone-block test, against the default)
#   e.g. DISAGG_CACHE=/tmp/dc bash tools/gpu-lab/split_ab.sh .gpu/bin/disagg 9,10,11,12,13,14,15,16 1024,4096 2
set -euo pipefail
disagg=${1:-.gpu/bin/disagg}
batches=${2:-9,10,11,12,13,14,15,16}
contexts=${3:-1024}
rounds=${4:-2}
max=$(tr ',' '\n' <<<"$batches" | sort -n | tail -1)
here=$(dirname "$0")
line() { python3 "$here/bench_line.py" "$1" --decode-only; }
nvidia-smi --query-gpu=name --format=csv,noheader || true
for ctx in ${contexts//,/ }; do
  # The KV pool: every sequence's context and prompt, with room to spare.
  mib=$(((max * (ctx + 600) * 128 / 1024) + 4096))
  bench=("$disagg" bench engine --device cuda:0 --model random:llama3-8b --json --kv-cache-mib "$mib"
    --context "$ctx" --prompt-tokens 512 --repeat 1 --max-num-seqs "$max" --batch "$batches" --gen-tokens 32)
  b=${SPLIT_AB_B:-DISAGG_CUDA_ATTN_CHUNK=$((2 * ctx + 1024))}
  side_a() { { "${bench[@]}" 2>/dev/null || true; } | line "ctx $ctx default "; }
  side_b() { { env "$b" "${bench[@]}" 2>/dev/null || true; } | line "ctx $ctx ${SPLIT_AB_B:-unsplit} "; }
  for r in $(seq "$rounds"); do
    # (A failed run prints its line and the A/B goes on.) Odd rounds run the default
    # first, even rounds the other side first: on an H100 two sides making the same
    # choices differed by 1.0-1.8% at 4k keys, the same sign in both rounds of A-then-B
    # (docs/PERF.md, sixty-sixth session), so a lone order is not to be trusted.
    if ((r % 2)); then side_a; side_b; else side_b; side_a; fi
  done
done
