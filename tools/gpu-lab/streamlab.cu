// Streaming lab (docs/PERF.md, twenty-third session): how fast can a block-tiled kernel
// read a weight matrix into shared memory, and what do a GEMM's other parts add? The decode
// GEMMs of 9–64 tokens read W [rows][cols] (bf16, row-major) in tiles of 128 rows × 64
// columns per block and split of K, as cuBLAS and the engine's skinny kernel do. Timed on
// the Llama-3-8B shapes with 1 GiB of weights cycled (L2 cold), every way 64 calls replayed
// from one CUDA graph:
//   cuBLAS    cublasGemmEx as the engine calls it, 16 and 64 tokens;
//   LDG       the engine's own read probe (`stream_read`) over the same bytes;
//   cp.async  every thread copies 16-byte pieces (the skinny kernel's loader), a ring of
//             STAGES stages, all but one in flight; each stage touched once;
//   TMA       one thread issues a 2-d tensor-map copy per stage (box 64 columns × 128 rows,
//             128-byte swizzle, the layout wgmma reads) onto a per-stage mbarrier;
//   +X…       the cp.async ring with the tokens' rows (the engine's skinny_stage), then the
//             slab's warpgroup MMAs, then each way of reducing the key splits (see EPI).
// Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a tools/gpu-lab/streamlab.cu -lcuda -lcublas -o streamlab && ./streamlab
#include <cstdio>
#include <cstdlib>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#include "graph_time.h"
#include "../../kernels/src/cuda/ops.cu"

// D(64×N, f32) += A(64×16) · B(16×N), bf16, both K-major in shared memory (128-byte swizzle).
template <int N>
__device__ __forceinline__ void wgmma_ss_bf16(float* d, unsigned long long a, unsigned long long b) {
    if constexpr (N == 16)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
            : "l"(a), "l"(b), "n"(1));
    if constexpr (N == 64)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(a), "l"(b), "n"(1));
}

#define ROWS 128
#define SLAB 64
#define STAGE_BYTES (ROWS * SLAB * 2)

// The block's span: rows [row0, row0 + 128), slabs [s0, s0 + ns) of 64 columns.
__device__ __forceinline__ void span(int cols, int& row0, int& s0, int& ns) {
    const int slabs = cols / SLAB, per = (slabs + gridDim.y - 1) / gridDim.y;
    row0 = blockIdx.x * ROWS;
    s0 = min((int)blockIdx.y * per, slabs);
    ns = min(s0 + per, slabs) - s0;
}

template <int STAGES>
__global__ void __launch_bounds__(128) read_cp(const unsigned short* __restrict__ w, int cols, unsigned* sink) {
    extern __shared__ __align__(128) unsigned char sm[];
    const unsigned base = (smem_u32(sm) + 1023u) & ~1023u;
    int row0, s0, ns;
    span(cols, row0, s0, ns);
    auto stage = [&](int j) {
        if (j < ns) {
            const unsigned st = base + (j % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int p = 0; p < ROWS * 8 / 128; p++) {
                const int piece = threadIdx.x + 128 * p, r = piece >> 3, c = piece & 7;
                cp_async16_at<true>(st + r * 128 + ((c ^ (r & 7)) << 4), w + (size_t)(row0 + r) * cols + (size_t)(s0 + j) * SLAB + 8 * c, 16);
            }
        }
        cp_async_commit();
    };
    for (int j = 0; j < STAGES - 1; j++) stage(j);
    unsigned acc = 0;
    for (int j = 0; j < ns; j++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        stage(j + STAGES - 1);
        unsigned v;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base + (j % STAGES) * STAGE_BYTES + threadIdx.x * 4));
        acc ^= v;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The wide skinny GEMM's loop without its epilogue: W's 128 rows and XN tokens' rows per
// 64-column slab (the engine's skinny_stage), and with MMA the slab's eight wgmmas, then
// waiting for all but WAITN groups of them; DEPTH slabs in flight.
// EPI: 0 none (a sum to `sink` that is never written), 1 the split's partials to global
// memory [split][token][row] (no reduction), 2 the engine's cluster reduction
// (skinny_reduce over the splits' shared memory, into y[token][row]), 3 the partials to
// global memory and the row block's last block to finish (an atomic count) adds them in
// split order into g_y (a fixed order, so the same bits whatever finishes last).
__device__ unsigned g_count[4096];
__device__ float g_y[64 * 28672];
template <int STAGES, int XN, bool MMA, int WAITN, int EPI = 0>
__device__ void read_cpx_impl(const unsigned short* __restrict__ w, const unsigned short* __restrict__ x, int cols,
                              float* sink) {
    extern __shared__ __align__(128) unsigned char sm[];
    constexpr int DEPTH = STAGES - 1 - WAITN;
    const unsigned base = (smem_u32(sm) + 1023u) & ~1023u;
    int row0, s0, ns;
    span(cols, row0, s0, ns);
    const int n = gridDim.x * ROWS;
    auto stage = [&](int j) { skinny_stage<ROWS, XN, 128, STAGES>(base, j, ns, s0, w, x, row0, n, cols, XN); };
    for (int j = 0; j < DEPTH; j++) stage(j);
    float acc[2][XN / 2];
    for (int m = 0; m < 2; m++)
        for (int e = 0; e < XN / 2; e++) acc[m][e] = 0.f;
    for (int j = 0; j < ns; j++) {
        cp_async_wait<DEPTH - 1>();
        fence_proxy_async();
        __syncthreads();
        stage(j + DEPTH);
        const unsigned st = base + (j % STAGES) * (ROWS + XN) * 128;
        if (MMA) {
            wg_fence();
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_ss_bf16<XN>(acc[mt], wg_desc_sw128(st + mt * 64 * 128 + kk * 32, 16, 1024),
                                      wg_desc_sw128(st + ROWS * 128 + kk * 32, 16, 1024));
            wg_commit();
            if (WAITN == 0) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            else asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        } else {
            unsigned v;
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(st + threadIdx.x * 4));
            acc[0][0] += __uint_as_float(v);
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (EPI == 0) {
        float t = 0.f;
        for (int m = 0; m < 2; m++)
            for (int e = 0; e < XN / 2; e++) t += acc[m][e];
        if (t == 1234.5f) sink[0] = t;
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (EPI == 1) {
        float* part = sink + (size_t)blockIdx.y * XN * n;
        for (int mt = 0; mt < 2; mt++)
            for (int i = 0; i < XN / 8; i++) {
                const int r = row0 + mt * 64 + warp * 16 + g, tok = 8 * i + 2 * t;
                part[(size_t)tok * n + r] = acc[mt][4 * i];
                part[(size_t)(tok + 1) * n + r] = acc[mt][4 * i + 1];
                part[(size_t)tok * n + r + 8] = acc[mt][4 * i + 2];
                part[(size_t)(tok + 1) * n + r + 8] = acc[mt][4 * i + 3];
            }
        return;
    }
    if (EPI == 3) {
        float* part = sink + ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * XN * ROWS;
        for (int mt = 0; mt < 2; mt++)
            for (int i = 0; i < XN / 8; i++) {
                const int r = mt * 64 + warp * 16 + g, tok = 8 * i + 2 * t;
                part[tok * ROWS + r] = acc[mt][4 * i];
                part[(tok + 1) * ROWS + r] = acc[mt][4 * i + 1];
                part[tok * ROWS + r + 8] = acc[mt][4 * i + 2];
                part[(tok + 1) * ROWS + r + 8] = acc[mt][4 * i + 3];
            }
        __threadfence();
        __syncthreads();
        __shared__ unsigned last;
        if (threadIdx.x == 0) last = atomicAdd(&g_count[blockIdx.x], 1u) == gridDim.y - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* p0 = sink + (size_t)blockIdx.x * gridDim.y * XN * ROWS;
        for (int i = threadIdx.x; i < XN * ROWS / 4; i += 128) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int sp = 0; sp < (int)gridDim.y; sp++) {
                const float4 q = __ldcg(reinterpret_cast<const float4*>(p0 + (size_t)sp * XN * ROWS) + i);
                v.x += q.x, v.y += q.y, v.z += q.z, v.w += q.w;
            }
            const int tok = i / (ROWS / 4), r = (i % (ROWS / 4)) * 4;
            float4* o = reinterpret_cast<float4*>(g_y + (size_t)tok * n + row0 + r);
            const float4 old = *o;
            *o = make_float4(old.x + v.x, old.y + v.y, old.z + v.z, old.w + v.w);
        }
        if (threadIdx.x == 0) g_count[blockIdx.x] = 0;
        return;
    }
    cp_async_wait<0>();
    __syncthreads();
    constexpr int RS = ROWS + 4;
    float* red = reinterpret_cast<float*>(sm + (base - smem_u32(sm)));
    for (int mt = 0; mt < 2; mt++)
        for (int i = 0; i < XN / 8; i++) {
            const int r = mt * 64 + warp * 16 + g, tok = 8 * i + 2 * t;
            red[tok * RS + r] = acc[mt][4 * i];
            red[(tok + 1) * RS + r] = acc[mt][4 * i + 1];
            red[tok * RS + r + 8] = acc[mt][4 * i + 2];
            red[(tok + 1) * RS + r + 8] = acc[mt][4 * i + 3];
        }
    cluster_sync_all();
    skinny_reduce<4, ROWS, 128>(red, XN, blockIdx.y, row0, XN, n, sink, 0);
    cluster_sync_all();
}
template <int STAGES, int XN, bool MMA, int WAITN>
__global__ void __launch_bounds__(128) read_cpx(const unsigned short* __restrict__ w, const unsigned short* __restrict__ x,
                                                int cols, float* sink) {
    read_cpx_impl<STAGES, XN, MMA, WAITN>(w, x, cols, sink);
}
__global__ void __launch_bounds__(128) read_cpx_part(const unsigned short* __restrict__ w,
                                                     const unsigned short* __restrict__ x, int cols, float* sink) {
    read_cpx_impl<4, 64, true, 0, 1>(w, x, cols, sink);
}
template <int XN>
__global__ void __launch_bounds__(128) read_cpx_fix(const unsigned short* __restrict__ w,
                                                    const unsigned short* __restrict__ x, int cols, float* sink) {
    read_cpx_impl<4, XN, true, 0, 3>(w, x, cols, sink);
}
__global__ void __launch_bounds__(128) __cluster_dims__(1, 4, 1)
    read_cpx_cl4(const unsigned short* __restrict__ w, const unsigned short* __restrict__ x, int cols, float* sink) {
    read_cpx_impl<4, 64, true, 0, 2>(w, x, cols, sink);
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_2d(unsigned dst, const CUtensorMap* map, int x, int y, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar) : "memory");
}

template <int STAGES>
__global__ void __launch_bounds__(128) read_tma(const __grid_constant__ CUtensorMap map, int cols, unsigned* sink) {
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) unsigned long long bars[STAGES];
    const unsigned base = (smem_u32(sm) + 1023u) & ~1023u, bar0 = smem_u32(bars);
    int row0, s0, ns;
    span(cols, row0, s0, ns);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int j) {
        const int s = j % STAGES;
        mbar_expect(bar0 + 8 * s, STAGE_BYTES);
        tma_2d(base + s * STAGE_BYTES, &map, (s0 + j) * SLAB, row0, bar0 + 8 * s);
    };
    if (threadIdx.x == 0)
        for (int j = 0; j < STAGES && j < ns; j++) issue(j);
    unsigned acc = 0;
    for (int j = 0; j < ns; j++) {
        mbar_wait(bar0 + 8 * (j % STAGES), (j / STAGES) & 1);
        unsigned v;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base + (j % STAGES) * STAGE_BYTES + threadIdx.x * 4));
        acc ^= v;
        __syncthreads();  // every thread is done with stage j % STAGES
        if (threadIdx.x == 0 && j + STAGES < ns) issue(j + STAGES);
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t pool = (size_t)1 << 30;  // bytes cycled through
    unsigned short* w = bf16_device(pool / 2, 7, 1.f);
    unsigned* sink;
    CK(cudaMalloc(&sink, 4));
    float* fsink;  // also the partials (8 splits × 64 tokens × 28,672 rows) or y
    CK(cudaMalloc(&fsink, (size_t)8 * 64 * 28672 * 4));
    unsigned short* xs = bf16_device((size_t)64 * 14336, 9, 1.f);  // the tokens' activations
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(blas, st) != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS\n"); exit(1); }
    struct Shape { const char* name; int rows, cols; bool accumulate; } shapes[] = {
        {"QKV", 6144, 4096, false}, {"o", 4096, 4096, true}, {"down", 4096, 14336, true}, {"gate/up", 28672, 4096, false}};
    printf("%-8s %-22s %6s %9s %9s\n", "shape", "way", "blocks", "us", "GB/s");
    for (auto& sh : shapes) {
        const size_t bytes = (size_t)sh.rows * sh.cols * 2;
        const int copies = (int)(pool / bytes);
        auto at = [&](int i) { return w + (size_t)(i % copies) * sh.rows * sh.cols; };
        const int iter = 64;
        auto report = [&](const char* way, int blocks, float us) {
            printf("%-8s %-22s %6d %9.2f %9.1f\n", sh.name, way, blocks, us, bytes / us / 1e3);
        };
        // The engine's LDG probe over the same bytes.
        report("LDG stream_read", 4 * sms, graph_us(st, iter, [&](int i) {
            stream_read<<<4 * sms, 256, 0, st>>>(at(i), (long long)(bytes / 16), sink);
        }));
        // cuBLAS as the engine calls it (bf16 in, f32 out, y (+)= W·x for o and down).
        for (int tokens : {16, 64}) {
            const float alpha = 1.f, beta = sh.accumulate ? 1.f : 0.f;
            char way[64];
            snprintf(way, sizeof way, "cuBLAS %d tokens", tokens);
            report(way, 0, graph_us(st, iter, [&](int i) {
                cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.rows, tokens, sh.cols, &alpha, at(i), CUDA_R_16BF, sh.cols, xs,
                             CUDA_R_16BF, sh.cols, &beta, fsink, CUDA_R_32F, sh.rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            }));
        }
        const int rb = sh.rows / ROWS;
        for (int splits : {1, 2, 4, 8}) {
            if (rb * splits > 4 * sms || rb * splits < sms / 2) continue;
            dim3 grid(rb, splits);
            char way[64];
            {
                constexpr int S = 4;  // 65 KiB: 3 blocks per SM
                const int smem = 1024 + S * STAGE_BYTES;
                CK(cudaFuncSetAttribute(read_cp<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                snprintf(way, sizeof way, "cp.async 4 stages s%d", splits);
                report(way, rb * splits, graph_us(st, iter, [&](int i) { read_cp<S><<<grid, 128, smem, st>>>(at(i), sh.cols, sink); }));
            }
            {
                constexpr int S = 8;  // 129 KiB: 1 block per SM
                const int smem = 1024 + S * STAGE_BYTES;
                CK(cudaFuncSetAttribute(read_cp<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                snprintf(way, sizeof way, "cp.async 8 stages s%d", splits);
                report(way, rb * splits, graph_us(st, iter, [&](int i) { read_cp<S><<<grid, 128, smem, st>>>(at(i), sh.cols, sink); }));
            }
            {
                auto run = [&](const char* what, auto kern, int stages, int xn) {
                    const int smem = 1024 + stages * (ROWS + xn) * 128;
                    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    snprintf(way, sizeof way, "%s s%d", what, splits);
                    report(way, rb * splits, graph_us(st, iter, [&](int i) { kern<<<grid, 128, smem, st>>>(at(i), xs, sh.cols, fsink); }));
                };
                run("+X64 mma w0 4st +fixup", read_cpx_fix<64>, 4, 64);
                run("+X16 mma w0 4st +fixup", read_cpx_fix<16>, 4, 16);
                if (splits == 4) {
                    run("+X64 mma w0 4st +part", read_cpx_part, 4, 64);
                    run("+X64 mma w0 4st +cl4 red", read_cpx_cl4, 4, 64);
                }
                run("+X64 4st", read_cpx<4, 64, false, 0>, 4, 64);
                run("+X64 3st", read_cpx<3, 64, false, 0>, 3, 64);
                run("+X64 mma w0 4st", read_cpx<4, 64, true, 0>, 4, 64);
                run("+X64 mma w1 4st", read_cpx<4, 64, true, 1>, 4, 64);
                run("+X64 mma w0 3st", read_cpx<3, 64, true, 0>, 3, 64);
                run("+X16 mma w0 4st", read_cpx<4, 16, true, 0>, 4, 16);
            }
            // One tensor map per cycled copy.
            static CUtensorMap maps[64];
            for (int c = 0; c < copies && c < 64; c++) {
                cuuint64_t dims[2] = {(cuuint64_t)sh.cols, (cuuint64_t)sh.rows};
                cuuint64_t strides[1] = {(cuuint64_t)sh.cols * 2};
                cuuint32_t box[2] = {SLAB, ROWS}, es[2] = {1, 1};
                CUresult r = cuTensorMapEncodeTiled(&maps[c], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)at(c), dims, strides, box, es,
                                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
                if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", (int)r); exit(1); }
            }
            const int nm = copies < 64 ? copies : 64;
            {
                constexpr int S = 4;
                const int smem = 1024 + S * STAGE_BYTES;
                CK(cudaFuncSetAttribute(read_tma<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                snprintf(way, sizeof way, "TMA 4 stages s%d", splits);
                report(way, rb * splits, graph_us(st, iter, [&](int i) { read_tma<S><<<grid, 128, smem, st>>>(maps[i % nm], sh.cols, sink); }));
            }
            {
                constexpr int S = 8;
                const int smem = 1024 + S * STAGE_BYTES;
                CK(cudaFuncSetAttribute(read_tma<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                snprintf(way, sizeof way, "TMA 8 stages s%d", splits);
                report(way, rb * splits, graph_us(st, iter, [&](int i) { read_tma<S><<<grid, 128, smem, st>>>(maps[i % nm], sh.cols, sink); }));
            }
        }
    }
    return 0;
}
