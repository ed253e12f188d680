// Element-wise and row-wise kernels of the CUDA backend (f32 activations).
// Compiled by NVRTC at start (kernels/src/cuda/mod.rs); every kernel is tested against
// the CPU op of the same name (kernels/tests/cuda_ops.rs, on the GPU machine).

extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float eps, int dim, float* out) {
    // One block per row; a strided sum of squares, then a block reduction.
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i] * xr[i];
    __shared__ float part[32];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
        if (threadIdx.x == 0) part[0] = s;
    }
    __syncthreads();
    const float scale = rsqrtf(part[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

extern "C" __global__ void silu_mul_rows(const float* gu, int ff, int n, float* out) {
    // gu rows are [g | u] of width 2*ff; out = silu(g) * u.
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * ff) return;
    size_t r = i / ff, c = i % ff;
    float g = gu[r * 2 * ff + c], u = gu[r * 2 * ff + ff + c];
    out[i] = g / (1.f + expf(-g)) * u;
}

extern "C" __global__ void embed_rows(const float* table, const unsigned int* ids, int dim, int n, float* out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * dim) return;
    size_t r = i / dim, c = i % dim;
    out[i] = table[(size_t)ids[r] * dim + c];
}

// ---- The whole model (CudaBackend, kernels/src/cuda/backend.rs) ----
// Half-precision values travel as their bits (unsigned short): conversions are done
// here with PTX (f16) and integer rounding (bf16), so no CUDA headers are needed.

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return (unsigned short)((u >> 16) | ((u & 0xffff) ? 0x40 : 0));
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}

// Cache element access: f16 bits or f32.
__device__ __forceinline__ float kv_load(const unsigned short* p, size_t i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float kv_load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ void kv_store(unsigned short* p, size_t i, float v) { p[i] = f32_to_f16(v); }
__device__ __forceinline__ void kv_store(float* p, size_t i, float v) { p[i] = v; }

extern "C" __global__ void embed_rows_bf16(const unsigned short* table, const unsigned int* ids, int dim, int n, float* out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * dim) return;
    size_t r = i / dim, c = i % dim;
    out[i] = bf16_to_f32(table[(size_t)ids[r] * dim + c]);
}

extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void gather_rows(const float* x, const unsigned int* rows, int dim, int n, float* out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * dim) return;
    size_t r = i / dim, c = i % dim;
    out[i] = x[(size_t)rows[r] * dim + c];
}

// RoPE on q and k of each token's fused [q|k|v] row (in place), then k and v into the
// cache at the token's slot. One block per token. cos/sin: [token][head_dim/2], made on
// the host exactly as the CPU backend makes them. Layer cache: keys
// [block][kv_head][slot][head_dim] for all blocks, then values the same (`half` elements
// further).
template <typename T>
__device__ void rope_write_kv_impl(float* qkv, const float* cos_t, const float* sin_t, const long long* slots,
                                   int n_heads, int n_kv, int hd, int interleaved, int block_size, T* cache,
                                   long long half) {
    const int t = blockIdx.x;
    const int w = (n_heads + 2 * n_kv) * hd;
    float* row = qkv + (size_t)t * w;
    const int hh = hd / 2;
    const float* c = cos_t + (size_t)t * hh;
    const float* s = sin_t + (size_t)t * hh;
    for (int i = threadIdx.x; i < (n_heads + n_kv) * hh; i += blockDim.x) {
        const int h = i / hh, j = i % hh;
        const int a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + hh;
        float* x = row + h * hd;
        const float x0 = x[a], x1 = x[b];
        x[a] = x0 * c[j] - x1 * s[j];
        x[b] = x0 * s[j] + x1 * c[j];
    }
    __syncthreads();
    const long long slot = slots[t];
    const long long block = slot / block_size, off = slot % block_size;
    const float* k = row + n_heads * hd;
    const float* v = k + n_kv * hd;
    for (int i = threadIdx.x; i < n_kv * hd; i += blockDim.x) {
        const int h = i / hd, d = i % hd;
        const size_t at = (size_t)(((block * n_kv + h) * block_size + off) * hd + d);
        kv_store(cache, at, k[i]);
        kv_store(cache, (size_t)half + at, v[i]);
    }
}

extern "C" __global__ void rope_write_kv_f16(float* qkv, const float* cos_t, const float* sin_t, const long long* slots,
                                             int n_heads, int n_kv, int hd, int interleaved, int block_size,
                                             unsigned short* cache, long long half) {
    rope_write_kv_impl(qkv, cos_t, sin_t, slots, n_heads, n_kv, hd, interleaved, block_size, cache, half);
}
extern "C" __global__ void rope_write_kv_f32(float* qkv, const float* cos_t, const float* sin_t, const long long* slots,
                                             int n_heads, int n_kv, int hd, int interleaved, int block_size,
                                             float* cache, long long half) {
    rope_write_kv_impl(qkv, cos_t, sin_t, slots, n_heads, n_kv, hd, interleaved, block_size, cache, half);
}

// Causal attention over the paged cache: one block of ATT_WARPS warps per (token, query
// head[, key chunk]). Token t sits at position pos[t] of its sequence, whose block table
// starts at tables[table_off[t]]; it attends to positions 0..=pos[t]. Each warp takes
// every ATT_WARPS-th key with an online softmax (lanes split head_dim); the warps are
// merged at the end. With SPLIT (flash-decoding, for batches of few tokens and long
// contexts), block z takes keys [z·chunk, (z+1)·chunk) and writes its unnormalised
// partial (max, sum, acc[head_dim]) for attention_merge. head_dim ≤ 256.
#define ATT_WARPS 8
#define NEG_INF __int_as_float(0xff800000)
template <typename T, bool SPLIT>
__device__ void attention_impl(const float* qkv, const T* cache, long long half, const int* pos, const int* table_off,
                               const unsigned int* tables, int n_heads, int n_kv, int hd, int block_size, float scale,
                               int chunk, float* out) {
    const int t = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int w = (n_heads + 2 * n_kv) * hd;
    const int kvh = h / (n_heads / n_kv);
    const float* q = qkv + (size_t)t * w + h * hd;
    const int per = (hd + 31) / 32;  // ≤ 8
    float qv[8], acc[8];
    for (int e = 0; e < per; e++) {
        const int d = lane + 32 * e;
        qv[e] = d < hd ? q[d] : 0.f;
        acc[e] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const int n = pos[t] + 1;
    const int j0 = SPLIT ? z * chunk : 0;
    const int j1 = SPLIT ? min(n, j0 + chunk) : n;
    const unsigned int* table = tables + table_off[t];
    for (int j = j0 + warp; j < j1; j += ATT_WARPS) {
        const long long block = table[j / block_size], off = j % block_size;
        const size_t base = (size_t)(((block * n_kv + kvh) * block_size + off) * hd);
        float sdot = 0.f;
        for (int e = 0; e < per; e++) {
            const int d = lane + 32 * e;
            if (d < hd) sdot += qv[e] * kv_load(cache, base + d);
        }
        for (int o = 16; o > 0; o >>= 1) sdot += __shfl_xor_sync(0xffffffff, sdot, o);
        const float sc = sdot * scale;
        const float m2 = fmaxf(m, sc);
        const float a = expf(m - m2), p = expf(sc - m2);
        l = l * a + p;
        for (int e = 0; e < per; e++) {
            const int d = lane + 32 * e;
            acc[e] = acc[e] * a + (d < hd ? p * kv_load(cache, (size_t)half + base + d) : 0.f);
        }
        m = m2;
    }
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], sacc[ATT_WARPS][256];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    for (int e = 0; e < per; e++) {
        const int d = lane + 32 * e;
        if (d < hd) sacc[warp][d] = acc[e];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int k = 0; k < ATT_WARPS; k++) M = fmaxf(M, sm[k]);
    float L = 0.f;
    for (int k = 0; k < ATT_WARPS; k++) L += sm[k] == NEG_INF ? 0.f : sl[k] * expf(sm[k] - M);
    if (SPLIT) {
        // Partial z of (t, h): [M, L, acc[hd]] (acc relative to M, not normalised).
        float* o = out + ((size_t)(t * n_heads + h) * gridDim.z + z) * (hd + 2);
        if (threadIdx.x == 0) {
            o[0] = M;
            o[1] = L;
        }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float s = 0.f;
            for (int k = 0; k < ATT_WARPS; k++) s += sm[k] == NEG_INF ? 0.f : sacc[k][d] * expf(sm[k] - M);
            o[2 + d] = s;
        }
    } else {
        float* o = out + (size_t)t * n_heads * hd + h * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float s = 0.f;
            for (int k = 0; k < ATT_WARPS; k++) s += sm[k] == NEG_INF ? 0.f : sacc[k][d] * expf(sm[k] - M);
            o[d] = s / L;
        }
    }
}

#define ATTENTION_ARGS const float* qkv, const T_* cache, long long half, const int* pos, const int* table_off, \
    const unsigned int* tables, int n_heads, int n_kv, int hd, int block_size, float scale, int chunk, float* out
#define ATTENTION_CALL qkv, cache, half, pos, table_off, tables, n_heads, n_kv, hd, block_size, scale, chunk, out
#define T_ unsigned short
extern "C" __global__ void attention_f16(ATTENTION_ARGS) { attention_impl<T_, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_split_f16(ATTENTION_ARGS) { attention_impl<T_, true>(ATTENTION_CALL); }
#undef T_
#define T_ float
extern "C" __global__ void attention_f32(ATTENTION_ARGS) { attention_impl<T_, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_split_f32(ATTENTION_ARGS) { attention_impl<T_, true>(ATTENTION_CALL); }
#undef T_

// Merges the key-chunk partials of attention_split_*: one block per (token, head).
extern "C" __global__ void attention_merge(const float* part, int splits, int n_heads, int hd, float* out) {
    const int t = blockIdx.x, h = blockIdx.y;
    const float* p = part + (size_t)(t * n_heads + h) * splits * (hd + 2);
    float M = NEG_INF;
    for (int z = 0; z < splits; z++) M = fmaxf(M, p[z * (hd + 2)]);
    float L = 0.f;
    for (int z = 0; z < splits; z++) {
        const float mz = p[z * (hd + 2)];
        if (mz != NEG_INF) L += p[z * (hd + 2) + 1] * expf(mz - M);
    }
    float* o = out + (size_t)t * n_heads * hd + h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.f;
        for (int z = 0; z < splits; z++) {
            const float mz = p[z * (hd + 2)];
            if (mz != NEG_INF) s += p[z * (hd + 2) + 2 + d] * expf(mz - M);
        }
        o[d] = s / L;
    }
}

// The warp's largest (value, index), the lowest index among equal values, in every lane.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffff, bv, o);
        const int i2 = __shfl_xor_sync(0xffffffff, bi, o);
        if (v2 > bv || (v2 == bv && i2 < bi)) {
            bv = v2;
            bi = i2;
        }
    }
}

// Greedy sampling on the device: out[r] = the first index of the largest value of row r
// (NaN never wins; a row of -inf gives 0), as engine::sampling::argmax. One block per row.
extern "C" __global__ void argmax_rows(const float* x, int dim, unsigned int* out) {
    const float* row = x + (size_t)blockIdx.x * dim;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = row[i];
        if (v > bv) {  // strided ascending: the first maximum of this thread's elements
            bv = v;
            bi = i;
        }
    }
    warp_argmax(bv, bi);
    __shared__ float sv[32];
    __shared__ int si[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
        warp_argmax(bv, bi);
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0u : (unsigned int)bi;
    }
}
