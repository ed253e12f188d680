# Every kernel of one engine step, timed by Nsight Compute (docs/PERF.md, ninth session:
# "Where the 8k prefill step goes"). nsys is not on the GPU machine; ncu is. On the GPU
# machine, with the release binary at $D:
#   DISAGG_CUDA_GRAPHS=0 ncu --metrics gpu__time_duration.sum --cache-control none \
#     --clock-control none --launch-count 2700 --csv --page raw --print-units base \
#     --log-file step.csv $D bench engine --device cuda:0 --model random:llama3-8b --json \
#     --kv-cache-mib 24000 --max-num-seqs 64 --context 64 --gen-tokens 2 --batch 1 \
#     --prompt-tokens 8192 --repeat 1
#   python3 tools/gpu-lab/ncu_step.py step.csv
# A decode step instead (twenty-first session, batch 64): all 64 sequences prefilled in
# one step so that every later step decodes all of them, then --last takes the last
# complete step (from one embedding kernel to the next):
#   DISAGG_CUDA_GRAPHS=0 ncu … --launch-count 20000 … --log-file b64.csv $D bench engine
#     --device cuda:0 --model random:llama3-8b --json --kv-cache-mib 24000
#     --max-num-seqs 64 --max-batched-tokens 65600 --context 1024 --gen-tokens 6
#     --batch 64 --prompt-tokens 64 --repeat 1
#   python3 tools/gpu-lab/ncu_step.py b64.csv --last
# The bench's warm-up (a 64-token prompt, 8 tokens) comes first; the step reported is the
# one holding the first kernel longer than --min-us (the 8k prefill), from its
# embedding kernel to the next. Kernels are timed one at a time (ncu serializes them),
# so their sum leaves out launch gaps and the host's share of the step.
# A chunked prefill (`--prefill-chunk 16384` on a 32k prompt: two steps): --steps 2
# sums the marked step and the next. A peer's profile (vllm_prefill.py, whose profiled
# range holds only the timed prompt): --all sums every kernel in the file. --classes
# also sums by kind (GEMM, attention, norm, ...), which names the same work in both.
import argparse, collections, csv, re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--min-us", type=float, default=300.0, help="a kernel this long marks the step")
ap.add_argument("--last", action="store_true", help="the last complete step, not the one marked by --min-us")
ap.add_argument("--steps", type=int, default=1, help="this many steps from the marked one")
ap.add_argument("--all", action="store_true", help="every kernel in the file (a peer's profiled range)")
ap.add_argument("--classes", action="store_true", help="also sum by kind of kernel")
a = ap.parse_args()
if a.steps < 1:
    ap.error("--steps must be at least 1")
if a.steps > 1 and (a.all or a.last):
    ap.error("--steps counts from the marked step: not with --all or --last")
rows = list(csv.reader(l for l in open(a.csv) if l.startswith('"')))
head = rows[0]
name, dur = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
ks = [(r[name], float(r[dur].replace(",", "")) / 1e3) for r in rows[1:] if r[dur][:1].isdigit()]  # µs
if a.all:
    start, end = 0, len(ks)
elif a.last:
    starts = [i for i, (n, _) in enumerate(ks) if n.startswith("embed")]
    start, end = starts[-2], starts[-1]
else:
    big = next(i for i, (_, us) in enumerate(ks) if us > a.min_us)
    start = max(i for i in range(big + 1) if ks[i][0].startswith("embed"))
    later = [i for i in range(big + 1, len(ks)) if ks[i][0].startswith("embed")]
    end = later[a.steps - 1] if len(later) >= a.steps else len(ks)
step = ks[start:end]
agg = collections.defaultdict(lambda: [0.0, 0])
for n, us in step:
    agg[n][0] += us
    agg[n][1] += 1
total = sum(us for _, us in step)
print(f"{len(step)} kernels, {total / 1e3:.2f} ms")
for n, (us, c) in sorted(agg.items(), key=lambda x: -x[1][0]):
    print(f"{us / 1e3:9.2f} ms {100 * us / total:5.1f}% {c:5d} x {us / c:9.1f} us  {n[:70]}")
if a.classes:
    # First match wins: attention, then RoPE (ours writes the KV too), GEMMs by the names
    # cuBLAS(Lt), CUTLASS and Triton give them.
    kinds = [
        ("attention", r"flash|fmha|attn|attention"),
        ("rope (+ KV write)", r"rope|rotary"),
        ("kv write/copy", r"reshape_and_cache|kv_|_kv|cache"),
        ("norm", r"norm"),
        ("activation", r"silu|gelu|act_and_mul|swiglu"),
        ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|sm90|splitK|Kernel2"),
        ("triton fused", r"triton"),
        ("embedding/sampling", r"embed|argmax|sample|softmax|logit|index"),
    ]
    by = collections.defaultdict(lambda: [0.0, 0])
    for n, us in step:
        k = next((k for k, rx in kinds if re.search(rx, n, re.I)), "other")
        by[k][0] += us
        by[k][1] += 1
    print("by kind:")
    for k, (us, c) in sorted(by.items(), key=lambda x: -x[1][0]):
        print(f"{us / 1e3:9.2f} ms {100 * us / total:5.1f}% {c:5d} x  {k}")
