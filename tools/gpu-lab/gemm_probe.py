# GEMM and attention probe (docs/PERF.md, eighth session): the prefill's four GEMM shapes
# at 8,192 tokens through cublasGemmEx as the CUDA backend calls it (bf16 A/B, f32
# compute, C in f32 or bf16) and through torch.matmul, then PyTorch SDPA (causal, GQA
# 32/8, head_dim 128) at 8k and 32k: the peer's attention. Not part of the build; on the
# GPU machine:  python3 tools/gpu-lab/gemm_probe.py
import ctypes, torch, torch.nn.functional as F
import glob
lib = None
for n in ["libcublas.so.13", "libcublas.so.12", "libcublas.so"] + glob.glob("/usr/local/cuda*/lib64/libcublas.so*"):
    try:
        lib = ctypes.CDLL(n); print("cublas:", n); break
    except OSError: pass
h = ctypes.c_void_p(); assert lib.cublasCreate_v2(ctypes.byref(h)) == 0
ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(ws.numel()))
lib.cublasSetStream_v2(h, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
R_32F, R_16BF, COMPUTE_32F, OP_N, OP_T = 0, 14, 68, 0, 1
def t(fn, it=20):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(it): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / it * 1e-3
tot = {}
T = 8192
for (rows, cols) in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
    W = torch.randn(rows, cols, device="cuda").to(torch.bfloat16) * 0.02
    X = torch.randn(T, cols, device="cuda").to(torch.bfloat16)
    fl = 2 * T * rows * cols
    for cname, ctype, cdt in [("f32", R_32F, torch.float32), ("bf16", R_16BF, torch.bfloat16)]:
        C = torch.empty(T, rows, device="cuda", dtype=cdt)
        al, be = ctypes.c_float(1.0), ctypes.c_float(0.0)
        def g():
            r = lib.cublasGemmEx(h, OP_T, OP_N, rows, T, cols, ctypes.byref(al), ctypes.c_void_p(W.data_ptr()), R_16BF, cols,
                                 ctypes.c_void_p(X.data_ptr()), R_16BF, cols, ctypes.byref(be), ctypes.c_void_p(C.data_ptr()), ctype, rows, COMPUTE_32F, -1)
            assert r == 0, r
        s = t(g); tot[cname] = tot.get(cname, 0) + s
        print(f"gemmex {rows}x{cols} T={T} C={cname}: {s*1e3:.3f} ms {fl/s/1e12:.0f} TFLOP/s")
    s = t(lambda: torch.matmul(X, W.t())); tot["torch"] = tot.get("torch", 0) + s
    print(f"torch.matmul {rows}x{cols}: {s*1e3:.3f} ms {fl/s/1e12:.0f} TFLOP/s")
print({k: round(v * 32, 4) for k, v in tot.items()}, "s per 32 layers")
for S in (8192, 32768):
    q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
    fl = 4 * 32 * S * S * 128 / 2
    for name, kk, vv, extra in [("gqa", k, v, {"enable_gqa": True}), ("expanded", k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), {})]:
        try:
            s = t(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **extra), 5)
            print(f"sdpa causal {name} S={S}: {s*1e3:.3f} ms {fl/s/1e12:.0f} TFLOP/s, x32 layers {s*32:.4f} s")
        except Exception as e:
            print("sdpa", name, e)
