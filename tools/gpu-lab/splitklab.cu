// Split-K lab (issue 5, batch 16–64 decode): the narrow GEMMs split over K by the caller
// instead of by cuBLAS. The Llama-3-8B shapes, 1 GiB of weights cycled (L2 cold), every way
// 64 calls replayed from one CUDA graph, µs per call:
//   plain     cublasGemmEx as the engine calls it (bf16 in, f32 out, y += W·x for o and
//             down), then, for o and down, the engine's next RMSNorm into bf16 (its own
//             launch: `rms_norm_bf16_rows`);
//   batched   cublasGemmStridedBatchedEx over S slices of K (partials, β = 0), then one
//             kernel that adds the partials and the residual and, for o and down, writes the
//             sum and its RMSNorm in bf16 (in place of the norm's own launch);
//   alone     each GEMM without its epilogue kernel.
// The sums are checked against the plain way (the order of the additions differs).
// Not part of the build; on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/splitklab.cu -lcublas -o splitklab && ./splitklab [tokens…]
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t e = (x); if (e != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS %d at %d\n", (int)e, __LINE__); exit(1); } } while (0)
#include "../../kernels/src/cuda/ops.cu"
#include "graph_time.h"

// y[t] = res[t] + Σ_s part[s][t] (rows wide), and with `norm` its RMSNorm (weight nw) as
// bf16 into xn; a block per token row, 8 columns a thread per pass.
__global__ void __launch_bounds__(512) reduce_res_norm(const float* __restrict__ part, int splits, int tokens, int rows,
                                                       float* __restrict__ y, const float* __restrict__ nw, float eps,
                                                       unsigned short* __restrict__ xn, int norm) {
    const int t = blockIdx.x;
    __shared__ float red[32];
    float ss = 0.f;
    const size_t pstride = (size_t)tokens * rows;
    for (int c = threadIdx.x * 4; c < rows; c += blockDim.x * 4) {
        float4 a = *(const float4*)(y + (size_t)t * rows + c);
        for (int s = 0; s < splits; s++) {
            const float4 p = *(const float4*)(part + s * pstride + (size_t)t * rows + c);
            a.x += p.x, a.y += p.y, a.z += p.z, a.w += p.w;
        }
        *(float4*)(y + (size_t)t * rows + c) = a;
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
    if (!norm) return;
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.f;
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float r = rsqrtf(red[0] / rows + eps);
    for (int c = threadIdx.x * 4; c < rows; c += blockDim.x * 4) {
        const float4 a = *(const float4*)(y + (size_t)t * rows + c);
        xn[(size_t)t * rows + c] = f32_to_bf16(a.x * r * nw[c]);
        xn[(size_t)t * rows + c + 1] = f32_to_bf16(a.y * r * nw[c + 1]);
        xn[(size_t)t * rows + c + 2] = f32_to_bf16(a.z * r * nw[c + 2]);
        xn[(size_t)t * rows + c + 3] = f32_to_bf16(a.w * r * nw[c + 3]);
    }
}

int main(int argc, char** argv) {
    std::vector<int> toks;
    for (int i = 1; i < argc; i++) toks.push_back(atoi(argv[i]));
    if (toks.empty()) toks = {16, 32, 64};
    const size_t pool = (size_t)1 << 30;
    unsigned short* w = bf16_device(pool / 2, 7, 1.f / 64);
    unsigned short* xs = bf16_device((size_t)256 * 14336, 9, 1.f);
    float *part, *y, *y0, *nw;
    unsigned short* xn;
    CK(cudaMalloc(&part, (size_t)8 * 256 * 28672 * 4));
    CK(cudaMalloc(&y, (size_t)256 * 28672 * 4));
    CK(cudaMalloc(&y0, (size_t)256 * 28672 * 4));
    CK(cudaMalloc(&nw, 28672 * 4));
    CK(cudaMalloc(&xn, (size_t)256 * 28672 * 2));
    {
        std::vector<float> h(28672, 1.f);
        CK(cudaMemcpy(nw, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cublasHandle_t blas;
    CB(cublasCreate(&blas));
    CB(cublasSetStream(blas, st));
    struct Shape { const char* name; int rows, cols; bool res; } shapes[] = {
        {"QKV", 6144, 4096, false}, {"o", 4096, 4096, true}, {"down", 4096, 14336, true}, {"gate/up", 28672, 4096, false}};
    const float one = 1.f, zero = 0.f;
    for (int tokens : toks)
    for (auto& sh : shapes) {
        const size_t bytes = (size_t)sh.rows * sh.cols * 2;
        const int copies = (int)(pool / bytes);
        auto at = [&](int i) { return w + (size_t)(i % copies) * sh.rows * sh.cols; };
        const int iter = 64;
        const size_t ysz = (size_t)tokens * sh.rows;
        auto plain = [&](int i) {
            CB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.rows, tokens, sh.cols, &one, at(i), CUDA_R_16BF, sh.cols, xs,
                            CUDA_R_16BF, sh.cols, sh.res ? &one : &zero, y, CUDA_R_32F, sh.rows, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        };
        auto norm = [&]() {
            if (sh.res) rms_norm_bf16_rows<<<tokens, 256, 0, st>>>(y, nw, 1e-5f, sh.rows, xn, 0);
        };
        auto batched = [&](int i, int s) {
            const int kc = sh.cols / s;
            CB(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.rows, tokens, kc, &one, at(i), CUDA_R_16BF,
                                          sh.cols, kc, xs, CUDA_R_16BF, sh.cols, kc, &zero, part, CUDA_R_32F, sh.rows,
                                          (long long)ysz, s, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        };
        auto reduce = [&](int s) {
            if (sh.res || s > 1)
                reduce_res_norm<<<tokens, 512, 0, st>>>(part, s, tokens, sh.rows, y, nw, 1e-5f, xn, sh.res ? 1 : 0);
        };
        // Bits: the plain sum against the split one, from the same y.
        std::vector<float> a(ysz), b(ysz);
        auto fresh = [&]() { CK(cudaMemsetAsync(y, 0, ysz * 4, st)); };
        fresh(); plain(0); CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(a.data(), y, ysz * 4, cudaMemcpyDeviceToHost));
        double range = 0; for (float v : a) range = std::max(range, (double)fabsf(v));
        printf("%s, %d tokens (%.1f MB):\n", sh.name, tokens, bytes / 1e6);
        const float tp = graph_us(st, iter, [&](int i) { plain(i); });
        const float tpn = graph_us(st, iter, [&](int i) { plain(i); norm(); });
        printf("  plain alone %8.2f us  %6.0f GB/s | with the norm %8.2f us\n", tp, bytes / tp / 1e3, tpn);
        for (int s : {2, 3, 4, 8}) {
            if (sh.cols % (8 * s)) continue;
            fresh(); batched(0, s); if (!sh.res) fresh(); reduce(s); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
            CK(cudaMemcpy(b.data(), y, ysz * 4, cudaMemcpyDeviceToHost));
            double md = 0; for (size_t i = 0; i < ysz; i++) md = std::max(md, (double)fabsf(a[i] - b[i]));
            const float tb = graph_us(st, iter, [&](int i) { batched(i, s); });
            const float tbr = graph_us(st, iter, [&](int i) { batched(i, s); reduce(s); });
            printf("  batched %d   %8.2f us  %6.0f GB/s | with the reduce%s %8.2f us | max diff %.2e of %.2e\n", s, tb,
                   bytes / tb / 1e3, sh.res ? "+norm" : "", tbr, md, range);
        }
    }
}
