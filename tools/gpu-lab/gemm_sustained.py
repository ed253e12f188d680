# The 8k prefill's GEMMs alone, as PyTorch runs them (bf16, cuBLAS), back to back for
# the 32 layers of the Llama-3.1-8B shape, against the same GEMMs timed one at a time
# after an idle pause: what the card sustains at its power cap (docs/PERF.md,
# thirty-first session). Run on the GPU machine: python3 gemm_sustained.py
import json, time, torch

dev, dt, M, L = "cuda", torch.bfloat16, 8192, 32
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
x = {k: torch.randn(M, kin, dtype=dt, device=dev) for k, (kin, _) in shapes.items()}
w = {k: torch.randn(kout, kin, dtype=dt, device=dev) * 0.01 for k, (kin, kout) in shapes.items()}
flops = sum(2 * M * kin * kout for kin, kout in shapes.values()) * L


def layers():
    for _ in range(L):
        for k in shapes:
            torch.matmul(x[k], w[k].t())


ev = lambda: torch.cuda.Event(enable_timing=True)
layers()
torch.cuda.synchronize()
res = {"gemm_flops_per_prefill": flops}
# Sustained: ten prefills' worth back to back; the last five timed.
for _ in range(5):
    layers()
s, e = ev(), ev()
s.record()
for _ in range(5):
    layers()
e.record()
torch.cuda.synchronize()
t = s.elapsed_time(e) / 5 / 1e3
res["sustained_s_per_prefill"] = round(t, 4)
res["sustained_tflops"] = round(flops / t / 1e12, 1)
# One at a time: each shape once after a 0.5 s pause, times 32.
iso = 0.0
for k in shapes:
    time.sleep(0.5)
    s, e = ev(), ev()
    s.record()
    torch.matmul(x[k], w[k].t())
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e)
    res[f"isolated_ms_{k}"] = round(ms, 4)
    iso += ms * L / 1e3
res["isolated_s_per_prefill"] = round(iso, 4)
res["isolated_tflops"] = round(flops / iso / 1e12, 1)
print(json.dumps(res, indent=1))
