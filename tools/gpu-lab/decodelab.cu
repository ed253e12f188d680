// Decode attention lab (docs/PERF.md, thirteenth session): one query token per sequence
// over a paged f16 KV cache, GQA (the query heads of one KV head in one block), head_dim
// 128, on the engine's cache layout and arguments. Times the engine's decode kernel
// (ops.cu `flash_decode_sa_f16_d128`, the four warps splitting each 64-key tile, the
// query heads as the rows of 16-row MMA tiles: 4 of 16 real for Llama-3-8B) against a
// "keys on M" form written here: per warp S^T = K·Q^T (16 keys as M, up to 8 query heads
// as N: half of the N=8 tile real instead of a quarter of M=16) and O^T += V^T·P^T
// (head_dim as M), P^T turned from S^T's accumulator layout into the B operand by
// movmatrix.trans, so a tile costs half the MMAs, half the accumulators (32 floats of O
// per thread instead of 64) and half the exponentials. Both with key splits 1–4 (+ the
// engine's merge kernel) and checked against a plain f32 reference. Batch 64 at 1k
// context reads 8.7 GB of KV per step; the engine's kernel ran at ~3.0 TB/s there.
// Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/decodelab.cu -o decodelab && ./decodelab [batch ctx]
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#include "../../kernels/src/cuda/ops.cu"
#include "graph_time.h"

// The transpose of an 8×8 b16 matrix held in the MMA fragment layout (lane T: row T/4,
// columns 2(T%4), 2(T%4)+1), in the same layout.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

#define KM_KEYS 64
#define KM_ST (128 + 8)  // shared row stride in halves (conflict-free ldmatrix)
#define KM_SMEM_BYTES(STAGES) ((STAGES) * 2 * KM_KEYS * KM_ST * 2)

// Grid (tiles, KV heads, splits) and arguments as the engine's flash kernels (decode:
// each tile one token, `tile` = [row, 1, position, table offset]); 128 threads; group
// n_heads / n_kv ≤ 8. Keys past the end read as zeros and are masked.
template <int STAGES>
__global__ void __launch_bounds__(128) decode_km_f16_d128(const float* qkv, const unsigned short* cache, long long half,
                                                          const int* tiles, const unsigned int* tables, int n_heads,
                                                          int n_kv, int block_size, float scale, const int* max_ctx,
                                                          float* out, float* part) {
    constexpr int HD = 128, KS = HD / 16, DT = HD / 16, CH = HD / 8, KPP = 128 / CH, PASSES = KM_KEYS / KPP;
    constexpr unsigned KBYTES = KM_KEYS * KM_ST * 2, STAGE_BYTES = 2 * KBYTES;
    extern __shared__ __align__(16) unsigned char km_smem[];
    const unsigned base = smem_u32(km_smem);
    const int* tile = tiles + 4 * blockIdx.x;
    const int row0 = tile[0], pos0 = tile[2];
    const unsigned int* table = tables + tile[3];
    const int kvh = blockIdx.y, grp = n_heads / n_kv, z = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int w = (n_heads + 2 * n_kv) * HD;
    const float qs = scale * 1.4426950408889634f;
    // Q^T as B fragments (k = dims, n = heads): b0 = dims 16ks + 2t4, +1 of head g; b1 = +8.
    unsigned qf[KS][2];
    {
        const bool real = g < grp;
        const float* q = qkv + (size_t)row0 * w + (kvh * grp + (real ? g : 0)) * HD;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const int c0 = 16 * ks + 2 * t4;
            qf[ks][0] = real ? pack_f16x2(q[c0] * qs, q[c0 + 1] * qs) : 0u;
            qf[ks][1] = real ? pack_f16x2(q[c0 + 8] * qs, q[c0 + 9] * qs) : 0u;
        }
    }
    // O^T accumulators: o[dt][0] dim 16dt + g, head 2t4; [1] head 2t4 + 1; [2], [3] dim + 8.
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // heads 2t4, 2t4 + 1 (this warp's keys)
    int k0 = 0, k1 = pos0 + 1;
    if (splits > 1) {
        const int chunk = ((max_ctx[0] + splits - 1) / splits + KM_KEYS - 1) / KM_KEYS * KM_KEYS;
        k0 = z * chunk;
        k1 = min(k1, k0 + chunk);
    }
    // Lean loads as the engine's: a thread keeps one 16-byte column and steps over keys.
    const int my_c = (threadIdx.x % CH) * 8, my_key = threadIdx.x / CH;
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    const unsigned short* my_src = cache + (size_t)kvh * block_size * HD + my_c;
    const size_t blk_stride = (size_t)n_kv * block_size * HD;
    auto load_tile = [&](int kb, int st) {
        if (kb < k1) {
            const unsigned at = base + st * STAGE_BYTES + (my_key * KM_ST + my_c) * 2;
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int j = kb + my_key + p * KPP;
                const unsigned short* src = cache;
                int bytes = 0;
                if (j < k1) {
                    const int bi = bs_pow2 ? j >> bs_shift : j / block_size;
                    src = my_src + table[bi] * blk_stride + (size_t)(j - bi * block_size) * HD;
                    bytes = 16;
                }
                cp_async16_at(at + p * KPP * KM_ST * 2, src, bytes);
                cp_async16_at(at + KBYTES + p * KPP * KM_ST * 2, bytes ? src + half : cache, bytes);
            }
        }
        cp_async_commit();
    };
    const int ntiles = k1 > k0 ? (k1 - k0 + KM_KEYS - 1) / KM_KEYS : 0;
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) load_tile(k0 + i * KM_KEYS, i);
    for (int i = 0; i < ntiles; i++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile i staged by all; tile i − 1's stage free
        load_tile(k0 + (i + STAGES - 1) * KM_KEYS, (i + STAGES - 1) % STAGES);
        const int kw = k0 + i * KM_KEYS + 16 * warp;  // this warp's first key
        if (kw >= k1) continue;
        const unsigned ks_at = base + (i % STAGES) * STAGE_BYTES, vs_at = ks_at + KBYTES;
        // S^T (16 keys × 8 heads) = K · Q^T: A = K rows by ldmatrix.
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        const unsigned a_row = ks_at + ((16 * warp + (lane & 15)) * KM_ST + 8 * (lane >> 4)) * 2;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            unsigned a[4];
            ldsm_x4_at<false>(a[0], a[1], a[2], a[3], a_row + 32 * ks);
            mma_f16_16816(s, a, qf[ks][0], qf[ks][1]);
        }
        // s[0]: key kw + g, head 2t4; s[1]: head 2t4 + 1; s[2], s[3]: key kw + g + 8.
        if (kw + 16 > k1) {
            if (kw + g >= k1) s[0] = s[1] = NEG_INF;
            if (kw + g + 8 >= k1) s[2] = s[3] = NEG_INF;
        }
        float x0 = fmaxf(s[0], s[2]), x1 = fmaxf(s[1], s[3]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
        }
        // Key kw is real, so the new maxima are finite.
        const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
        const float c0 = fa_exp2<true>(m0 - n0), c1 = fa_exp2<true>(m1 - n1);
        m0 = n0, m1 = n1;
        const float p0 = fa_exp2<true>(s[0] - n0), p1 = fa_exp2<true>(s[1] - n1);
        const float p2 = fa_exp2<true>(s[2] - n0), p3 = fa_exp2<true>(s[3] - n1);
        l0 = l0 * c0 + p0 + p2;
        l1 = l1 * c1 + p1 + p3;
#pragma unroll
        for (int d = 0; d < DT; d++) {
            o[d][0] *= c0, o[d][1] *= c1, o[d][2] *= c0, o[d][3] *= c1;
        }
        // P^T as B fragments (k = keys, n = heads): the transposes of the 8×8 matrices
        // (keys 0–7 | 8–15) × heads that S^T's accumulators hold.
        const unsigned b0 = movmatrix_trans(pack_f16x2(p0, p1)), b1 = movmatrix_trans(pack_f16x2(p2, p3));
        // O^T (dims × heads) += V^T · P^T: A = V^T by ldmatrix.trans of the V rows.
        const unsigned v_row =
            vs_at + ((16 * warp + (lane & 7) + ((lane >> 4) << 3)) * KM_ST + 8 * ((lane >> 3) & 1)) * 2;
#pragma unroll
        for (int d = 0; d < DT; d++) {
            unsigned a[4];
            ldsm_x4_at<true>(a[0], a[1], a[2], a[3], v_row + 32 * d);
            mma_f16_16816(o[d], a, b0, b1);
        }
    }
    // This warp's sums over its keys: add the lanes of each head column.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages are done with: the warps' parts go there
    constexpr int RS = HD + 4;
    float* ro = reinterpret_cast<float*>(km_smem);  // [warp][head][RS]
    float* ml = ro + 4 * 8 * RS;                    // [warp][head][2]
    float* mine = ro + warp * 8 * RS;
#pragma unroll
    for (int d = 0; d < DT; d++) {
        mine[(2 * t4) * RS + 16 * d + g] = o[d][0];
        mine[(2 * t4 + 1) * RS + 16 * d + g] = o[d][1];
        mine[(2 * t4) * RS + 16 * d + g + 8] = o[d][2];
        mine[(2 * t4 + 1) * RS + 16 * d + g + 8] = o[d][3];
    }
    if (g == 0) {
        ml[(warp * 8 + 2 * t4) * 2] = m0;
        ml[(warp * 8 + 2 * t4) * 2 + 1] = l0;
        ml[(warp * 8 + 2 * t4 + 1) * 2] = m1;
        ml[(warp * 8 + 2 * t4 + 1) * 2 + 1] = l1;
    }
    __syncthreads();
    constexpr int C4 = HD / 4;
    for (int i = threadIdx.x; i < grp * C4; i += blockDim.x) {
        const int hh = i / C4, c = (i % C4) * 4;
        float M = NEG_INF;
#pragma unroll
        for (int v = 0; v < 4; v++) M = fmaxf(M, ml[(v * 8 + hh) * 2]);
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        float L = 0.f;
#pragma unroll
        for (int v = 0; v < 4; v++) {
            const float mv = ml[(v * 8 + hh) * 2];
            const float wv = mv == NEG_INF ? 0.f : fa_exp2<true>(mv - M);
            L += wv * ml[(v * 8 + hh) * 2 + 1];
            const float4 x = *reinterpret_cast<const float4*>(&ro[(v * 8 + hh) * RS + c]);
            a.x += wv * x.x, a.y += wv * x.y, a.z += wv * x.z, a.w += wv * x.w;
        }
        const int h = kvh * grp + hh;
        if (splits == 1) {
            *reinterpret_cast<float4*>(&out[(size_t)row0 * n_heads * HD + h * HD + c]) =
                make_float4(a.x / L, a.y / L, a.z / L, a.w / L);
        } else {
            float* pp = part + ((size_t)(row0 * n_heads + h) * splits + z) * (HD + 2);
            if (c == 0) {
                pp[0] = M * 0.6931471805599453f;
                pp[1] = L;
            }
            *reinterpret_cast<float2*>(&pp[2 + c]) = make_float2(a.x, a.y);
            *reinterpret_cast<float2*>(&pp[2 + c + 2]) = make_float2(a.z, a.w);
        }
    }
}

// Plain f32 reference: one block per (sequence, query head), scores in shared memory.
__global__ void decode_ref(const float* qkv, const unsigned short* cache, long long half, const int* tiles,
                           const unsigned int* tables, int n_heads, int n_kv, int block_size, float scale, float* out) {
    constexpr int HD = 128;
    extern __shared__ float sc[];
    const int b = blockIdx.x, h = blockIdx.y, kvh = h / (n_heads / n_kv);
    const int* tile = tiles + 4 * b;
    const int row0 = tile[0], ctx = tile[2] + 1;
    const unsigned int* table = tables + tile[3];
    const float* q = qkv + (size_t)row0 * (n_heads + 2 * n_kv) * HD + h * HD;
    auto at = [&](int j) { return (((size_t)table[j / block_size] * n_kv + kvh) * block_size + j % block_size) * HD; };
    for (int j = threadIdx.x; j < ctx; j += blockDim.x) {
        float s = 0.f;
        for (int d = 0; d < HD; d++) s += q[d] * f16_to_f32(cache[at(j) + d]);
        sc[j] = s * scale;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int j = 0; j < ctx; j++) mx = fmaxf(mx, sc[j]);
    float l = 0.f;
    for (int j = 0; j < ctx; j++) l += expf(sc[j] - mx);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.f;
        for (int j = 0; j < ctx; j++) a += expf(sc[j] - mx) * f16_to_f32(cache[half + at(j) + d]);
        out[(size_t)row0 * n_heads * HD + h * HD + d] = a / l;
    }
}

// f32 → f16 bits, round to nearest even (normal and zero values: the cache holds [-1, 1]).
static unsigned short f32_to_f16_host(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    const unsigned sign = (u >> 16) & 0x8000u;
    const int e = (int)((u >> 23) & 0xff) - 127 + 15;
    if (e <= 0) return (unsigned short)sign;  // below f16's normal range: zero
    unsigned m = u & 0x7fffffu, r = m >> 13;
    const unsigned rest = m & 0x1fffu;
    unsigned h = sign | ((unsigned)e << 10) | r;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1))) h++;
    return (unsigned short)h;
}

typedef void (*AttnFn)(const float*, const unsigned short*, long long, const int*, const unsigned int*, int, int, int,
                       float, const int*, float*, float*, int);
typedef void (*KmFn)(const float*, const unsigned short*, long long, const int*, const unsigned int*, int, int, int,
                     float, const int*, float*, float*);

int main(int argc, char** argv) {
    const int B = argc > 1 ? atoi(argv[1]) : 64, CTX = argc > 2 ? atoi(argv[2]) : 1024;
    const int NH = 32, NKV = 8, HD = 128, BS = 16, W = (NH + 2 * NKV) * HD;
    const int nb = (CTX + BS - 1) / BS, blocks = B * nb;
    const long long half = (long long)blocks * NKV * BS * HD;
    printf("batch %d, context %d, %d/%d heads, head_dim %d, blocks of %d: %.2f GB of KV per layer step\n", B, CTX, NH,
           NKV, HD, BS, 2.0 * B * CTX * NKV * HD * 2 / 1e9);
    unsigned short* cache; CK(cudaMalloc(&cache, 2 * half * 2));
    {
        std::vector<unsigned short> h(2 * half);
        unsigned s = 3;
        for (auto& v : h) { s = s * 1664525u + 1013904223u; v = f32_to_f16_host(((s >> 8) / 16777216.f) * 2 - 1); }
        CK(cudaMemcpy(cache, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
    float* qkv; CK(cudaMalloc(&qkv, (size_t)B * W * 4));
    {
        std::vector<float> h((size_t)B * W);
        unsigned s = 5;
        for (auto& v : h) { s = s * 1664525u + 1013904223u; v = (((s >> 8) / 16777216.f) * 2 - 1) * 2.f; }
        CK(cudaMemcpy(qkv, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    // Tiles and block tables: each sequence's blocks a shuffled slice of the cache.
    std::vector<int> tiles(4 * B);
    std::vector<unsigned> tables(blocks);
    for (int i = 0; i < blocks; i++) tables[i] = i;
    { unsigned s = 9; for (int i = blocks - 1; i > 0; i--) { s = s * 1664525u + 1013904223u; std::swap(tables[i], tables[(s >> 8) % (i + 1)]); } }
    for (int b = 0; b < B; b++) tiles[4 * b] = b, tiles[4 * b + 1] = 1, tiles[4 * b + 2] = CTX - 1, tiles[4 * b + 3] = b * nb;
    int *dtiles, *dmax; unsigned* dtables;
    CK(cudaMalloc(&dtiles, tiles.size() * 4)); CK(cudaMalloc(&dtables, tables.size() * 4)); CK(cudaMalloc(&dmax, 4));
    CK(cudaMemcpy(dtiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dtables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dmax, &CTX, 4, cudaMemcpyHostToDevice));
    const size_t on = (size_t)B * NH * HD;
    float *out, *ref, *part; CK(cudaMalloc(&out, on * 4)); CK(cudaMalloc(&ref, on * 4)); CK(cudaMalloc(&part, on / HD * 8 * (HD + 2) * 4));
    const float scale = 1.f / sqrtf((float)HD);
    CK(cudaFuncSetAttribute(decode_ref, cudaFuncAttributeMaxDynamicSharedMemorySize, CTX * 4));
    decode_ref<<<dim3(B, NH), 128, CTX * 4>>>(qkv, cache, half, dtiles, dtables, NH, NKV, BS, scale, ref);
    CK(cudaDeviceSynchronize());
    std::vector<float> href(on), hout(on);
    CK(cudaMemcpy(href.data(), ref, on * 4, cudaMemcpyDeviceToHost));
    float rmax = 0; for (float v : href) rmax = std::max(rmax, fabsf(v));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    const int ITER = 20;
    const int flags = FLASH_LEAN_LOADS | FLASH_WIDE_MERGE | FLASH_PAIR_LOADS;
    // One layer's attention (+ the merge when split); µs per call, replayed from a graph.
    auto time = [&](auto f) { return graph_us(st, ITER, [&](int) { f(); }); };
    auto err = [&]() {
        CK(cudaMemcpy(hout.data(), out, on * 4, cudaMemcpyDeviceToHost));
        double md = 0; for (size_t i = 0; i < on; i++) md = std::max(md, (double)fabsf(hout[i] - href[i]));
        return md / rmax;
    };
    const double gb = 2.0 * B * CTX * NKV * HD * 2 / 1e9;
    auto report = [&](const char* name, int splits, float us, double e) {
        printf("  %-26s splits %d: %8.2f us  %6.0f GB/s  err %.2e%s\n", name, splits, us, gb / us * 1e6, e, e > 5e-3 ? " BAD" : "");
    };
    // The engine's kernel.
    AttnFn eng = flash_decode_sa_f16_d128;
    CK(cudaFuncSetAttribute(eng, cudaFuncAttributeMaxDynamicSharedMemorySize, FA_SMEM_BYTES(128)));
    for (int sp = 1; sp <= 4; sp++) {
        auto f = [&]() {
            eng<<<dim3(B, NKV, sp), 128, FA_SMEM_BYTES(128), st>>>(qkv, cache, half, dtiles, dtables, NH, NKV, BS, scale, dmax, out, part, flags);
            if (sp > 1) attention_merge<<<dim3(B, NH), 128, 0, st>>>(part, sp, NH, HD, out);
        };
        CK(cudaMemset(out, 0, on * 4));
        f(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
        const double e = err();
        report("engine flash_decode_sa", sp, time(f), e);
    }
    // Keys on M, 2–4 stages.
    KmFn km[3] = {decode_km_f16_d128<2>, decode_km_f16_d128<3>, decode_km_f16_d128<4>};
    for (int si = 0; si < 3; si++) {
        const int smem = KM_SMEM_BYTES(si + 2);
        CK(cudaFuncSetAttribute(km[si], cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int occ = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, km[si], 128, smem));
        char name[64]; snprintf(name, sizeof name, "keys-on-M %d stages (%d/SM)", si + 2, occ);
        for (int sp = 1; sp <= 4; sp++) {
            auto f = [&]() {
                km[si]<<<dim3(B, NKV, sp), 128, smem, st>>>(qkv, cache, half, dtiles, dtables, NH, NKV, BS, scale, dmax, out, part);
                if (sp > 1) attention_merge<<<dim3(B, NH), 128, 0, st>>>(part, sp, NH, HD, out);
            };
            CK(cudaMemset(out, 0, on * 4));
            f(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
            const double e = err();
            report(name, sp, time(f), e);
        }
    }
}
