// GEMV lab (docs/PERF.md, "what ncu showed"): one-token y = W·x variants, W bf16 [N][K],
// x f32, timed on the Llama-3-8B decode shapes with 1 GiB of weights cycled (L2 cold), beside
// a pure read of the same bytes. Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/gpu-lab/gemvlab.cu -o gemvlab && ./gemvlab
// The "tiled" variants read a hypothetical re-laid W (bandwidth only; their sums are not
// checked).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

// The engine's kernels and helpers (ld_stream_u4, dot8_bf16, load_x8, stream_read): the
// lab's variants stream weights and read x exactly as the engine does.
#include "../../kernels/src/cuda/ops.cu"

// R rows per warp, U steps of 256 columns in flight per row, WARPS per block, SX: x staged in shared memory.
template <int R, int U, int WARPS, bool SX>
__global__ void __launch_bounds__(WARPS * 32) gemv(const unsigned short* __restrict__ w, const float* __restrict__ x, int n, int k, float* __restrict__ out) {
    extern __shared__ float xs[];
    if (SX) {
        for (int i = threadIdx.x * 4; i < k; i += blockDim.x * 4) *reinterpret_cast<float4*>(xs + i) = *reinterpret_cast<const float4*>(x + i);
        __syncthreads();
    }
    const float* xv = SX ? xs : x;
    const int lane = threadIdx.x & 31, warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int r0 = warp * R;
    if (r0 >= n) return;
    const unsigned short* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = w + (size_t)min(r0 + r, n - 1) * k;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    const int step = 256;
    int k0 = lane * 8;
    for (; k0 + (U - 1) * step < k; k0 += U * step) {
        uint4 a[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) a[r][u] = ld_stream_u4(wr[r] + k0 + u * step);
#pragma unroll
        for (int u = 0; u < U; u++) {
            float v[8];
            load_x8<false>(xv, nullptr, 1.f, k0 + u * step, v);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += dot8_bf16(a[r][u], v);
        }
    }
    for (; k0 < k; k0 += step) {
        float v[8];
        load_x8<false>(xv, nullptr, 1.f, k0, v);
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += dot8_bf16(ld_stream_u4(wr[r] + k0), v);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = acc[r];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0 && r0 + r < n) out[r0 + r] = s;
    }
}

// Software-pipelined: group g+1's loads are issued before group g is consumed.
template <int R, int U, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) gemv_pipe(const unsigned short* __restrict__ w, const float* __restrict__ x, int n, int k, float* __restrict__ out) {
    const int lane = threadIdx.x & 31, warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int r0 = warp * R;
    if (r0 >= n) return;
    const unsigned short* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = w + (size_t)min(r0 + r, n - 1) * k;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    const int G = U * 256;  // columns per group
    const int groups = k / G;  // assume k % G == 0 for the lab
    uint4 a[R][U], b[R][U];
    int k0 = lane * 8;
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int r = 0; r < R; r++) a[r][u] = ld_stream_u4(wr[r] + k0 + u * 256);
    for (int g = 0; g < groups; g++, k0 += G) {
        if (g + 1 < groups) {
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) b[r][u] = ld_stream_u4(wr[r] + k0 + G + u * 256);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float v[8];
            load_x8<false>(x, nullptr, 1.f, k0 + u * 256, v);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += dot8_bf16(a[r][u], v);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) a[r][u] = b[r][u];
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = acc[r];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0 && r0 + r < n) out[r0 + r] = s;
    }
}

// Tiled layout: block b owns rows [RB·b, RB·b+RB); W' stores, per block, step s, row j,
// the 256 columns s·256.. of row j contiguous (512 B). A warp takes RB/WARPS rows.
// At step s a block's loads are one contiguous RB·512-byte span.
template <int R, int U, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) gemv_tiled(const unsigned short* __restrict__ w, const float* __restrict__ x, int n, int k, float* __restrict__ out) {
    constexpr int RB = R * WARPS;
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int steps = k / 256;
    const unsigned short* blk = w + (size_t)blockIdx.x * RB * k;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int s = 0; s + U <= steps; s += U) {
        uint4 a[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) a[r][u] = ld_stream_u4(blk + ((size_t)(s + u) * RB + wi * R + r) * 256 + lane * 8);
#pragma unroll
        for (int u = 0; u < U; u++) {
            float v[8];
            load_x8<false>(x, nullptr, 1.f, (s + u) * 256 + lane * 8, v);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += dot8_bf16(a[r][u], v);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = acc[r];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        const int row = blockIdx.x * RB + wi * R + r;
        if (lane == 0 && row < n) out[row] = s;
    }
}

int main() {
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    struct Shape { const char* name; int n, k; };
    Shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gateup", 28672, 4096}, {"down", 4096, 14336}};
    const size_t pool_bytes = 1ull << 30;  // 1 GiB of weights cycled through (L2 cold each launch)
    unsigned short* pool; CK(cudaMalloc(&pool, pool_bytes));
    {   // random bf16 in [-1, 1)
        std::vector<unsigned short> h(pool_bytes / 2);
        unsigned s = 1;
        for (auto& v : h) { s = s * 1664525u + 1013904223u; float f = ((s >> 8) / 16777216.f) * 2 - 1; unsigned u; memcpy(&u, &f, 4); v = u >> 16; }
        CK(cudaMemcpy(pool, h.data(), pool_bytes, cudaMemcpyHostToDevice));
    }
    float *x, *out, *ref; unsigned* sink;
    CK(cudaMalloc(&x, 14336 * 4)); CK(cudaMalloc(&out, 28672 * 4)); CK(cudaMalloc(&ref, 28672 * 4)); CK(cudaMalloc(&sink, 4));
    { std::vector<float> h(14336); for (int i = 0; i < 14336; i++) h[i] = ((i * 37) % 101) / 50.f - 1; CK(cudaMemcpy(x, h.data(), 14336 * 4, cudaMemcpyHostToDevice)); }
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    const int ITER = 60;
    double total[32] = {0};
    const char* names[32]; int nv = 0;
    for (auto& sh : shapes) {
        const size_t mbytes = (size_t)sh.n * sh.k * 2;
        const int copies = pool_bytes / mbytes;
        printf("%s %dx%d (%.1f MB, %d copies)\n", sh.name, sh.n, sh.k, mbytes / 1e6, copies);
        int v = 0;
        auto run = [&](const char* name, auto launch, bool check) {
            launch(pool);  // warm
            CK(cudaDeviceSynchronize());
            if (check) {
                std::vector<float> a(sh.n), b(sh.n);
                CK(cudaMemcpy(a.data(), out, sh.n * 4, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(b.data(), ref, sh.n * 4, cudaMemcpyDeviceToHost));
                double m = 0; for (int i = 0; i < sh.n; i++) m = std::max(m, (double)fabsf(a[i] - b[i]));
                if (m > 1e-2) printf("  %s MISMATCH %.3g\n", name, m);
            }
            CK(cudaEventRecord(e0));
            for (int i = 0; i < ITER; i++) launch(pool + (size_t)(i % copies) * (mbytes / 2));
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
            float ms; cudaEventElapsedTime(&ms, e0, e1);
            const double us = ms * 1e3 / ITER;
            printf("  %-28s %8.2f us  %7.0f GB/s\n", name, us, mbytes / us / 1e3);
            names[v] = name; total[v++] += us;
        };
        const int n = sh.n, k = sh.k;
        // reference: current kernel
        gemv<2, 2, 8, false><<<(n / 2 + 7) / 8, 256>>>(pool, x, n, k, ref);
#define G(R, U, W, SX) [&](const unsigned short* p) { gemv<R, U, W, SX><<<(n / R + W - 1) / W, W * 32, SX ? k * 4 : 0>>>(p, x, n, k, out); }
#define P(R, U, W) [&](const unsigned short* p) { gemv_pipe<R, U, W><<<(n / R + W - 1) / W, W * 32>>>(p, x, n, k, out); }
#define T(R, U, W) [&](const unsigned short* p) { gemv_tiled<R, U, W><<<(n / (R * W)), W * 32>>>(p, x, n, k, out); }
        cudaFuncSetAttribute(gemv<2, 4, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 14336 * 4);
        cudaFuncSetAttribute(gemv<2, 2, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 14336 * 4);
        run("cur R2 U2 W8", G(2, 2, 8, false), true);
        run("R2 U4 W8", G(2, 4, 8, false), true);
        run("R1 U4 W8", G(1, 4, 8, false), true);
        run("R1 U8 W8", G(1, 8, 8, false), true);
        run("R4 U2 W8", G(4, 2, 8, false), true);
        run("R2 U4 W4", G(2, 4, 4, false), true);
        run("R2 U2 W8 xsmem", G(2, 2, 8, true), true);
        run("R2 U4 W8 xsmem", G(2, 4, 8, true), true);
        run("pipe R2 U2 W8", P(2, 2, 8), true);
        run("pipe R1 U4 W8", P(1, 4, 8), true);
        run("pipe R2 U4 W8", P(2, 4, 8), true);
        run("tiled R2 U2 W8", T(2, 2, 8), false);
        run("tiled R2 U4 W8", T(2, 4, 8), false);
        run("tiled R1 U4 W8", T(1, 4, 8), false);
        run("stream_read 4/SM", [&](const unsigned short* p) { stream_read<<<4 * nsm, 256>>>(p, mbytes / 16, sink); }, false);
        nv = v;
    }
    printf("per step (x32 layers, 4 GEMVs):\n");
    for (int v = 0; v < nv; v++) printf("  %-28s %8.1f us\n", names[v], total[v] * 32);
}
