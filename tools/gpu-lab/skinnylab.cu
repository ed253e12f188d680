// Skinny GEMM lab (docs/PERF.md, twelfth and thirteenth sessions): y[M][N] (+)= x[M][K] · W[N][K]ᵀ
// for decode steps of 2–64 tokens: the engine's `skinny_bf16_t*_s*` kernels (ops.cu,
// mma.sync), the warpgroup form below (wgmma, lab only until measured), and cuBLAS' bf16
// GEMM called as the backend calls it, on the Llama-3-8B and SmolLM2 shapes, with 4 GiB of
// weights cycled (L2 cold); checks each kernel against cuBLAS (plain and accumulating).
// Each timed loop is one CUDA graph of ITER launches, as the engine replays its decode
// steps: the twelfth session's lab launched back to back, which charged cuBLAS its host
// time per call on the small shapes. Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/skinnylab.cu -lcublas -o skinnylab && ./skinnylab [M ...]
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
#include "graph_time.h"

// wgmma m64nNk16, bf16, A (16 rows of W per warp) from registers, B (the tokens, K-major,
// 128-byte swizzle) from shared memory by descriptor; D += A·B.
__device__ __forceinline__ void wgmma_bf16_rs_n8(float* d, const unsigned* a, unsigned long long b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#else
    __trap();
#endif
}
__device__ __forceinline__ void wgmma_bf16_rs_n16(float* d, const unsigned* a, unsigned long long b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#else
    __trap();
#endif
}
__device__ __forceinline__ void wgmma_bf16_rs_n32(float* d, const unsigned* a, unsigned long long b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#else
    __trap();
#endif
}
__device__ __forceinline__ void wgmma_bf16_rs_n64(float* d, const unsigned* a, unsigned long long b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#else
    __trap();
#endif
}

// ---- The warpgroup form (measured: it loses to cuBLAS, docs/PERF.md): wgmma for 8–64 tokens ----
// One warpgroup (4 warps) per block of 128 rows of W over one of S key splits, the same
// cp.async ring and swizzle as skinny_impl (stages of W's 128 rows and the N token rows,
// each row 128 bytes, 1024-byte aligned: the 128-byte-swizzled K-major layout wgmma
// reads). Per 64-column slab each warp loads its 16 rows of both 64-row halves by
// ldmatrix (the A fragments: W rows are the MMA's M), and the warpgroup issues
// m64nNk16 wgmmas with the tokens as N read from shared memory by descriptor — one
// instruction per 64 rows and 16 columns for all N tokens, where mma.sync needs N/8.
// Staging and the [token][row] reduction are ops.cu's skinny_stage and skinny_reduce.
#define SKW_STAGES 4
#define SKW_SMEM_BYTES(N) \
    ((SKW_STAGES * (128 + (N)) * 128) > ((N) * (128 + 4) * 4) ? (SKW_STAGES * (128 + (N)) * 128) : ((N) * (128 + 4) * 4))

template <int N>
__device__ __forceinline__ void wgmma_bf16_rs(float* d, const unsigned* a, unsigned long long b) {
    if constexpr (N == 8) wgmma_bf16_rs_n8(d, a, b);
    else if constexpr (N == 16) wgmma_bf16_rs_n16(d, a, b);
    else if constexpr (N == 32) wgmma_bf16_rs_n32(d, a, b);
    else wgmma_bf16_rs_n64(d, a, b);
}

template <int N, int S>
__device__ void skinny_wg_impl(const unsigned short* __restrict__ w, const unsigned short* __restrict__ x, int m_tokens,
                               int n, int k, float* __restrict__ y, int accumulate) {
    extern __shared__ __align__(1024) unsigned char skw_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int ROWS = 128, THREADS = 128, RSTRIDE = ROWS + 4;
    const int row0 = blockIdx.x * ROWS;
    const int split = blockIdx.y;
    const int slabs = k / SK_SLAB;
    const int per = (slabs + S - 1) / S;
    const int s0 = min(split * per, slabs), s1 = min(s0 + per, slabs);
    const int ns = s1 - s0;
    constexpr int STAGE = (ROWS + N) * 128;
    const unsigned base = smem_u32(skw_smem);
    auto stage = [&](int j) { skinny_stage<ROWS, N, THREADS, SKW_STAGES>(base, j, ns, s0, w, x, row0, n, k, m_tokens); };
#pragma unroll
    for (int j = 0; j < SKW_STAGES - 1; j++) stage(j);
    float acc[2][N / 2];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int e = 0; e < N / 2; e++) acc[mt][e] = 0.f;
    // ldmatrix rows of the A fragments: half mt's rows mt·64 + warp·16 + (lane & 15),
    // chunk 2s + (lane >> 4) for k-step s.
    const int ar = warp * 16 + (lane & 15), ac = lane >> 4;
    for (int j = 0; j < ns; j++) {
        cp_async_wait<SKW_STAGES - 2>();
        fence_proxy_async();
        __syncthreads();  // slab j staged by all; slab j - 1's stage free (its wgmmas waited for)
        stage(j + SKW_STAGES - 1);
        const unsigned st = base + (j % SKW_STAGES) * STAGE;
        unsigned a[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const int r = mt * 64 + ar, c = 2 * s + ac;
                ldsm_x4_at<false>(a[mt][s][0], a[mt][s][1], a[mt][s][2], a[mt][s][3], st + r * 128 + ((c ^ (r & 7)) << 4));
            }
        wg_pin<N>(&acc[0][0]);  // the accumulators' zeroing stays ahead of the fence
        wg_fence();
        // K-major B: k-step s is 32 bytes into each token row; rows in groups of 8 (1024 bytes).
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                wgmma_bf16_rs<N>(acc[mt], a[mt][s], wg_desc_sw128(st + ROWS * 128 + s * 32, 16, 1024));
        wg_commit();
        wg_wait<N>(&acc[0][0]);
        wg_pin_u<32>(&a[0][0][0]);  // the fragments stay untouched until the wgmmas have read them
    }
    cp_async_wait<0>();
    __syncthreads();
    // Accumulator e of half mt: row mt·64 + warp·16 + g (+8 for e % 4 ≥ 2), token
    // 8·(e / 4) + 2t (+1 for odd e).
    float* red = reinterpret_cast<float*>(skw_smem);
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int e = 0; e < N / 2; e++) {
            const int r = mt * 64 + warp * 16 + g + ((e & 2) ? 8 : 0), tok = 8 * (e >> 2) + 2 * t + (e & 1);
            red[tok * RSTRIDE + r] = acc[mt][e];
        }
    if (S > 1) cluster_sync_all();
    else __syncthreads();
    skinny_reduce<S, ROWS, THREADS>(red, N, split, row0, m_tokens, n, y, accumulate);
    if (S > 1) cluster_sync_all();  // no block leaves while another reads its partials
}
#define SKW_KERNEL(N, S, CL) \
    extern "C" __global__ void __launch_bounds__(128) CL skinny_wg_bf16_n##N##_s##S(SK_ARGS) { \
        skinny_wg_impl<N, S>(w, x, m_tokens, n, k, y, accumulate); \
    }
#define SKW_KERNELS(N) \
    SKW_KERNEL(N, 1, ) \
    SKW_KERNEL(N, 2, SK_CLUSTER(2)) \
    SKW_KERNEL(N, 4, SK_CLUSTER(4)) \
    SKW_KERNEL(N, 8, SK_CLUSTER(8))
SKW_KERNELS(8)
SKW_KERNELS(16)
SKW_KERNELS(32)
SKW_KERNELS(64)

typedef void (*SkFn)(SK_ARGS);
static SkFn wg_fn(int nn, int s) {
#define F(N) \
    if (nn == N) return s == 1 ? skinny_wg_bf16_n##N##_s1 : s == 2 ? skinny_wg_bf16_n##N##_s2 : s == 4 ? skinny_wg_bf16_n##N##_s4 : skinny_wg_bf16_n##N##_s8;
    F(8) F(16) F(32) F(64)
#undef F
    return nullptr;
}
static int wg_n_of(int m) { return m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64; }
static int wg_smem_of(int nn) { return nn == 8 ? SKW_SMEM_BYTES(8) : nn == 16 ? SKW_SMEM_BYTES(16) : nn == 32 ? SKW_SMEM_BYTES(32) : SKW_SMEM_BYTES(64); }

// The engine instantiates one n8 tile (2–8 tokens); the lab adds 2, 4 and 8 (16–64).
SK_KERNELS(2)
SK_KERNELS(4)
SK_KERNELS(8)
static SkFn sk_fn(int nt, int s) {
#define F(NT) \
    if (nt == NT) return s == 1 ? skinny_bf16_t##NT##_s1 : s == 2 ? skinny_bf16_t##NT##_s2 : s == 4 ? skinny_bf16_t##NT##_s4 : skinny_bf16_t##NT##_s8;
    F(1) F(2) F(4) F(8)
#undef F
    return nullptr;
}
static int nt_of(int m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }
static int smem_of(int nt) { return nt == 1 ? SK_SMEM_BYTES(1, SK_WARPS) : nt == 2 ? SK_SMEM_BYTES(2, SK_WARPS) : nt == 4 ? SK_SMEM_BYTES(4, SK_WARPS) : SK_SMEM_BYTES(8, SK_WARPS); }

int main(int argc, char** argv) {
    const size_t pool_bytes = 4ull << 30;
    unsigned short* pool = bf16_device(pool_bytes / 2, 1, 0.05f);
    unsigned short* x = bf16_device(64 * 14336, 7, 1.f);
    const size_t ymax = 64ull * 128256;
    float *y, *yref, *y0; CK(cudaMalloc(&y, ymax * 4)); CK(cudaMalloc(&yref, ymax * 4)); CK(cudaMalloc(&y0, ymax * 4));
    { std::vector<float> h(ymax); for (size_t i = 0; i < ymax; i++) h[i] = ((i * 37) % 101) / 50.f - 1; CK(cudaMemcpy(y0, h.data(), ymax * 4, cudaMemcpyHostToDevice)); }
    for (int nt : {1, 2, 4, 8}) for (int s : {1, 2, 4, 8}) CK(cudaFuncSetAttribute(sk_fn(nt, s), cudaFuncAttributeMaxDynamicSharedMemorySize, smem_of(nt)));
    for (int nn : {8, 16, 32, 64}) for (int s : {1, 2, 4, 8}) CK(cudaFuncSetAttribute(wg_fn(nn, s), cudaFuncAttributeMaxDynamicSharedMemorySize, wg_smem_of(nn)));
    cudaStream_t st; CK(cudaStreamCreate(&st));  // ordered with the cudaMemcpy calls of the checks
    cublasHandle_t blas; cublasCreate(&blas); cublasSetStream(blas, st);
    void* ws; CK(cudaMalloc(&ws, 32 << 20)); cublasSetWorkspace(blas, ws, 32 << 20);
    struct Shape { const char* name; int n, k; };
    std::vector<Shape> shapes = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gateup", 28672, 4096}, {"down", 4096, 14336}, {"lm_head", 128256, 4096}, {"smol 576x576", 576, 576}, {"smol 3072x576", 3072, 576}};
    std::vector<int> ms = {2, 8, 16, 24, 32, 48, 64};
    if (argc > 1) { ms.clear(); for (int i = 1; i < argc; i++) ms.push_back(atoi(argv[i])); }
    const int ITER = 40;
    for (int m : ms) {
        printf("M = %d\n", m);
        double tot_blas = 0, tot_best[2] = {0, 0};
        for (auto& sh : shapes) {
            const size_t wbytes = (size_t)sh.n * sh.k * 2;
            const int copies = std::max<size_t>(1, pool_bytes / wbytes);
            const int n = sh.n, k = sh.k, nt = nt_of(m);
            auto blas_run = [&](const unsigned short* w, float* out, float beta) {
                const float alpha = 1.f;
                cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, out, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            };
            // kind 0: the engine's mma.sync kernels; 1: the warpgroup form.
            auto sk_run = [&](int kind, int s, const unsigned short* w, float* out, int acc) {
                if (kind == 0)
                    sk_fn(nt, s)<<<dim3((n + 32 * SK_WARPS - 1) / (32 * SK_WARPS), s), 32 * SK_WARPS, smem_of(nt), st>>>(w, x, m, n, k, out, acc);
                else
                    wg_fn(wg_n_of(m), s)<<<dim3((n + 127) / 128, s), 128, wg_smem_of(wg_n_of(m)), st>>>(w, x, m, n, k, out, acc);
            };
            // ITER calls over cycled copies of W, captured in one graph; µs per call.
            auto time = [&](auto f) {
                return graph_us(st, ITER, [&](int i) { f(pool + (size_t)(i % copies) * (wbytes / 2)); });
            };
            // exactness, plain and accumulating, against cuBLAS
            auto check = [&](int kind, int s, int acc) {
                CK(cudaMemcpy(yref, y0, (size_t)m * n * 4, cudaMemcpyDeviceToDevice));
                CK(cudaMemcpy(y, y0, (size_t)m * n * 4, cudaMemcpyDeviceToDevice));
                blas_run(pool, yref, acc ? 1.f : 0.f); sk_run(kind, s, pool, y, acc); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
                std::vector<float> a((size_t)m * n), b((size_t)m * n);
                CK(cudaMemcpy(a.data(), y, a.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), yref, b.size() * 4, cudaMemcpyDeviceToHost));
                double md = 0, mr = 0; for (size_t i = 0; i < a.size(); i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mr = std::max(mr, (double)fabsf(b[i])); }
                return md / mr;
            };
            const float tb = time([&](const unsigned short* w) { blas_run(w, y, 0.f); });
            printf("  %-14s %6.1f MB cublas %8.2f us %6.0f GB/s\n", sh.name, wbytes / 1e6, tb, wbytes / tb / 1e3);
            for (int kind : {0, 1}) {
                printf("    %-8s", kind == 0 ? "mma.sync" : "wgmma");
                float best = 1e30; int bs = 0;
                for (int s : {1, 2, 4, 8}) {
                    if (s > k / SK_SLAB) continue;
                    const double e = std::max(check(kind, s, 0), check(kind, s, 1));
                    const float ts = time([&](const unsigned short* w) { sk_run(kind, s, w, y, 0); });
                    printf(" s%d %6.2f %4.0f%s", s, ts, wbytes / ts / 1e3, e > 1e-3 ? " BAD" : "");
                    if (e > 1e-3) printf("(%.2e)", e);
                    if (ts < best) best = ts, bs = s;
                }
                printf(" | best s%d %.2fx cublas\n", bs, tb / best);
                if (sh.n >= 4096) tot_best[kind] += best * (sh.n == 128256 ? 1 : 32);
            }
            if (sh.n >= 4096) tot_blas += tb * (sh.n == 128256 ? 1 : 32);
        }
        printf("  per step (32 layers + lm_head): cublas %.0f us, mma.sync best %.0f us, wgmma best %.0f us\n", tot_blas, tot_best[0], tot_best[1]);
    }
}
