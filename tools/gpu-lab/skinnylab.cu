// Skinny GEMM lab (docs/PERF.md, twelfth session): y[M][N] (+)= x[M][K] · W[N][K]ᵀ for
// decode steps of 2–64 tokens, the engine's `skinny_bf16_t*_s*` kernels (ops.cu) beside
// cuBLAS' bf16 GEMM called as the backend calls it, on the Llama-3-8B shapes, with 4 GiB
// of weights cycled (L2 cold), and checks both against each other (plain and accumulating).
// Launched back to back without a CUDA graph, so cuBLAS' host time per call weighs on
// the small shapes here (SmolLM2's), which in the engine's graphs it does not. Not part of
// the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/skinnylab.cu -lcublas -o skinnylab && ./skinnylab
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#include "../../kernels/src/cuda/ops.cu"

// The engine instantiates one n8 tile (2–8 tokens); the lab adds 2, 4 and 8 (16–64).
SK_KERNELS(2)
SK_KERNELS(4)
SK_KERNELS(8)
typedef void (*SkFn)(SK_ARGS);
static SkFn sk_fn(int nt, int s) {
#define F(NT) \
    if (nt == NT) return s == 1 ? skinny_bf16_t##NT##_s1 : s == 2 ? skinny_bf16_t##NT##_s2 : s == 4 ? skinny_bf16_t##NT##_s4 : skinny_bf16_t##NT##_s8;
    F(1) F(2) F(4) F(8)
#undef F
    return nullptr;
}
static int nt_of(int m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }
static int smem_of(int nt) { return nt == 1 ? SK_SMEM_BYTES(1, SK_WARPS) : nt == 2 ? SK_SMEM_BYTES(2, SK_WARPS) : nt == 4 ? SK_SMEM_BYTES(4, SK_WARPS) : SK_SMEM_BYTES(8, SK_WARPS); }

static void bf16_fill(std::vector<unsigned short>& h, unsigned s, float scale) {
    for (auto& v : h) { s = s * 1664525u + 1013904223u; float f = (((s >> 8) / 16777216.f) * 2 - 1) * scale; unsigned u; memcpy(&u, &f, 4); v = u >> 16; }
}

int main(int argc, char** argv) {
    const size_t pool_bytes = 4ull << 30;
    unsigned short* pool; CK(cudaMalloc(&pool, pool_bytes));
    { std::vector<unsigned short> h(pool_bytes / 2); bf16_fill(h, 1, 0.05f); CK(cudaMemcpy(pool, h.data(), pool_bytes, cudaMemcpyHostToDevice)); }
    unsigned short* x; CK(cudaMalloc(&x, 64 * 14336 * 2));
    { std::vector<unsigned short> h(64 * 14336); bf16_fill(h, 7, 1.f); CK(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice)); }
    const size_t ymax = 64ull * 128256;
    float *y, *yref, *y0; CK(cudaMalloc(&y, ymax * 4)); CK(cudaMalloc(&yref, ymax * 4)); CK(cudaMalloc(&y0, ymax * 4));
    { std::vector<float> h(ymax); for (size_t i = 0; i < ymax; i++) h[i] = ((i * 37) % 101) / 50.f - 1; CK(cudaMemcpy(y0, h.data(), ymax * 4, cudaMemcpyHostToDevice)); }
    for (int nt : {1, 2, 4, 8}) for (int s : {1, 2, 4, 8}) CK(cudaFuncSetAttribute(sk_fn(nt, s), cudaFuncAttributeMaxDynamicSharedMemorySize, smem_of(nt)));
    cublasHandle_t blas; cublasCreate(&blas);
    void* ws; CK(cudaMalloc(&ws, 32 << 20)); cublasSetWorkspace(blas, ws, 32 << 20);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    struct Shape { const char* name; int n, k; };
    std::vector<Shape> shapes = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gateup", 28672, 4096}, {"down", 4096, 14336}, {"lm_head", 128256, 4096}, {"smol 576x576", 576, 576}, {"smol 3072x576", 3072, 576}};
    std::vector<int> ms = {2, 8, 16, 32, 64};
    if (argc > 1) { ms.clear(); for (int i = 1; i < argc; i++) ms.push_back(atoi(argv[i])); }
    const int ITER = 40;
    for (int m : ms) {
        printf("M = %d\n", m);
        double tot_blas = 0, tot_best = 0;
        for (auto& sh : shapes) {
            const size_t wbytes = (size_t)sh.n * sh.k * 2;
            const int copies = std::max<size_t>(1, pool_bytes / wbytes);
            const int n = sh.n, k = sh.k, nt = nt_of(m);
            auto blas_run = [&](const unsigned short* w, float* out, float beta) {
                const float alpha = 1.f;
                cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, out, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            };
            auto sk_run = [&](int s, const unsigned short* w, float* out, int acc) {
                sk_fn(nt, s)<<<dim3((n + 32 * SK_WARPS - 1) / (32 * SK_WARPS), s), 32 * SK_WARPS, smem_of(nt)>>>(w, x, m, n, k, out, acc);
            };
            auto time = [&](auto f) {
                f(pool); CK(cudaDeviceSynchronize());
                CK(cudaEventRecord(e0));
                for (int i = 0; i < ITER; i++) f(pool + (size_t)(i % copies) * (wbytes / 2));
                CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                float ms_; cudaEventElapsedTime(&ms_, e0, e1); return ms_ * 1e3 / ITER;
            };
            // exactness, plain and accumulating, against cuBLAS
            auto check = [&](int s, int acc) {
                CK(cudaMemcpy(yref, y0, (size_t)m * n * 4, cudaMemcpyDeviceToDevice));
                CK(cudaMemcpy(y, y0, (size_t)m * n * 4, cudaMemcpyDeviceToDevice));
                blas_run(pool, yref, acc ? 1.f : 0.f); sk_run(s, pool, y, acc); CK(cudaDeviceSynchronize());
                std::vector<float> a((size_t)m * n), b((size_t)m * n);
                CK(cudaMemcpy(a.data(), y, a.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), yref, b.size() * 4, cudaMemcpyDeviceToHost));
                double md = 0, mr = 0; for (size_t i = 0; i < a.size(); i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mr = std::max(mr, (double)fabsf(b[i])); }
                return md / mr;
            };
            const float tb = time([&](const unsigned short* w) { blas_run(w, y, 0.f); });
            printf("  %-14s %6.1f MB cublas %8.2f us %6.0f GB/s |", sh.name, wbytes / 1e6, tb, wbytes / tb / 1e3);
            float best = 1e30; int bs = 0;
            for (int s : {1, 2, 4, 8}) {
                if (s > k / SK_SLAB) continue;
                const double e = std::max(check(s, 0), check(s, 1));
                const float ts = time([&](const unsigned short* w) { sk_run(s, w, y, 0); });
                printf(" s%d %6.2f %4.0f%s", s, ts, wbytes / ts / 1e3, e > 1e-3 ? " BAD" : "");
                if (e > 1e-3) printf("(%.2e)", e);
                if (ts < best) best = ts, bs = s;
            }
            printf(" | best s%d %.2fx\n", bs, tb / best);
            if (sh.n >= 4096) { tot_blas += tb * (sh.n == 128256 ? 1 : 32); tot_best += best * (sh.n == 128256 ? 1 : 32); }
        }
        printf("  per step (32 layers + lm_head): cublas %.0f us, skinny best %.0f us\n", tot_blas, tot_best);
    }
}
