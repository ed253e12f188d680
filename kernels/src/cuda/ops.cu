// Element-wise and row-wise kernels of the CUDA backend (f32 activations).
// Compiled by NVRTC at start (kernels/src/cuda/mod.rs); every kernel is tested against
// the CPU op of the same name (kernels/tests/cuda_ops.rs, on the GPU machine).

// Programmatic dependent launch (sm_90+; the backend's DISAGG_CUDA_PDL): a kernel launched
// with it is scheduled as the kernel before it on the stream ends, before that kernel's
// writes are flushed, so its launch and its first loads of weights overlap that end.
// pdl_wait blocks until the kernel before has finished and its writes are visible; every
// kernel the backend launches that way calls it before it touches memory that another
// kernel writes (reading only weights before it). By default no kernel lets the next one
// start earlier (griddepcontrol.launch_dependents): blocks of the next kernel then took SMs
// while this one still ran, and a decode step at batch 1 was 15% slower (PERF.md); only the
// one-token QKV GEMV can, for A/B runs (pdl_trigger below). Launched without the
// attribute, pdl_wait is a no-op.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// KM_STAMPS (defined only by the gpu-lab programs attnlab.cu and, built with -DKM_STAMPS,
// decodelab.cu; never by the engine's NVRTC build): the GPU's clock at points of the
// keys-on-M decode kernel and of the one-token QKV and residual GEMVs, by each block's
// thread 0, so the lab can see where an attention's microseconds go. Otherwise the stamps
// are nothing. A keys-on-M block's row: its index in the grid, (x · gridDim.z + z) ·
// gridDim.y + y (at batch 1, z · gridDim.y + y), plus KM_STAMP_ROWS / 2 for a second launch.
#ifdef KM_STAMPS
#define KM_STAMP_ROWS 8192
__device__ unsigned long long km_stamps[KM_STAMP_ROWS][8];
__device__ unsigned long long gemv_stamps[3][1024][2];
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// (flags bit 30: a second launch in the same layer, stamped from row KM_STAMP_ROWS / 2 on.)
// Column 7 of the row: the SM the block ran on (written with stamp 0).
#define KM_STAMP(i) \
    do { \
        if (threadIdx.x == 0) { \
            unsigned long long* km_row = \
                km_stamps[((flags >> 30) & 1) * (KM_STAMP_ROWS / 2) + \
                          ((blockIdx.x * gridDim.z + blockIdx.z) * gridDim.y + blockIdx.y) % (KM_STAMP_ROWS / 2)]; \
            km_row[i] = globaltimer(); \
            if ((i) == 0) { \
                unsigned km_sm; \
                asm volatile("mov.u32 %0, %%smid;" : "=r"(km_sm)); \
                km_row[7] = km_sm; \
            } \
        } \
    } while (0)
#define GEMV_STAMP(epi, i) \
    do { \
        if (threadIdx.x == 0) gemv_stamps[epi][blockIdx.x % 1024][i] = globaltimer(); \
    } while (0)
#else
#define KM_STAMP(i)
#define GEMV_STAMP(epi, i)
#endif

// Lets the next kernel, launched programmatically, be scheduled before this one ends (its
// blocks take SMs where room is left and run up to their pdl_wait). Only the one-token
// QKV GEMV has it, by request (`RopeKv::trigger`).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float eps, int dim, float* out) {
    pdl_wait();
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

// silu(g) · u, as the CPU's silu_mul_rows.
__device__ __forceinline__ float silu_gate(float g, float u) { return g / (1.f + expf(-g)) * u; }

extern "C" __global__ void silu_mul_rows(const float* gu, int ff, int n, float* out) {
    pdl_wait();
    // gu rows are [g | u] of width 2*ff; out = silu(g) * u.
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * ff) return;
    size_t r = i / ff, c = i % ff;
    float g = gu[r * 2 * ff + c], u = gu[r * 2 * ff + ff + c];
    out[i] = silu_gate(g, u);
}

// The same over (row, 4 columns) per thread, grid (⌈ff / 1024⌉, n): 16-byte accesses and
// no 64-bit division per element (ff a multiple of 4).
extern "C" __global__ void silu_mul_rows4(const float* gu, int ff, float* out) {
    pdl_wait();
    const int r = blockIdx.y, c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c >= ff) return;
    const float4 g = *reinterpret_cast<const float4*>(gu + (size_t)r * 2 * ff + c);
    const float4 u = *reinterpret_cast<const float4*>(gu + (size_t)r * 2 * ff + ff + c);
    float4 o;
    o.x = silu_gate(g.x, u.x);
    o.y = silu_gate(g.y, u.y);
    o.z = silu_gate(g.z, u.z);
    o.w = silu_gate(g.w, u.w);
    *reinterpret_cast<float4*>(out + (size_t)r * ff + c) = o;
}

extern "C" __global__ void embed_rows(const float* table, const unsigned int* ids, int dim, int n, float* out) {
    pdl_wait();
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
// Two values as one word of bf16 (lo in the low half), each rounded as f32_to_bf16;
// and the two halves of such a word.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}
__device__ __forceinline__ float bf16x2_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// Cache element access: f16 bits or f32.
__device__ __forceinline__ float kv_load(const unsigned short* p, size_t i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float kv_load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ void kv_store(unsigned short* p, size_t i, float v) { p[i] = f32_to_f16(v); }
__device__ __forceinline__ void kv_store(float* p, size_t i, float v) { p[i] = v; }
// FP8 E4M3 (the cache's one-byte type, unscaled): stored rounded to nearest even and
// saturated to ±448, as the CPU's f32_to_e4m3; read exactly. The conversions exist from
// sm_89; the backend takes an FP8 cache only there (elsewhere these trap).
__device__ __forceinline__ unsigned short f32_to_e4m3(float v) {
    unsigned short h = 0;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.f), "f"(v));  // v in the low byte
#else
    __trap();
#endif
    return h & 0xff;
}
// Two E4M3 values (the low byte first) as f16x2 (the low half first), exactly.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned short x) {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
#else
    __trap();
#endif
    return r;
}
__device__ __forceinline__ float kv_load(const unsigned char* p, size_t i) {
    return f16_to_f32((unsigned short)(e4m3x2_to_f16x2(p[i]) & 0xffff));
}
__device__ __forceinline__ void kv_store(unsigned char* p, size_t i, float v) { p[i] = (unsigned char)f32_to_e4m3(v); }

// RMSNorm of a row straight to bf16 (the input of a bf16 GEMM): one block of 256 per
// row, each thread's float4s (dim a multiple of 4, ≤ 8192) loaded at once and kept in
// registers for the second pass. Rounding: f32 as rms_norm_rows, then to bf16. With
// `w_first` the thread's norm weights (written before the step) are loaded before the wait
// for the kernel before, not after the row's sum: the same values, one round trip fewer
// after the wait. With `splits` > 0 (splitk_residual_norm_bf16) the row is first finished
// as a residual GEMM split over K: x[row] += part[0][row] + … + part[splits − 1][row] (in
// that order, the slices `pstride` values apart), written back to x, and with `norm` 0 the
// kernel stops there.
#define NORM_BF16_VEC 8
__device__ __forceinline__ void norm_bf16_row(float* x, const float* part, int splits, long long pstride,
                                              const float* w, float eps, int dim, unsigned short* out, int w_first,
                                              int norm) {
    const int n4 = dim / 4;
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4 gw[NORM_BF16_VEC];
    if (w_first && norm)
#pragma unroll
        for (int e = 0; e < NORM_BF16_VEC; e++) {
            const int i = e * 256 + threadIdx.x;
            gw[e] = i < n4 ? w4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    pdl_wait();
    float4* xr = reinterpret_cast<float4*>(x + (size_t)blockIdx.x * dim);
    float4 v[NORM_BF16_VEC];
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < NORM_BF16_VEC; e++) {
        const int i = e * 256 + threadIdx.x;
        v[e] = i < n4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        if (splits > 0 && i < n4) {
            for (int k = 0; k < splits; k++) {
                const float4 p = reinterpret_cast<const float4*>(part + k * pstride + (size_t)blockIdx.x * dim)[i];
                v[e].x += p.x, v[e].y += p.y, v[e].z += p.z, v[e].w += p.w;
            }
            xr[i] = v[e];
        }
        s += v[e].x * v[e].x + v[e].y * v[e].y + v[e].z * v[e].z + v[e].w * v[e].w;
    }
    if (!norm) return;
    __shared__ float part_s[8];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    if ((threadIdx.x & 31) == 0) part_s[threadIdx.x >> 5] = s;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) t += part_s[i];
    const float scale = rsqrtf(t / dim + eps);
    uint2* o = reinterpret_cast<uint2*>(out + (size_t)blockIdx.x * dim);
#pragma unroll
    for (int e = 0; e < NORM_BF16_VEC; e++) {
        const int i = e * 256 + threadIdx.x;
        if (i < n4) {
            const float4 g = w_first ? gw[e] : w4[i];
            const unsigned a = f32_to_bf16(v[e].x * scale * g.x), b = f32_to_bf16(v[e].y * scale * g.y);
            const unsigned c = f32_to_bf16(v[e].z * scale * g.z), d = f32_to_bf16(v[e].w * scale * g.w);
            o[i] = make_uint2(a | (b << 16), c | (d << 16));
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) rms_norm_bf16_rows(const float* x, const float* w, float eps, int dim,
                                                                     unsigned short* out, int w_first) {
    // (x is only read: no splits.)
    norm_bf16_row(const_cast<float*>(x), nullptr, 0, 0, w, eps, dim, out, w_first, 1);
}
// A residual GEMM that the backend split over K into `splits` partials, finished, and with
// `norm` the next RMSNorm of the new rows written as bf16 (as rms_norm_bf16_rows would write
// it from x): one launch for the split-K sum, the residual add and the next norm.
extern "C" __global__ void __launch_bounds__(256) splitk_residual_norm_bf16(const float* part, int splits,
                                                                            long long pstride, float* x, const float* w,
                                                                            float eps, int dim, unsigned short* out,
                                                                            int w_first, int norm) {
    norm_bf16_row(x, part, splits, pstride, w, eps, dim, out, w_first, norm);
}

extern "C" __global__ void embed_rows_bf16(const unsigned short* table, const unsigned int* ids, int dim, int n, float* out) {
    pdl_wait();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * dim) return;
    size_t r = i / dim, c = i % dim;
    out[i] = bf16_to_f32(table[(size_t)ids[r] * dim + c]);
}

extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* y, long long n) {
    pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_bf16(x[i]);
}

// silu_mul_rows4 writing bf16 (the down projection's GEMM input): the same f32 value,
// rounded once as cast_f32_bf16 would round it, without the f32 round trip.
extern "C" __global__ void silu_mul_rows4_bf16(const float* gu, int ff, unsigned short* out) {
    pdl_wait();
    const int r = blockIdx.y, c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c >= ff) return;
    const float4 g = *reinterpret_cast<const float4*>(gu + (size_t)r * 2 * ff + c);
    const float4 u = *reinterpret_cast<const float4*>(gu + (size_t)r * 2 * ff + ff + c);
    uint2 o;
    o.x = pack_bf16x2(silu_gate(g.x, u.x), silu_gate(g.y, u.y));
    o.y = pack_bf16x2(silu_gate(g.z, u.z), silu_gate(g.w, u.w));
    *reinterpret_cast<uint2*>(out + (size_t)r * ff + c) = o;
}

// The same from bf16 gate/up values (a GEMM's bf16 output), 8 columns per thread, grid
// (⌈ff / 2048⌉, n): one 16-byte load of g and of u, one of out (ff a multiple of 8).
extern "C" __global__ void silu_mul_rows8_bf16_bf16(const unsigned short* gu, int ff, unsigned short* out) {
    pdl_wait();
    const int r = blockIdx.y, c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (c >= ff) return;
    const uint4 g = *reinterpret_cast<const uint4*>(gu + (size_t)r * 2 * ff + c);
    const uint4 u = *reinterpret_cast<const uint4*>(gu + (size_t)r * 2 * ff + ff + c);
    const unsigned gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
    unsigned ow[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        ow[i] = pack_bf16x2(silu_gate(bf16x2_lo(gw[i]), bf16x2_lo(uw[i])), silu_gate(bf16x2_hi(gw[i]), bf16x2_hi(uw[i])));
    *reinterpret_cast<uint4*>(out + (size_t)r * ff + c) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
}

extern "C" __global__ void gather_rows(const float* x, const unsigned int* rows, int dim, int n, float* out) {
    pdl_wait();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * dim) return;
    size_t r = i / dim, c = i % dim;
    out[i] = x[(size_t)rows[r] * dim + c];
}

// RoPE's cos and sin at position p, frequency f: the angle in f32, cos/sin in f64 (the
// CPU backend's rounding).
__device__ __forceinline__ void rope_cs(float p, float f, float& c, float& s) {
    double sn, cs;
    sincos((double)(p * f), &sn, &cs);
    c = (float)cs;
    s = (float)sn;
}
// One rotation of the pair (x0, x1), each product and sum rounded on its own (no FMA
// contraction, as the CPU computes it), so every kernel that rotates gives the same bits.
__device__ __forceinline__ void rope_apply(float c, float s, float& x0, float& x1) {
    const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    x0 = y0;
    x1 = y1;
}
// RoPE on q and k of each token's fused [q|k|v] row (in place), then k and v into the
// cache at the token's slot. One block per token. The angles are made here as the CPU
// backend makes them: position × inv_freq rounded to f32, cos/sin in f64, rounded to
// f32. Layer cache: keys [block][kv_head][slot][head_dim] for all blocks, then values
// the same (`half` elements further).
template <typename T>
__device__ void rope_write_kv_impl(float* qkv, const int* pos, const float* inv_freq, const long long* slots,
                                   int n_heads, int n_kv, int hd, int interleaved, int block_size, T* cache,
                                   long long half) {
    pdl_wait();
    const int t = blockIdx.x;
    const int w = (n_heads + 2 * n_kv) * hd;
    float* row = qkv + (size_t)t * w;
    const int hh = hd / 2;
    __shared__ float c[128], s[128];  // hd ≤ 256
    const float p = (float)pos[t];
    for (int j = threadIdx.x; j < hh; j += blockDim.x) rope_cs(p, inv_freq[j], c[j], s[j]);
    __syncthreads();
    for (int i = threadIdx.x; i < (n_heads + n_kv) * hh; i += blockDim.x) {
        const int h = i / hh, j = i % hh;
        const int a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + hh;
        float* x = row + h * hd;
        float x0 = x[a], x1 = x[b];
        rope_apply(c[j], s[j], x0, x1);
        x[a] = x0;
        x[b] = x1;
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

// One rotation pair (x0, x1) of q or k at position p, frequency f: the one-token QKV
// GEMV's RoPE epilogue; the keys-on-M decode kernel's RoPE, rope_write_kv_impl above and
// the grouped kernels below take the same cos/sin and rotation, so all give the same bits.
__device__ __forceinline__ void rope_rotate(float p, float f, float& x0, float& x1) {
    float c, s;
    rope_cs(p, f, c, s);
    rope_apply(c, s, x0, x1);
}

// The grouped kernel's arguments (below), the last three unused: one launch path for every form.
#define ROPE_ARGS(T) float* qkv, const int* pos, const float* inv_freq, const long long* slots, int n_tokens, int n_heads, \
    int n_kv, int hd, int interleaved, int block_size, T* cache, long long half, float*, int, int
extern "C" __global__ void rope_write_kv_f16(ROPE_ARGS(unsigned short)) {
    rope_write_kv_impl(qkv, pos, inv_freq, slots, n_heads, n_kv, hd, interleaved, block_size, cache, half);
}
extern "C" __global__ void rope_write_kv_f32(ROPE_ARGS(float)) {
    rope_write_kv_impl(qkv, pos, inv_freq, slots, n_heads, n_kv, hd, interleaved, block_size, cache, half);
}
extern "C" __global__ void rope_write_kv_fp8(ROPE_ARGS(unsigned char)) {
    rope_write_kv_impl(qkv, pos, inv_freq, slots, n_heads, n_kv, hd, interleaved, block_size, cache, half);
}
// RoPE + KV write with one thread per (token, group of heads, pair j): the thread loads
// pair j of each head of its group (a group of q heads, or of KV heads with v's elements at
// the same two places), all the group's loads issued before anything else, so it waits for
// memory once (rope_write_kv_impl walks a token's heads in dependent rounds behind a
// barrier). `group` (1..=ROPE_GROUP_MAX, checked by the backend; the maximum by default) trades threads for loads in
// flight per thread and index arithmetic paid once per group. With WITH_Q
// (`rope_write_kv_groups_*`, 113 registers), q and k are rotated in place in `qkv` as
// rope_write_kv_impl leaves them; without it (`rope_write_k_f16`, 64 registers: the
// warp-specialized attention rotates q as it loads it, FLASH_PP_ROPE_Q) q's groups are not
// launched and `qkv` is only read. Per 8k layer of Llama-3-8B on the H200 (docs/PERF.md):
// k only 27.1 µs against the loop form's 42.7; q and k 106.6 against rope_write_kv_impl's
// 120.5. The token's cos/sin (the same rope_cs) go to `cs` (token t's
// pair j at cs[t·hd + 2j], sin after it) from group 0; with `cs_ready` an earlier layer of
// the step wrote them and they are read instead of made. The rotation and the f16 rounding
// are the same calls as rope_write_kv_impl's, so the bits are too.
#define ROPE_GROUP_MAX 8
// One thread's group: nh heads from x (KV: k heads, v's `vo` floats after them). Loads
// first, then the cos/sin (read from `e`, or made and, with `cs_write`, written there),
// then the rotation and the stores. A template per group kind, so each path holds only
// its own registers (64 for a KV group of 8, no spills). The loads go through the const
// restrict `xl`, `vl` (the 64 registers without q took them); with STORE_X each element
// is stored through `x` only after it was loaded, from the value loaded, and no other
// thread touches it.
template <typename T, bool KV, bool STORE_X>
__device__ __forceinline__ void rope_group_heads(float* __restrict__ x, int nh, int hd, int a, int b, size_t vo,
                                                 float2* e, bool cs_ready, bool cs_write, const int* pos,
                                                 const float* inv_freq, long long slot, int block_size, int n_kv, int h0,
                                                 T* __restrict__ cache, long long half) {
    float x0[ROPE_GROUP_MAX], x1[ROPE_GROUP_MAX], v0[ROPE_GROUP_MAX], v1[ROPE_GROUP_MAX];
    const float* __restrict__ xl = x;
    const float* __restrict__ vl = x + vo;
#pragma unroll
    for (int u = 0; u < ROPE_GROUP_MAX; u++) {
        if (u < nh) {
            x0[u] = xl[u * hd + a];
            x1[u] = xl[u * hd + b];
            if (KV) {
                v0[u] = vl[u * hd + a];
                v1[u] = vl[u * hd + b];
            }
        }
    }
    float c, s;
    if (cs_ready) {
        const float2 q = *e;
        c = q.x;
        s = q.y;
    } else {
        rope_cs((float)*pos, *inv_freq, c, s);
        if (cs_write) *e = make_float2(c, s);
    }
    // KV: head h0 + u's slot at `at` + u · block_size · hd.
    size_t at = 0;
    if (KV) at = (size_t)(((slot / block_size * n_kv + h0) * block_size + slot % block_size) * hd);
#pragma unroll
    for (int u = 0; u < ROPE_GROUP_MAX; u++) {
        if (u < nh) {
            rope_apply(c, s, x0[u], x1[u]);
            if (STORE_X) {
                x[u * hd + a] = x0[u];
                x[u * hd + b] = x1[u];
            }
            if (KV) {
                const size_t h = at + (size_t)u * block_size * hd;
                kv_store(cache, h + a, x0[u]);
                kv_store(cache, h + b, x1[u]);
                kv_store(cache, (size_t)half + h + a, v0[u]);
                kv_store(cache, (size_t)half + h + b, v1[u]);
            }
        }
    }
}
template <typename T, bool WITH_Q>
__device__ void rope_write_kv_groups_impl(float* __restrict__ qkv, const int* pos, const float* inv_freq,
                                          const long long* slots, int n_tokens, int n_heads, int n_kv, int hd,
                                          int interleaved, int block_size, T* __restrict__ cache, long long half,
                                          float* __restrict__ cs, int cs_ready, int group) {
    pdl_wait();
    const int hh = hd / 2;
    const int gq = WITH_Q ? (n_heads + group - 1) / group : 0, groups = gq + (n_kv + group - 1) / group;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tokens * groups * hh) return;
    const int t = (int)(i / ((long long)groups * hh)), r = (int)(i % ((long long)groups * hh));
    const int g = r / hh, j = r % hh;
    const int a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + hh;
    float* row = qkv + (size_t)t * (n_heads + 2 * n_kv) * hd;
    float2* e = reinterpret_cast<float2*>(cs + (size_t)t * hd) + j;
    if (g >= gq) {
        const int h0 = (g - gq) * group;
        float* x = row + (size_t)(n_heads + h0) * hd;
        const int nh = min(group, n_kv - h0);
        const size_t vo = (size_t)n_kv * hd;
        rope_group_heads<T, true, WITH_Q>(x, nh, hd, a, b, vo, e, cs_ready, g == 0, pos + t, inv_freq + j, slots[t],
                                          block_size, n_kv, h0, cache, half);
    } else if (WITH_Q) {
        const int h0 = g * group;
        rope_group_heads<T, false, true>(row + (size_t)h0 * hd, min(group, n_heads - h0), hd, a, b, 0, e, cs_ready,
                                         g == 0, pos + t, inv_freq + j, 0, block_size, n_kv, h0, cache, half);
    }
}
#define ROPE_GROUPS_ARGS(T) float* qkv, const int* pos, const float* inv_freq, const long long* slots, int n_tokens, \
    int n_heads, int n_kv, int hd, int interleaved, int block_size, T* cache, long long half, float* cs, int cs_ready, \
    int group
#define ROPE_GROUPS_CALL qkv, pos, inv_freq, slots, n_tokens, n_heads, n_kv, hd, interleaved, block_size, cache, half, \
    cs, cs_ready, group
extern "C" __global__ void __launch_bounds__(128) rope_write_kv_groups_f16(ROPE_GROUPS_ARGS(unsigned short)) {
    rope_write_kv_groups_impl<unsigned short, true>(ROPE_GROUPS_CALL);
}
extern "C" __global__ void __launch_bounds__(128) rope_write_kv_groups_f32(ROPE_GROUPS_ARGS(float)) {
    rope_write_kv_groups_impl<float, true>(ROPE_GROUPS_CALL);
}
extern "C" __global__ void __launch_bounds__(128) rope_write_kv_groups_fp8(ROPE_GROUPS_ARGS(unsigned char)) {
    rope_write_kv_groups_impl<unsigned char, true>(ROPE_GROUPS_CALL);
}
// Without q (the warp-specialized prefill attention rotates it).
extern "C" __global__ void __launch_bounds__(128) rope_write_k_f16(ROPE_GROUPS_ARGS(unsigned short)) {
    rope_write_kv_groups_impl<unsigned short, false>(ROPE_GROUPS_CALL);
}
#undef ROPE_GROUPS_ARGS
#undef ROPE_GROUPS_CALL
// The k-only form before the grouped kernel (a block per token: the angles, then k, then
// v, each loop's loads one round at a time), for the A/B run of `DISAGG_CUDA_ROPE_K_ROUND=0`
// (it makes the angles in every layer); the grouped kernel's arguments, the last two unused.
extern "C" __global__ void rope_write_k_f16_loops(const float* qkv, const int* pos, const float* inv_freq,
                                                  const long long* slots, int, int n_heads, int n_kv, int hd,
                                                  int interleaved, int block_size, unsigned short* cache,
                                                  long long half, float* cs, int, int) {
    pdl_wait();
    const int t = blockIdx.x;
    const int w = (n_heads + 2 * n_kv) * hd;
    const float* k = qkv + (size_t)t * w + n_heads * hd;
    const float* v = k + n_kv * hd;
    const int hh = hd / 2;
    __shared__ float c[128], s[128];  // hd ≤ 256
    const float p = (float)pos[t];
    for (int j = threadIdx.x; j < hh; j += blockDim.x) {
        rope_cs(p, inv_freq[j], c[j], s[j]);
        cs[(size_t)t * hd + 2 * j] = c[j];
        cs[(size_t)t * hd + 2 * j + 1] = s[j];
    }
    __syncthreads();
    const long long slot = slots[t];
    const long long block = slot / block_size, off = slot % block_size;
    for (int i = threadIdx.x; i < n_kv * hh; i += blockDim.x) {
        const int h = i / hh, j = i % hh;
        const int a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + hh;
        float x0 = k[h * hd + a], x1 = k[h * hd + b];
        rope_apply(c[j], s[j], x0, x1);
        const size_t at = (size_t)(((block * n_kv + h) * block_size + off) * hd);
        kv_store(cache, at + a, x0);
        kv_store(cache, at + b, x1);
    }
    for (int i = threadIdx.x; i < n_kv * hd; i += blockDim.x) {
        const int h = i / hd, d = i % hd;
        kv_store(cache, (size_t)half + (size_t)(((block * n_kv + h) * block_size + off) * hd + d), v[i]);
    }
}
#undef ROPE_ARGS

// Causal attention over the paged cache: one block of ATT_WARPS warps per (token, query
// head[, key chunk]). Token t sits at position pos[t] of its sequence, whose block table
// starts at tables[table_off[t]]; it attends to positions 0..=pos[t]. Each warp takes
// every ATT_WARPS-th key with an online softmax (lanes split head_dim); the warps are
// merged at the end. With SPLIT (flash-decoding: the backend splits when that fills the
// waves of resident blocks better), block z takes keys [z·chunk, (z+1)·chunk), chunk = ⌈max_ctx / splits⌉, and writes its unnormalised
// partial (max, sum, acc[head_dim]) for attention_merge. head_dim ≤ 256.
#define ATT_WARPS 8
#define NEG_INF __int_as_float(0xff800000)
template <typename T, bool SPLIT>
__device__ void attention_impl(const float* qkv, const T* cache, long long half, const int* pos, const int* table_off,
                               const unsigned int* tables, int n_heads, int n_kv, int hd, int block_size, float scale,
                               const int* max_ctx, float* out) {
    pdl_wait();
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
    // Keys per split, from the step's longest context (on the device, so a captured
    // graph replays correctly as contexts grow).
    const int chunk = SPLIT ? (max_ctx[0] + gridDim.z - 1) / gridDim.z : 0;
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
    const unsigned int* tables, int n_heads, int n_kv, int hd, int block_size, float scale, const int* max_ctx, float* out
#define ATTENTION_CALL qkv, cache, half, pos, table_off, tables, n_heads, n_kv, hd, block_size, scale, max_ctx, out
#define T_ unsigned short
extern "C" __global__ void attention_f16(ATTENTION_ARGS) { attention_impl<T_, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_split_f16(ATTENTION_ARGS) { attention_impl<T_, true>(ATTENTION_CALL); }
#undef T_
#define T_ float
extern "C" __global__ void attention_f32(ATTENTION_ARGS) { attention_impl<T_, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_split_f32(ATTENTION_ARGS) { attention_impl<T_, true>(ATTENTION_CALL); }
#undef T_
#define T_ unsigned char
extern "C" __global__ void attention_fp8(ATTENTION_ARGS) { attention_impl<T_, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_split_fp8(ATTENTION_ARGS) { attention_impl<T_, true>(ATTENTION_CALL); }
#undef T_

// An FP8 cache's blocks that a step reads, converted (exactly) to an f16 copy for the
// flash kernels that take f16 tiles (every step but the keys-on-M kernel's): block i of
// the copy is block tables[i] of the cache (the step's block tables, one after another),
// keys then values `out_half` elements further. A thread per 16 bytes of a block's keys
// (and the same of its values); block_elems a multiple of 16.
extern "C" __global__ void kv_fp8_to_f16_blocks(const unsigned char* cache, long long half, const unsigned int* tables,
                                                int n, int block_elems, unsigned short* out, long long out_half) {
    pdl_wait();
    const int per = block_elems / 16;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * per) return;
    const int b = (int)(i / per), c = (int)(i % per) * 16;
    const unsigned char* src = cache + (size_t)tables[b] * block_elems + c;
    unsigned short* dst = out + (size_t)b * block_elems + c;
#pragma unroll
    for (int kv = 0; kv < 2; kv++) {
        const uint4 x = *reinterpret_cast<const uint4*>(src + (kv ? half : 0));
        uint4 lo, hi;
        lo.x = e4m3x2_to_f16x2(x.x & 0xffff), lo.y = e4m3x2_to_f16x2(x.x >> 16);
        lo.z = e4m3x2_to_f16x2(x.y & 0xffff), lo.w = e4m3x2_to_f16x2(x.y >> 16);
        hi.x = e4m3x2_to_f16x2(x.z & 0xffff), hi.y = e4m3x2_to_f16x2(x.z >> 16);
        hi.z = e4m3x2_to_f16x2(x.w & 0xffff), hi.w = e4m3x2_to_f16x2(x.w >> 16);
        uint4* d = reinterpret_cast<uint4*>(dst + (kv ? out_half : 0));
        d[0] = lo;
        d[1] = hi;
    }
}

// Merges the key-chunk partials of attention_split_* and of the split flash kernels: one
// block per (token, head). With `bf16`, `out` is the next GEMM's bf16 input (the same f32
// values, rounded once as cast_f32_bf16 rounds them).
extern "C" __global__ void attention_merge(const float* part, int splits, int n_heads, int hd, float* out, int bf16) {
    pdl_wait();
    const int t = blockIdx.x, h = blockIdx.y;
    const float* p = part + (size_t)(t * n_heads + h) * splits * (hd + 2);
    float M = NEG_INF;
    for (int z = 0; z < splits; z++) M = fmaxf(M, p[z * (hd + 2)]);
    float L = 0.f;
    for (int z = 0; z < splits; z++) {
        const float mz = p[z * (hd + 2)];
        if (mz != NEG_INF) L += p[z * (hd + 2) + 1] * expf(mz - M);
    }
    const size_t at = (size_t)t * n_heads * hd + h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.f;
        for (int z = 0; z < splits; z++) {
            const float mz = p[z * (hd + 2)];
            if (mz != NEG_INF) s += p[z * (hd + 2) + 2 + d] * expf(mz - M);
        }
        if (bf16)
            ((unsigned short*)out)[at + d] = f32_to_bf16(s / L);
        else
            out[at + d] = s / L;
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

// The block's largest (value, index), the lowest index among equal values, in thread 0.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
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
    }
}

// The best (value, index) of this thread's elements lo + threadIdx.x, + blockDim.x, ...
// below hi: strided ascending, so the first maximum of them.
__device__ __forceinline__ void thread_argmax(const float* row, int lo, int hi, float& bv, int& bi) {
    bv = NEG_INF;
    bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = row[i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
}

// The first maximum of (bv, bi) and the four values from index `at` on.
__device__ __forceinline__ void take_quad(float4 v, int at, float& bv, int& bi) {
    if (v.x > bv) bv = v.x, bi = at;
    if (v.y > bv) bv = v.y, bi = at + 1;
    if (v.z > bv) bv = v.z, bi = at + 2;
    if (v.w > bv) bv = v.w, bi = at + 3;
}

// thread_argmax over 16-byte loads, four in flight per thread (the scalar loop keeps one
// 4-byte load in flight, too few bytes to stream a large batch's logits at the memory's
// rate): quads lo/4 + threadIdx.x, + blockDim.x, ... of [lo, hi), then the last hi - lo mod
// 4 values one a thread; each thread's values still ascend, so the first maximum of them.
// Where row + lo is not 16-byte aligned (a vocabulary not a multiple of 4), the scalar loop.
__device__ __forceinline__ void thread_argmax_vec(const float* row, int lo, int hi, float& bv, int& bi) {
    if (((size_t)(row + lo) & 15) != 0) {
        thread_argmax(row, lo, hi, bv, bi);
        return;
    }
    bv = NEG_INF;
    bi = 0x7fffffff;
    const float4* q = (const float4*)(row + lo);
    const int n4 = max(hi - lo, 0) >> 2, step = blockDim.x;
    int j = threadIdx.x;
    for (; j + 3 * step < n4; j += 4 * step) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = q[j + u * step];
#pragma unroll
        for (int u = 0; u < 4; u++) take_quad(v[u], lo + 4 * (j + u * step), bv, bi);
    }
    for (; j < n4; j += step) take_quad(q[j], lo + 4 * j, bv, bi);
    const int t = lo + 4 * n4 + threadIdx.x;
    if (t < hi && row[t] > bv) {
        bv = row[t];
        bi = t;
    }
}

// Greedy sampling on the device: out[r] = the first index of the largest value of row r
// (NaN never wins; a row of -inf gives 0), as engine::sampling::argmax. One block per row;
// `vec`: thread_argmax_vec's loads (DISAGG_CUDA_ARGMAX_VEC), same result.
extern "C" __global__ void argmax_rows(const float* x, int dim, unsigned int* out, int vec) {
    pdl_wait();
    float bv;
    int bi;
    if (vec)
        thread_argmax_vec(x + (size_t)blockIdx.x * dim, 0, dim, bv, bi);
    else
        thread_argmax(x + (size_t)blockIdx.x * dim, 0, dim, bv, bi);
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0u : (unsigned int)bi;
}

// argmax_rows over many blocks per row (one block scanning a row of 128k logits alone
// takes tens of microseconds): block (c, r) takes values [c * chunk, (c + 1) * chunk) of
// row r and leaves its best in pv/pi; the row's last block to finish (counted in count[r],
// which it sets back to 0) takes the best of the row's partials, the lowest index among
// equal values, so the result is argmax_rows's (`vec` as there).
extern "C" __global__ void argmax_rows_split(const float* x, int dim, int chunk, float* pv, int* pi,
                                              unsigned int* count, unsigned int* out, int vec) {
    pdl_wait();
    const int c = blockIdx.x, r = blockIdx.y, nc = gridDim.x;
    const int lo = c * chunk, hi = min(dim, lo + chunk);
    float bv;
    int bi;
    if (vec)
        thread_argmax_vec(x + (size_t)r * dim, lo, hi, bv, bi);
    else
        thread_argmax(x + (size_t)r * dim, lo, hi, bv, bi);
    block_argmax(bv, bi);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        pv[r * nc + c] = bv;
        pi[r * nc + c] = bi;
        __threadfence();
        last = atomicAdd(&count[r], 1u) == (unsigned int)(nc - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = NEG_INF;
    bi = 0x7fffffff;
    for (int j = threadIdx.x; j < nc; j += blockDim.x) {
        const float v = __ldcg(pv + r * nc + j);
        const int i = __ldcg(pi + r * nc + j);
        if (v > bv || (v == bv && i < bi)) {
            bv = v;
            bi = i;
        }
    }
    __syncthreads();  // (block_argmax's shared memory is reused)
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        out[r] = bi == 0x7fffffff ? 0u : (unsigned int)bi;
        count[r] = 0;
    }
}

// A step's metadata, uploaded in one copy from pinned memory (`packed`, 32-bit words) and
// spread here to the buffers the step's kernels read: segment s is words
// [off[s], off[s] + words[s]) of `packed`, for dst[s]. A word of segment ids_seg (the
// token ids) with its top bit set is a token the last deferred sample drew: its row
// (the low bits) in `sampled`.
#define MAX_UPLOAD_SEGS 12
struct UploadSegs {
    unsigned long long dst[MAX_UPLOAD_SEGS];
    unsigned int off[MAX_UPLOAD_SEGS];
    unsigned int words[MAX_UPLOAD_SEGS];
    unsigned int n;
    int ids_seg;
};

extern "C" __global__ void unpack_step(const unsigned int* packed, UploadSegs segs, const unsigned int* sampled) {
    const unsigned int w = blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned int s = 0; s < segs.n; s++) {
        if (w >= segs.off[s] && w < segs.off[s] + segs.words[s]) {
            unsigned int v = packed[w];
            if ((int)s == segs.ids_seg && (v >> 31)) v = sampled[v & 0x7fffffffu];
            ((unsigned int*)segs.dst[s])[w - segs.off[s]] = v;
            return;
        }
    }
}

// Async scheduling: row fed[2i] of this step takes the id that the last deferred sample
// drew in its row fed[2i + 1] (left by argmax_rows in `sampled`), before the embedding.
extern "C" __global__ void feed_ids(unsigned int* ids, const int* fed, int n, const unsigned int* sampled) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ids[fed[2 * i]] = sampled[fed[2 * i + 1]];
}

// ---- Attention on tensor cores (flash-attention 2 style), prefill and decode ----
// One block of 4 warps per (query tile of one sequence, KV head[, key split]). A tile's
// 64 rows are (token, query head of the KV head's group) pairs: ⌊64 / group⌋ tokens ×
// group heads, so the keys and values read for a KV head serve all of its query heads
// at once (a decode token fills `group` rows). Each warp owns 16 rows. Keys and values
// stream through shared memory 64 at a time from the paged f16 cache through the
// sequence's block table, double-buffered (cp.async: the next tile loads while this one
// is computed on); S = Q·Kᵀ and O += P·V run on mma.sync m16n8k16 (f16 inputs,
// f32 accumulators) with an online softmax in base 2. With splits (gridDim.z > 1; chosen
// by the backend to fill whole waves of resident blocks), split z takes keys [z·chunk, (z+1)·chunk), chunk = ⌈max_ctx /
// splits⌉ rounded up to 64, and writes attention_merge's partials.
// Rounding: q·scale and the probabilities P are rounded to f16 for the MMAs (relative
// 2⁻¹¹); the cache is f16 already. tiles[4·i] = (first token row, tokens, position of
// the first token, offset of the block table in `tables`).
// These instructions need sm_80+; on older GPUs the module still loads (the backend
// never launches the flash kernels there) and they trap if reached.
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    __trap();
#endif
    return r;
}
__device__ __forceinline__ void mma_f16_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// A shared-memory pointer as the 32-bit address PTX shared-state instructions take.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned d;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(p));
    return d;
}

// Asynchronous 16-byte global → shared copies (sm_80+): `bytes` 0 fills zeros. `_at`
// takes the 32-bit shared address (see the flash kernels' SA form), the other a pointer.
// L2_256: L2 fetches the whole 256-byte span around the chunk (streamed weights).
template <bool L2_256 = false>
__device__ __forceinline__ void cp_async16_at(unsigned dst, const void* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    if (L2_256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#else
    __trap();
#endif
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    cp_async16_at(smem_u32(dst), src, bytes);
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Bulk copies (sm_90, the TMA unit): global → shared, `bytes` (a multiple of 16, both
// addresses 16-byte aligned) counted against an mbarrier's transaction count. The barrier
// (one arrival: the thread that states the bytes) completes its phase when the arrival
// and all the bytes it expects are in; waiting threads give the phase's parity.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#else
    __trap();
#endif
}
// This thread's global writes ordered before later bulk (async-proxy) reads of them.
__device__ __forceinline__ void fence_proxy_async_global() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Four 8×8 b16 matrices from shared memory (sm_75+): lane i gives the address of row
// i % 8 of matrix i / 8; each lane receives, per matrix, the pair at (row lane / 4,
// columns 2·(lane % 4) + {0, 1}) — with .trans, at (rows 2·(lane % 4) + {0, 1}, column
// lane / 4): exactly an mma.m16n8k16 B fragment half.
// Older GPUs never launch the flash kernels, but the module must still load there.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4_at(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned a) {
#if __CUDA_ARCH__ >= 750
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(a));
#else
    __trap();
#endif
}
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    ldsm_x4_at<TRANS>(r0, r1, r2, r3, smem_u32(p));
}

// ---- Warpgroup MMA (wgmma, sm_90a only: the module is compiled for sm_90a on Hopper) ----
// A warpgroup (the block's 4 warps) multiplies a 64-row A held in registers, each warp's
// 16 rows in the mma.m16n8k16 A-fragment layout, by a B tile that the tensor cores read
// straight from shared memory, so B is read once per warpgroup, not once per warp. The
// f32 accumulators have the m16n8 layout per warp, 8 columns after 8 columns. B is laid
// out with the 128-byte swizzle: rows of 128 bytes in groups of 8 (1024-byte aligned),
// the 16-byte chunk c of row r at c ^ (r % 8). The descriptor: start address; SBO, the
// distance between 8-row groups; LBO, for an N-major B the distance between 64-element
// column blocks (unused for K-major).
__device__ __forceinline__ unsigned long long wg_desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// Orders the registers' ordinary writes before the wgmmas that read or accumulate them.
__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Closes the wgmmas issued since the last commit into one group.
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Pins registers: the compiler keeps their ordinary writes ahead of the next asm
// (wg_fence) and reads them only after the last (wg_wait).
template <int N>
__device__ __forceinline__ void wg_pin(float* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_pin_u(unsigned* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}
// Waits for every group; then the accumulators are pinned so that the compiler reads
// them only after the wait.
template <int N>
__device__ __forceinline__ void wg_wait(float* acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_pin<N>(acc);
#endif
}
// Generic-proxy writes to shared memory (cp.async here) made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// D(64×N, f32) += A(64×16, f16 registers) · B(16×N, f16 in shared memory by descriptor);
// TB: B is N-major (its rows of 16 bytes run along N, as V's keys × dims), else K-major.
template <int TB>
__device__ __forceinline__ void wgmma_rs_m64n64(float* d, const unsigned* a, unsigned long long b, int sd) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(sd), "n"(TB));
#else
    __trap();
#endif
}
template <int TB>
__device__ __forceinline__ void wgmma_rs_m64n128(float* d, const unsigned* a, unsigned long long b, int sd) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(sd), "n"(TB));
#else
    __trap();
#endif
}
template <int N, int TB>
__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, unsigned long long b, int sd = 1) {
    if constexpr (N == 64)
        wgmma_rs_m64n64<TB>(d, a, b, sd);
    else
        wgmma_rs_m64n128<TB>(d, a, b, sd);
}

#define FA_KEYS 64
// Bits of the flash kernels' `flags` (switches for A/B runs).
#define FLASH_LEAN_LOADS 1  // tile loads: addresses once per key, hoisted (else per chunk)
#define FLASH_WIDE_MERGE 2  // decode: all the block's threads merge its warps' parts (else warp 0)
#define FLASH_MASK_EDGE 4   // mask only tiles that cross a row's diagonal or the keys' end (else all)
#define FLASH_OUT_BF16 8    // unsplit: `out` is the next GEMM's bf16 input (else f32)
#define FLASH_PAIR_LOADS 16    // lean loads: a key 8 (16) on in the same cache block reuses the address
#define FLASH_ROPE 32       // keys on M: RoPE on q and the row's k, v into the cache here (else done before)
#define FLASH_CLUSTER 64    // keys on M, split: the splits are one thread block cluster and merge here (sm_90)
#define FLASH_EARLY 128     // keys on M: the first tiles before the row's key loaded before pdl_wait
#define FLASH_BULK 256      // keys on M: tiles loaded by bulk copies, a key row per thread (else cp.async)
#define FLASH_LAZY_RESCALE 512  // O rescaled only when a warp's row maxima rose (× 1 skipped: the same bits)
#define FLASH_PP_TURNS 1024     // warp-specialized: the consumers take turns at the tensor cores (else free)
#define FLASH_PP_ROPE_Q 2048    // warp-specialized: q rotated as loaded, by rope_write_k_f16's cos/sin (else rotated before)
#define FLASH_MERGE_ILP 4096    // keys on M, cluster: a merge reads every split's partial at once (else M, then in turn)
#define FLASH_BATCH_LOADS 8192  // keys on M: q's values and a tile's block-table entries all loaded before use (else each in turn)
#define FLASH_RELAXED_EXIT 16384  // keys on M, cluster: the barrier after the merge arrives without release (else with)
#define FLASH_WAIT_FIRST 32768    // keys on M, with FLASH_BATCH_LOADS: wait, then ask for q beside the first tiles' table entries (else q after them)
#define FLASH_KV_EARLY 65536      // keys on M, with FLASH_ROPE and FLASH_WAIT_FIRST: the row's k, v and RoPE frequencies asked for beside q, cos/sin after the early tiles (else each when used)
// 2^x for the online softmax. FX: the bare MUFU instruction, inputs and results below
// 2^-126 flushed to zero (x ≤ 0 here, and P is rounded to f16 anyway, whose smallest
// subnormal is 2^-24); else exp2f, which scales around the MUFU for f32 subnormals.
template <bool FX>
__device__ __forceinline__ float fa_exp2(float x) {
    if (!FX) return exp2f(x);
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// Dynamic shared memory of a flash block: two stages (double buffering) of a K and a V
// tile, FA_KEYS rows of head_dim + 8 halves each.
#define FA_SMEM_BYTES(HD) (2 * 2 * FA_KEYS * ((HD) + 8) * 2)
// The end of a decode block whose four warps each took a quarter of every key tile: one
// query row's merge of their partial softmaxes, four columns from c. Warp v's (max, sum)
// lie at ml[(v·rows + r)·2], its output sums at parts[(v·rows + r)·stride + c] (shared
// memory). The result goes to `out` at `at` (the row's head, column c) when the keys are
// not split (`pp` null), as f32 or, with `bf16`, as the next GEMM's bf16 input (rounded
// once, as cast_f32_bf16 rounds), else to this split's partial at `pp` (global or shared
// memory; `attention_merge`'s layout: M, L, then the head's sums; a split without keys of
// this row leaves M = −∞, L = 0 there).
template <int HD, bool FX>
__device__ __forceinline__ void merge_warp_parts(const float* ml, const float* parts, int rows, int stride, int r,
                                                 int c, float* out, size_t at, float* pp, bool bf16) {
    float M = NEG_INF;
#pragma unroll
    for (int v = 0; v < 4; v++) M = fmaxf(M, ml[(v * rows + r) * 2]);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    float L = 0.f;
#pragma unroll
    for (int v = 0; v < 4; v++) {
        const float mv = ml[(v * rows + r) * 2];
        const float wv = mv == NEG_INF ? 0.f : fa_exp2<FX>(mv - M);
        L += wv * ml[(v * rows + r) * 2 + 1];
        const float4 x = *reinterpret_cast<const float4*>(&parts[(v * rows + r) * stride + c]);
        a.x += wv * x.x;
        a.y += wv * x.y;
        a.z += wv * x.z;
        a.w += wv * x.w;
    }
    if (pp == nullptr) {
        // Unsplit, key 0 is in every row's past, so L > 0.
        if (bf16) {
            uint2 ob;
            ob.x = pack_bf16x2(a.x / L, a.y / L);
            ob.y = pack_bf16x2(a.z / L, a.w / L);
            *reinterpret_cast<uint2*>((unsigned short*)out + at) = ob;
        } else {
            *reinterpret_cast<float4*>(&out[at]) = make_float4(a.x / L, a.y / L, a.z / L, a.w / L);
        }
    } else {
        if (c == 0) {
            pp[0] = M * 0.6931471805599453f;
            pp[1] = L;
        }
        *reinterpret_cast<float2*>(&pp[2 + c]) = make_float2(a.x, a.y);
        *reinterpret_cast<float2*>(&pp[2 + c + 2]) = make_float2(a.z, a.w);
    }
}

// A thread's two query rows of Q (rows qa and qb, f32, head_dim HD), scaled by qs and
// rounded to f16 in the mma.m16n8k16 A-fragment layout (also wgmma's register A).
template <int HD>
__device__ __forceinline__ void flash_load_q(unsigned (*qf)[4], const float* qa, const float* qb, float qs, int t4) {
#pragma unroll
    for (int k = 0; k < HD / 16; k++) {
        const int c0 = 16 * k + 2 * t4, c1 = c0 + 8;
        qf[k][0] = pack_f16x2(qa[c0] * qs, qa[c0 + 1] * qs);
        qf[k][1] = pack_f16x2(qb[c0] * qs, qb[c0 + 1] * qs);
        qf[k][2] = pack_f16x2(qa[c1] * qs, qa[c1 + 1] * qs);
        qf[k][3] = pack_f16x2(qb[c1] * qs, qb[c1 + 1] * qs);
    }
}
// flash_load_q with RoPE (FLASH_PP_ROPE_Q): each pair rotated from the unrotated q by
// its row's cos/sin as rope_write_k_f16 wrote them (`csa`, `csb`: the rows' tokens), as
// rope_write_kv_impl rotates it, then scaled and rounded as flash_load_q does: the same
// bits. A thread holds both dims of its pairs: (c, c + HD/2) at k-steps k and k + KS/2,
// or (c, c + 1) when interleaved.
template <int HD>
__device__ __forceinline__ void flash_load_q_rope(unsigned (*qf)[4], const float* qa, const float* qb, float qs, int t4,
                                                  const float* csa, const float* csb, int interleaved) {
    constexpr int KS = HD / 16, HH = HD / 2;
    float va[KS][4], vb[KS][4];  // column 16k + 2t4 + {0, 1, 8, 9}[e], rotated
    auto rot = [&](const float* cs, int j, float& x0, float& x1) {
        const float2 r = reinterpret_cast<const float2*>(cs)[j];
        rope_apply(r.x, r.y, x0, x1);
    };
    if (interleaved) {
#pragma unroll
        for (int k = 0; k < KS; k++)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int col = 16 * k + 2 * t4 + (e ? 8 : 0);
                float a0 = qa[col], a1 = qa[col + 1], b0 = qb[col], b1 = qb[col + 1];
                rot(csa, col >> 1, a0, a1);
                rot(csb, col >> 1, b0, b1);
                va[k][e] = a0, va[k][e + 1] = a1, vb[k][e] = b0, vb[k][e + 1] = b1;
            }
    } else {
#pragma unroll
        for (int k = 0; k < KS / 2; k++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = 16 * k + 2 * t4 + (e & 1) + (e & 2) * 4;
                float a0 = qa[col], a1 = qa[col + HH], b0 = qb[col], b1 = qb[col + HH];
                rot(csa, col, a0, a1);
                rot(csb, col, b0, b1);
                va[k][e] = a0, va[k + KS / 2][e] = a1, vb[k][e] = b0, vb[k + KS / 2][e] = b1;
            }
    }
#pragma unroll
    for (int k = 0; k < KS; k++) {
        qf[k][0] = pack_f16x2(va[k][0] * qs, va[k][1] * qs);
        qf[k][1] = pack_f16x2(vb[k][0] * qs, vb[k][1] * qs);
        qf[k][2] = pack_f16x2(va[k][2] * qs, va[k][3] * qs);
        qf[k][3] = pack_f16x2(vb[k][2] * qs, vb[k][3] * qs);
    }
}
// The end of a flash block for a thread's two rows (the m16n8 accumulator layout: o[d][0,
// 1] row a, o[d][2, 3] row b; l already summed over the quad): rows that exist (`has_a`,
// `has_b`), of tokens ta / tb and heads ha / hb, normalised into `out` (f32, or with
// FLASH_OUT_BF16 the next GEMM's bf16 input) when the keys are not split, else as
// attention_merge's partial of split z.
template <int HD>
__device__ __forceinline__ void flash_store_rows(const float (*o)[4], float m0, float m1, float l0, float l1,
                                                 bool has_a, bool has_b, int ta, int tb, int ha, int hb, int n_heads,
                                                 int t4, int z, int splits, float* out, float* part, int flags) {
    constexpr int DT = HD / 8;
#pragma unroll
    for (int half_row = 0; half_row < 2; half_row++) {
        if (!(half_row ? has_b : has_a)) continue;
        const int t = half_row ? tb : ta, h = half_row ? hb : ha;
        const float m = half_row ? m1 : m0, l = half_row ? l1 : l0;
        if (splits == 1) {
            // Key 0 is in every row's past, so l > 0.
            const size_t at = (size_t)t * n_heads * HD + h * HD + 2 * t4;
            if (flags & FLASH_OUT_BF16) {
                // The same f32 values, rounded once as cast_f32_bf16 rounds them.
                unsigned* ob = (unsigned*)((unsigned short*)out + at);
#pragma unroll
                for (int d = 0; d < DT; d++)
                    ob[d * 4] = pack_bf16x2(o[d][2 * half_row] / l, o[d][2 * half_row + 1] / l);
            } else {
                float* op = out + at;
#pragma unroll
                for (int d = 0; d < DT; d++) {
                    op[d * 8] = o[d][2 * half_row] / l;
                    op[d * 8 + 1] = o[d][2 * half_row + 1] / l;
                }
            }
        } else {
            // attention_merge's partial (natural-log max, sum, unnormalised acc).
            float* pp = part + ((size_t)(t * n_heads + h) * splits + z) * (HD + 2);
            if (t4 == 0) {
                pp[0] = m * 0.6931471805599453f;
                pp[1] = l;
            }
#pragma unroll
            for (int d = 0; d < DT; d++) {
                pp[2 + d * 8 + 2 * t4] = o[d][2 * half_row];
                pp[2 + d * 8 + 2 * t4 + 1] = o[d][2 * half_row + 1];
            }
        }
    }
}

// WS (decode: a tile of ≤ 16 rows, one warp's worth): the four warps take the same rows
// and split each 64-key tile between them (16 keys each), then merge their partial
// softmaxes through shared memory, so a decode block computes 4× faster.
// LDSM: the K and V fragments come from shared memory by ldmatrix (one instruction per
// four 8×8 matrices, V transposed on the way) instead of 32- and 16-bit loads.
// V, the kernel's form (each level keeps the ones below, for A/B runs): 0 as first
// written; 1 adds fa_exp2's bare form (FX); 2 adds shared addresses as 32-bit offsets
// from the tile base computed once (SA), so each ldmatrix and cp.async takes a constant
// displacement instead of 64-bit pointer arithmetic and two address-space conversions
// (ALU was the busiest pipe in the prefill kernel's profile); 3 (WG, prefill form at
// head_dim 128 only, sm_90a) computes S = Q·Kᵀ and O += P·V with warpgroup MMAs: the
// K and V tiles lie in shared memory in the 128-byte-swizzled layout (see my_off) and
// the tensor cores read them once for all four warps; the next tile's copies are
// issued while S is on the tensor cores.
template <int HD, bool WS, bool LDSM, int V>
__device__ void flash_attn_impl(const float* qkv, const unsigned short* cache, long long half, const int* tiles,
                                const unsigned int* tables, int n_heads, int n_kv, int block_size, float scale,
                                const int* max_ctx, float* out, float* part, int flags) {
    static_assert(HD % 32 == 0, "the ldmatrix loops take k-steps and d-tiles in pairs");
    constexpr int KS = HD / 16;               // k-steps of S over head_dim
    constexpr int DT = HD / 8;                // n-tiles of O over head_dim
    constexpr int ST = HD + 8;                // shared row stride in halves (conflict-free fragment loads)
    constexpr int NT = WS ? 2 : FA_KEYS / 8;  // key n-tiles of S per warp and tile
    constexpr bool FX = V >= 1, SA = V >= 2, WG = V >= 3;
    static_assert(!WG || (!WS && LDSM && HD == 128), "wgmma: the prefill form, head_dim 128");
    extern __shared__ __align__(16) unsigned char fa_smem[];
    unsigned short* kvs = (unsigned short*)fa_smem;  // [stage][K | V][FA_KEYS][ST]
    // WG: the tiles start on a 1024-byte boundary (the 128-byte swizzle's repeat; the
    // padding of the other forms' rows leaves room for it) and are unpadded.
    const unsigned kvs_at = WG ? ((unsigned)__cvta_generic_to_shared(fa_smem) + 1023u) & ~1023u
                               : (unsigned)__cvta_generic_to_shared(fa_smem);
    constexpr unsigned STAGE_BYTES = 2 * FA_KEYS * (WG ? HD : ST) * 2, V_BYTES = FA_KEYS * (WG ? HD : ST) * 2;
    static_assert(!WG || 2 * STAGE_BYTES + 1008 <= FA_SMEM_BYTES(HD), "WG: two stages and the alignment fit");
    const int* tile = tiles + 4 * blockIdx.x;
    const int row0 = tile[0], ntok = tile[1], pos0 = tile[2];
    const unsigned int* table = tables + tile[3];
    const int kvh = blockIdx.y, grp = n_heads / n_kv, z = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int lr = lane & 7, lj = lane >> 3;  // this lane's ldmatrix row and matrix
    const int w = (n_heads + 2 * n_kv) * HD;
    const int nrows = ntok * grp;
    // This thread's two rows (g and g+8 of the warp's 16); rows past the tile repeat its
    // last row and are never written.
    const int ra = (WS ? 0 : warp * 16) + g, rb = ra + 8;
    const int ca = min(ra, nrows - 1), cb = min(rb, nrows - 1);
    const int ta = ca / grp, tb = cb / grp;
    const int ha = kvh * grp + ca % grp, hb = kvh * grp + cb % grp;
    const int pa = pos0 + ta, pb = pos0 + tb;
    const float qs = scale * 1.4426950408889634f;
    unsigned qf[KS][4];
    flash_load_q<HD>(qf, qkv + (size_t)(row0 + ta) * w + ha * HD, qkv + (size_t)(row0 + tb) * w + hb * HD, qs, t4);
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    int k0 = 0, k1 = pos0 + ntok;
    if (splits > 1) {
        const int chunk = ((max_ctx[0] + splits - 1) / splits + FA_KEYS - 1) / FA_KEYS * FA_KEYS;
        k0 = z * chunk;
        k1 = min(k1, k0 + chunk);
    }
    const int r_first = WS ? 0 : warp * 16;
    const bool idle = r_first >= nrows;  // no row of this warp is in the tile
    const int warp_last = pos0 + min(r_first + 15, nrows - 1) / grp;
    // Keys before this are in every row's past (rows are in position order).
    const int warp_first = pos0 + min(r_first, nrows - 1) / grp;
    const int key_off = WS ? 16 * warp : 0;  // this warp's keys within a tile
    constexpr int CH = HD / 8;      // 16-byte chunks per key row
    constexpr int KPP = 128 / CH;   // keys per pass of the block's 128 threads
    constexpr int PASSES = FA_KEYS / KPP;
    static_assert(128 % CH == 0 && FA_KEYS % KPP == 0, "lean loads: whole passes of the 128 threads");
    // Lean loads: a thread keeps one chunk column and steps over keys, so the per-block
    // parts of the address are computed once, the block table is read once per key (all
    // reads before the copies), and a power-of-two block size costs a shift, not a
    // division. The other form computes every chunk's address from scratch.
    const int my_c = (threadIdx.x % CH) * 8, my_key = threadIdx.x / CH;
    // WG: the 128-byte-swizzled layout of wgmma (both K-major for K and N-major for V):
    // 64-dim halves of the rows one after the other, each 64 rows of 128 bytes whose
    // 16-byte chunk c sits at c ^ (row % 8), so the eight chunks a quarter-warp writes
    // land in distinct banks.
    const unsigned my_off = WG ? (my_c / 64) * (FA_KEYS * 128) + my_key * 128 + ((((my_c / 8) & 7) ^ (my_key & 7)) << 4)
                               : (my_key * ST + my_c) * 2;
    constexpr unsigned PASS_BYTES = (WG ? 128 : ST * 2) * KPP;  // shared bytes between a thread's keys
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    const unsigned short* my_src = cache + (size_t)kvh * block_size * HD + my_c;
    const size_t blk_stride = (size_t)n_kv * block_size * HD;
    // Keys [kb, kb + 64) into stage `st`, asynchronously (keys past k1 read as zeros).
    auto load_tile = [&](int kb, int st) {
        unsigned short* kd = kvs + st * 2 * FA_KEYS * ST;
        unsigned short* vd = kd + FA_KEYS * ST;
        if (WG || (flags & FLASH_LEAN_LOADS)) {
            const unsigned short* src[PASSES];
            // Pair loads: tiles start at multiples of 64 keys, so with power-of-two blocks
            // of at least 2·KPP keys, an odd pass's key is KPP slots on from the previous
            // pass's in the same block: one block-table read and 64-bit product per pair.
            const bool pair = (flags & FLASH_PAIR_LOADS) && bs_pow2 && block_size >= 2 * KPP;
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int j = kb + my_key + p * KPP;
                src[p] = nullptr;
                if (j < k1) {
                    if (pair && (p & 1)) {
                        src[p] = src[p - 1] + KPP * HD;  // key j − KPP < k1: set
                    } else {
                        const int bi = bs_pow2 ? j >> bs_shift : j / block_size;
                        src[p] = my_src + table[bi] * blk_stride + (size_t)(j - bi * block_size) * HD;
                    }
                }
            }
            unsigned short* kp = kd + my_key * ST + my_c;
            const unsigned kp_at = kvs_at + st * STAGE_BYTES + my_off;
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int bytes = src[p] ? 16 : 0;
                if (SA) {
                    cp_async16_at(kp_at + p * PASS_BYTES, bytes ? src[p] : cache, bytes);
                    cp_async16_at(kp_at + V_BYTES + p * PASS_BYTES, bytes ? src[p] + half : cache, bytes);
                } else {
                    cp_async16(kp + p * KPP * ST, bytes ? src[p] : cache, bytes);
                    cp_async16(kp + FA_KEYS * ST + p * KPP * ST, bytes ? src[p] + half : cache, bytes);
                }
            }
            cp_async_commit();
            return;
        }
        if constexpr (!WG) {  // (WG always takes the lean loads)
            for (int i = threadIdx.x; i < FA_KEYS * CH; i += blockDim.x) {
                const int key = i / CH, c = (i % CH) * 8, j = kb + key;
                const unsigned short* src = cache;
                int bytes = 0;
                if (j < k1) {
                    const long long blk = table[j / block_size];
                    src = cache + (size_t)(((blk * n_kv + kvh) * block_size + j % block_size) * HD + c);
                    bytes = 16;
                }
                cp_async16(kd + key * ST + c, src, bytes);
                cp_async16(vd + key * ST + c, bytes ? src + half : cache, bytes);
            }
            cp_async_commit();
        }
    };
    if (k0 < k1) load_tile(k0, 0);
    int stage = 0;
    for (int kb = k0; kb < k1; kb += FA_KEYS, stage ^= 1) {
        // The next tile streams in while this one is computed on (WG: issued once this
        // tile's S is on the tensor cores, below, so the block-table reads wait behind it).
        if (!WG && kb + FA_KEYS < k1) {
            load_tile(kb + FA_KEYS, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        if (WG) fence_proxy_async();
        __syncthreads();
        const unsigned short* ks = kvs + stage * 2 * FA_KEYS * ST;
        const unsigned short* vs = ks + FA_KEYS * ST;
        const unsigned ks_at = kvs_at + stage * STAGE_BYTES;
        // Skip when every key of this warp's part comes after its rows.
        // (WG: all four warps issue every warpgroup MMA.)
        if (WG || (!idle && kb + key_off <= warp_last)) {
            float s[NT][4];
            if constexpr (WG) {
                // The first k-step overwrites S (scale-d 0): no register writes before it.
                wg_fence();
                // K-major B: a k-step's 32 bytes of each key row (16 dims) inside its
                // 64-dim half; rows in groups of 8 (1024 bytes) along N.
#pragma unroll
                for (int k = 0; k < KS; k++) {
                    const unsigned at = ks_at + (k / 4) * (FA_KEYS * 128) + (k % 4) * 32;
                    wgmma_rs<FA_KEYS, 0>(&s[0][0], qf[k], wg_desc_sw128(at, 16, 1024), k != 0);
                }
                wg_commit();
                if (kb + FA_KEYS < k1) load_tile(kb + FA_KEYS, stage ^ 1);
                wg_wait<NT * 4>(&s[0][0]);
            } else
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
                if (LDSM) {
                    // Matrices: keys nt·8.. × dims 16k + 8j, j = 0..3 (two k-steps).
                    const unsigned short* kr = ks + (key_off + nt * 8 + lr) * ST + 8 * lj;
                    const unsigned kr_at = ks_at + ((key_off + lr) * ST + 8 * lj) * 2 + nt * 8 * ST * 2;
#pragma unroll
                    for (int k = 0; k < KS; k += 2) {
                        unsigned b0, b1, b2, b3;
                        if (SA)
                            ldsm_x4_at<false>(b0, b1, b2, b3, kr_at + 16 * k * 2);
                        else
                            ldsm_x4<false>(b0, b1, b2, b3, kr + 16 * k);
                        mma_f16_16816(s[nt], qf[k], b0, b1);
                        mma_f16_16816(s[nt], qf[k + 1], b2, b3);
                    }
                } else {
                    const unsigned short* kr = ks + (key_off + nt * 8 + g) * ST + 2 * t4;
#pragma unroll
                    for (int k = 0; k < KS; k++) {
                        const unsigned b0 = *(const unsigned*)(kr + 16 * k);
                        const unsigned b1 = *(const unsigned*)(kr + 16 * k + 8);
                        mma_f16_16816(s[nt], qf[k], b0, b1);
                    }
                }
            }
            // Causal mask and the split's end (this also hides the zero keys), row maxima.
            // A tile whose keys all precede the warp's first row and the end needs none.
            const bool edge = !(flags & FLASH_MASK_EDGE) || kb + key_off + NT * 8 > min(warp_first + 1, k1);
            if (edge) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int j = kb + key_off + nt * 8 + 2 * t4 + e;
                        if (j > pa || j >= k1) s[nt][e] = NEG_INF;
                        if (j > pb || j >= k1) s[nt][2 + e] = NEG_INF;
                    }
                }
            }
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    mx0 = fmaxf(mx0, s[nt][e]);
                    mx1 = fmaxf(mx1, s[nt][2 + e]);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
            // A row may have no key yet (a split or a warp's part before its position).
            const float r0 = n0 == NEG_INF ? 0.f : n0, r1 = n1 == NEG_INF ? 0.f : n1;
            const float a0 = fa_exp2<FX>(m0 - r0), a1 = fa_exp2<FX>(m1 - r1);
            m0 = n0;
            m1 = n1;
            float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                s[nt][0] = fa_exp2<FX>(s[nt][0] - r0);
                s[nt][1] = fa_exp2<FX>(s[nt][1] - r0);
                s[nt][2] = fa_exp2<FX>(s[nt][2] - r1);
                s[nt][3] = fa_exp2<FX>(s[nt][3] - r1);
                rs0 += s[nt][0] + s[nt][1];
                rs1 += s[nt][2] + s[nt][3];
            }
            l0 = l0 * a0 + rs0;  // this thread's columns only; summed over the quad at the end
            l1 = l1 * a1 + rs1;
            // (Warp-uniform here: the branch above is.)
            if (!(flags & FLASH_LAZY_RESCALE) || !__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f))
#pragma unroll
                for (int d = 0; d < DT; d++) {
                    o[d][0] *= a0;
                    o[d][1] *= a0;
                    o[d][2] *= a1;
                    o[d][3] *= a1;
                }
            if constexpr (WG) {
                unsigned pf[NT / 2][4];
#pragma unroll
                for (int kk = 0; kk < NT / 2; kk++) {
                    pf[kk][0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
                    pf[kk][1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
                    pf[kk][2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                    pf[kk][3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                }
                wg_pin<DT * 4>(&o[0][0]);
                wg_pin_u<NT * 2>(&pf[0][0]);
                wg_fence();
                // N-major B: 16 keys (two groups of 8 rows, 1024 bytes apart) along K, the
                // dims along N in 64-dim halves FA_KEYS · 128 bytes apart.
#pragma unroll
                for (int kk = 0; kk < NT / 2; kk++)
                    wgmma_rs<HD, 1>(&o[0][0], pf[kk], wg_desc_sw128(ks_at + V_BYTES + kk * 2048, FA_KEYS * 128, 1024));
                wg_commit();
                wg_wait<DT * 4>(&o[0][0]);
            } else
#pragma unroll
            for (int kk = 0; kk < NT / 2; kk++) {
                // The accumulator layout of S is the A-operand layout of P.
                unsigned pf[4];
                pf[0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
                pf[1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
                pf[2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                if (LDSM) {
                    // Matrices (transposed): keys 16kk + 8(j & 1).. × dims 8(d + (j >> 1))..
                    const unsigned short* vr = vs + (key_off + 16 * kk + lr + 8 * (lj & 1)) * ST + 8 * (lj >> 1);
                    const unsigned vr_at =
                        ks_at + V_BYTES + ((key_off + lr + 8 * (lj & 1)) * ST + 8 * (lj >> 1)) * 2 + 16 * kk * ST * 2;
#pragma unroll
                    for (int d = 0; d < DT; d += 2) {
                        unsigned b0, b1, b2, b3;
                        if (SA)
                            ldsm_x4_at<true>(b0, b1, b2, b3, vr_at + d * 8 * 2);
                        else
                            ldsm_x4<true>(b0, b1, b2, b3, vr + d * 8);
                        mma_f16_16816(o[d], pf, b0, b1);
                        mma_f16_16816(o[d + 1], pf, b2, b3);
                    }
                } else {
                    const unsigned short* v0 = vs + (key_off + 16 * kk + 2 * t4) * ST + g;
#pragma unroll
                    for (int d = 0; d < DT; d++) {
                        const unsigned short* vp = v0 + d * 8;
                        const unsigned b0 = (unsigned)vp[0] | ((unsigned)vp[ST] << 16);
                        const unsigned b1 = (unsigned)vp[8 * ST] | ((unsigned)vp[9 * ST] << 16);
                        mma_f16_16816(o[d], pf, b0, b1);
                    }
                }
            }
        }
        __syncthreads();  // this stage is loaded again two tiles on
    }
    l0 += __shfl_xor_sync(0xffffffff, l0, 1);
    l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1);
    l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    if (WS && (flags & FLASH_WIDE_MERGE)) {
        // Merge the warps' parts with every thread: each warp writes (max, sum) and acc of
        // its 16 rows to shared memory (the K/V tiles are done with); then the block's
        // threads take the real rows' columns four at a time and write the result.
        constexpr int RA = HD + 4;  // acc row stride in floats (float4-aligned)
        float* acc = (float*)kvs;   // [warp][row][RA]
        float* ml = acc + 4 * 16 * RA;  // [warp][row][2]: ≤ the K/V tiles' bytes in all
        float* mine = acc + warp * 16 * RA;
        if (t4 == 0) {
            ml[(warp * 16 + g) * 2] = m0;
            ml[(warp * 16 + g) * 2 + 1] = l0;
            ml[(warp * 16 + g + 8) * 2] = m1;
            ml[(warp * 16 + g + 8) * 2 + 1] = l1;
        }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            *(float2*)&mine[g * RA + d * 8 + 2 * t4] = make_float2(o[d][0], o[d][1]);
            *(float2*)&mine[(g + 8) * RA + d * 8 + 2 * t4] = make_float2(o[d][2], o[d][3]);
        }
        __syncthreads();
        constexpr int C4 = HD / 4;
        for (int i = threadIdx.x; i < nrows * C4; i += blockDim.x) {
            const int r = i / C4, c = (i % C4) * 4;
            const size_t th = (size_t)(row0 + r / grp) * n_heads + kvh * grp + r % grp;  // (token, head)
            float* pp = splits == 1 ? nullptr : part + (th * splits + z) * (HD + 2);
            merge_warp_parts<HD, FX>(ml, acc, 16, RA, r, c, out, th * HD + c, pp, (flags & FLASH_OUT_BF16) != 0);
        }
        return;
    }
    if (WS) {
        // Merge the warps' parts: each writes (max, sum, acc) of its 16 rows to shared
        // memory (the K/V tiles are done with), warp 0 combines them.
        constexpr int RW = HD + 2;
        float* mo = (float*)kvs;  // [warp][row][RW]: 4·16·RW floats ≤ the K/V tiles' bytes
        float* mine = mo + warp * 16 * RW;
        if (t4 == 0) {
            mine[g * RW] = m0;
            mine[g * RW + 1] = l0;
            mine[(g + 8) * RW] = m1;
            mine[(g + 8) * RW + 1] = l1;
        }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            mine[g * RW + 2 + d * 8 + 2 * t4] = o[d][0];
            mine[g * RW + 2 + d * 8 + 2 * t4 + 1] = o[d][1];
            mine[(g + 8) * RW + 2 + d * 8 + 2 * t4] = o[d][2];
            mine[(g + 8) * RW + 2 + d * 8 + 2 * t4 + 1] = o[d][3];
        }
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = g + 8 * hr;
            float M = NEG_INF;
            for (int v = 0; v < 4; v++) M = fmaxf(M, mo[(v * 16 + r) * RW]);
            float wv[4], L = 0.f;
            for (int v = 0; v < 4; v++) {
                const float mv = mo[(v * 16 + r) * RW];
                wv[v] = mv == NEG_INF ? 0.f : fa_exp2<FX>(mv - M);
                L += wv[v] * mo[(v * 16 + r) * RW + 1];
            }
#pragma unroll
            for (int d = 0; d < DT; d++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float acc = 0.f;
                    for (int v = 0; v < 4; v++) acc += wv[v] * mo[(v * 16 + r) * RW + 2 + d * 8 + 2 * t4 + e];
                    o[d][2 * hr + e] = acc;
                }
            }
            if (hr == 0) {
                m0 = M;
                l0 = L;
            } else {
                m1 = M;
                l1 = L;
            }
        }
    }
    flash_store_rows<HD>(o, m0, m1, l0, l1, ra < nrows, rb < nrows, row0 + ta, row0 + tb, ha, hb, n_heads, t4, z,
                         splits, out, part, flags);
}

#define FLASH_ARGS_KT(KT) const float* qkv, const KT* cache, long long half, const int* tiles, \
    const unsigned int* tables, int n_heads, int n_kv, int block_size, float scale, const int* max_ctx, float* out, \
    float* part, int flags
#define FLASH_ARGS FLASH_ARGS_KT(unsigned short)
#define FLASH_CALL qkv, cache, half, tiles, tables, n_heads, n_kv, block_size, scale, max_ctx, out, part, flags
// LB: the launch bounds, (128) or (128, blocks per SM the registers must allow): a
// stated 1 lets ptxas spend registers freely (224 here against 174 without it).
#define FLASH_KERNEL(NAME, HD, WS, LDSM, V, LB) \
    extern "C" __global__ void __launch_bounds__ LB NAME(FLASH_ARGS) { \
        pdl_wait(); \
        flash_attn_impl<HD, WS, LDSM, V>(FLASH_CALL); \
    }
FLASH_KERNEL(flash_attn_f16_d64, 64, false, true, 0, (128))
FLASH_KERNEL(flash_attn_f16_d128, 128, false, true, 0, (128))
FLASH_KERNEL(flash_decode_f16_d64, 64, true, true, 0, (128))
FLASH_KERNEL(flash_decode_f16_d128, 128, true, true, 0, (128))
FLASH_KERNEL(flash_attn_lds_f16_d64, 64, false, false, 0, (128))
FLASH_KERNEL(flash_attn_lds_f16_d128, 128, false, false, 0, (128))
FLASH_KERNEL(flash_decode_lds_f16_d64, 64, true, false, 0, (128))
FLASH_KERNEL(flash_decode_lds_f16_d128, 128, true, false, 0, (128))
// Form 1 (fast exp2) and form 2 (+ 32-bit shared addresses); the d128 prefill kernel of
// form 2 also held to 3 blocks per SM (≤ 168 registers).
FLASH_KERNEL(flash_attn_fx_f16_d64, 64, false, true, 1, (128))
FLASH_KERNEL(flash_attn_fx_f16_d128, 128, false, true, 1, (128))
FLASH_KERNEL(flash_decode_fx_f16_d64, 64, true, true, 1, (128))
FLASH_KERNEL(flash_decode_fx_f16_d128, 128, true, true, 1, (128))
FLASH_KERNEL(flash_attn_sa_f16_d64, 64, false, true, 2, (128))
FLASH_KERNEL(flash_attn_sa_f16_d128, 128, false, true, 2, (128))
FLASH_KERNEL(flash_attn_sa3_f16_d128, 128, false, true, 2, (128, 3))
FLASH_KERNEL(flash_decode_sa_f16_d64, 64, true, true, 2, (128))
FLASH_KERNEL(flash_decode_sa_f16_d128, 128, true, true, 2, (128))
// Form 3: warpgroup MMAs (launched on sm_90 only, where the module is built for sm_90a),
// head_dim 128 only: the head_dim-64 instance (9/3 heads in the attention test) was
// wrong by 0.82 of the value range (16/4 and 9/3 heads), with either shared layout
// tried, and still with the operands pinned before wgmma.fence and S's first k-step at
// scale-d 0; cause not found.
// wg3 is also held to 3 blocks per SM (≤ 168 registers, a few bytes spilled).
FLASH_KERNEL(flash_attn_wg_f16_d128, 128, false, true, 3, (128))
FLASH_KERNEL(flash_attn_wg3_f16_d128, 128, false, true, 3, (128, 3))

// ---- Flash prefill, warp-specialized (after FlashAttention-3; sm_90a, head_dim 128) ----
// "pp": a producer and two consumer warpgroups. A block of 384 threads takes a tile of
// up to 128 query rows (⌊128 / group⌋ tokens × the group's heads, built by the backend
// for this kernel) against one KV head. Warpgroup 0, the producer, copies 128-key K and
// V tiles by cp.async into a ring of PP_STAGES stages; each of its threads arrives on
// the stage's "full" mbarrier when its own copies are in (cp.async.mbarrier.arrive), so
// it runs up to PP_STAGES tiles ahead. Warpgroups 1 and 2, the consumers (rows 0–63 and
// 64–127), share every tile, so a block reads the keys once for 128 rows (the
// one-warpgroup kernel: once per 64), and arrive on the stage's "empty" mbarrier when
// done with it. A consumer issues S = Q·Kᵀ of tile n together with O += P·V of tile
// n − 1, then tile n's softmax. (The source waits for that P·V after the softmax, but
// ptxas moves the wait to its start, ahead of the stage's release; pinning it after the
// softmax, with K and V on barriers of their own so K's half could be released early,
// measured slower: docs/PERF.md, thirtieth session.) With FLASH_PP_TURNS the two
// consumers also take turns at the tensor cores (named barriers 1 and 2, FA3's
// ping-pong); measured level, so off by default. The producer hands its registers to
// the consumers (setmaxnreg: 40 and 232, within the 168 × 384 the block is launched
// with). Masks, the online softmax, the lazy rescale, the output and the splits'
// partials are flash_attn_impl's (same arguments, FLASH_ARGS); the splits' key chunks
// are multiples of PP_KEYS.
#define PP_KEYS 128
#define PP_STAGES 3
#define PP_TILE_BYTES (PP_KEYS * 128 * 2)  // one K or V tile, head_dim 128, f16
// (mod.rs' flash_smem_bytes gives the same: the ring, the 1024-byte alignment's slack,
// the full and empty mbarriers.)
#define PP_SMEM_BYTES (PP_STAGES * 2 * PP_TILE_BYTES + 1024 + 16 * PP_STAGES)
// An arrival on the mbarrier once all this thread's earlier cp.async copies are in (the
// barrier's expected count includes it).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Named barriers 1 and 2 (0 is __syncthreads'): `n` threads of the block arrive in all.
__device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
// Waits until at most one group of wgmmas is in flight (the newest); `acc` (the older
// group's accumulators) pinned after the wait.
template <int N>
__device__ __forceinline__ void wg_wait1(float* acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    wg_pin<N>(acc);
#endif
}

// The lean producer's copies of one 128-key tile's K and V (power-of-two cache blocks).
// `at` is the thread's place in the stage's K half (V's is PP_TILE_BYTES on). Per pass
// one block-table read and one 64-bit multiply-add; a whole tile needs no mask or select;
// keys past k1 read as zeros (no table read). The general loop in flash_pp_impl computes
// the same addresses for any block size, but the compiler kept its division path in line
// for every pass: ncu counted 732 instructions per tile for each producer warp there,
// more than a consumer warp's 588.
// (`blk_stride`, one cache block's elements over all KV heads, fits 32 bits.)
__device__ __forceinline__ void pp_copy_lean(unsigned at, const unsigned short* my_src, const unsigned int* table, int kb,
                                             int k1, int my_key, int bs_shift, unsigned blk_stride, long long half,
                                             const unsigned short* cache) {
    constexpr int KPP = 8, PASSES = PP_KEYS / KPP;  // (16 threads a key row at head_dim 128)
    const unsigned mask = (1u << bs_shift) - 1;
    if (kb + PP_KEYS <= k1) {  // a whole tile: no key to mask, no select
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const unsigned j = kb + my_key + p * KPP;
            const unsigned blk = __ldg(table + (j >> bs_shift));
            const unsigned short* src = my_src + ((unsigned long long)blk * blk_stride + ((j & mask) << 7));
            cp_async16_at(at + p * 1024, src, 16);
            cp_async16_at(at + PP_TILE_BYTES + p * 1024, src + half, 16);
        }
        return;
    }
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int j = kb + my_key + p * KPP;
        const bool ok = j < k1;
        const unsigned short* src = cache;
        if (ok) {
            const unsigned blk = __ldg(table + ((unsigned)j >> bs_shift));
            // One IMAD.WIDE: the block's elements and the key's row within it.
            src = my_src + ((unsigned long long)blk * blk_stride + (((unsigned)j & mask) << 7));
        }
        const int bytes = ok ? 16 : 0;
        cp_async16_at(at + p * 1024, src, bytes);
        cp_async16_at(at + PP_TILE_BYTES + p * 1024, ok ? src + half : cache, bytes);
    }
}

// LEAN: the producer's copies by pp_copy_lean where the cache blocks are a power of two.
// FLASH_PP_ROPE_Q: q rotated as loaded by the cos/sin in `rope_cs` (rope_write_k_f16's).
template <bool LEAN>
__device__ __forceinline__ void flash_pp_impl(FLASH_ARGS, const float* rope_cs, int interleaved) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int HD = 128;
    constexpr int KS = HD / 16;       // k-steps of S over head_dim
    constexpr int DT = HD / 8;        // n-tiles of O over head_dim
    constexpr int NT = PP_KEYS / 8;   // key n-tiles of S per tile
    constexpr unsigned KV_BYTES = PP_TILE_BYTES;
    extern __shared__ __align__(1024) unsigned char pp_smem[];
    // The tiles on a 1024-byte boundary (the 128-byte swizzle's repeat), in the layout of
    // flash_attn_impl's WG form with 128-key halves: K at stage·2·KV_BYTES, V after it;
    // then full[s] and empty[s] mbarriers.
    const unsigned kvs_at = ((unsigned)__cvta_generic_to_shared(pp_smem) + 1023u) & ~1023u;
    const unsigned full_at = kvs_at + PP_STAGES * 2 * KV_BYTES, empty_at = full_at + 8 * PP_STAGES;
    static_assert(PP_STAGES * 2 * PP_TILE_BYTES + 1008 + 16 * PP_STAGES <= PP_SMEM_BYTES, "the ring and barriers fit");
    const int* tile = tiles + 4 * blockIdx.x;
    const int row0 = tile[0], ntok = tile[1], pos0 = tile[2];
    const unsigned int* table = tables + tile[3];
    const int kvh = blockIdx.y, grp = n_heads / n_kv, z = blockIdx.z, splits = gridDim.z;
    int k0 = 0, k1 = pos0 + ntok;
    if (splits > 1) {
        const int chunk = ((max_ctx[0] + splits - 1) / splits + PP_KEYS - 1) / PP_KEYS * PP_KEYS;
        k0 = z * chunk;
        k1 = min(k1, k0 + chunk);
    }
    const int n_tiles = k0 < k1 ? (k1 - k0 + PP_KEYS - 1) / PP_KEYS : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < PP_STAGES; s++) {
            mbar_init(full_at + 8 * s, 128);   // the producer's threads, each once its copies are in
            mbar_init(empty_at + 8 * s, 256);  // the consumers' threads, once done with the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        // Producer: each thread one 16-byte column of every 8th key (K and V), so the
        // block-table read and the 64-bit product are per key, and with power-of-two
        // cache blocks of ≥ 16 keys one per pair of keys (tiles start at multiples of 128).
        setmaxnreg_dec<40>();
        constexpr int CH = HD / 8, KPP = 128 / CH, PASSES = PP_KEYS / KPP;
        const int my_c = (threadIdx.x % CH) * 8, my_key = threadIdx.x / CH;
        const unsigned my_off = (my_c / 64) * (PP_KEYS * 128) + my_key * 128 + ((((my_c / 8) & 7) ^ (my_key & 7)) << 4);
        const bool pair = (flags & FLASH_PAIR_LOADS) && (block_size & (block_size - 1)) == 0 && block_size >= 2 * KPP;
        const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
        const int bs_shift = __ffs(block_size) - 1;
        const unsigned short* my_src = cache + (size_t)kvh * block_size * HD + my_c;
        const size_t blk_stride = (size_t)n_kv * block_size * HD;
        if (LEAN && bs_pow2) {
            for (int n = 0; n < n_tiles; n++) {
                const int s = n % PP_STAGES;
                mbar_wait(empty_at + 8 * s, ((n / PP_STAGES) & 1) ^ 1);
                pp_copy_lean(kvs_at + s * 2 * KV_BYTES + my_off, my_src, table, k0 + n * PP_KEYS, k1, my_key, bs_shift,
                             (unsigned)blk_stride, half, cache);
                cp_async_mbar_arrive(full_at + 8 * s);
            }
            asm volatile("cp.async.wait_all;\n" ::: "memory");
            return;
        }
        for (int n = 0; n < n_tiles; n++) {
            const int s = n % PP_STAGES, kb = k0 + n * PP_KEYS;
            mbar_wait(empty_at + 8 * s, ((n / PP_STAGES) & 1) ^ 1);
            const unsigned at = kvs_at + s * 2 * KV_BYTES + my_off;
            const unsigned short* prev = nullptr;
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int j = kb + my_key + p * KPP;
                const unsigned short* src = nullptr;
                if (j < k1) {
                    if (pair && (p & 1)) {
                        src = prev + KPP * HD;  // key j − KPP < k1, same block
                    } else {
                        const int bi = bs_pow2 ? j >> bs_shift : j / block_size;
                        src = my_src + table[bi] * blk_stride + (size_t)(j - bi * block_size) * HD;
                    }
                }
                prev = src;
                const int bytes = src ? 16 : 0;
                cp_async16_at(at + p * 1024, bytes ? src : cache, bytes);
                cp_async16_at(at + KV_BYTES + p * 1024, bytes ? src + half : cache, bytes);
            }
            cp_async_mbar_arrive(full_at + 8 * s);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // (no copy left in flight at exit)
        return;
    }
    setmaxnreg_inc<232>();
    const int c = wg - 1;  // consumer 0: rows 0–63, 1: rows 64–127
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int w = (n_heads + 2 * n_kv) * HD;
    const int nrows = ntok * grp;
    const int ra = 64 * c + warp * 16 + g, rb = ra + 8;
    const int ca = min(ra, nrows - 1), cb = min(rb, nrows - 1);
    const int ta = ca / grp, tb = cb / grp;
    const int ha = kvh * grp + ca % grp, hb = kvh * grp + cb % grp;
    const int pa = pos0 + ta, pb = pos0 + tb;
    const float qs = scale * 1.4426950408889634f;
    unsigned qf[KS][4];
    {
        const float *qa = qkv + (size_t)(row0 + ta) * w + ha * HD, *qb = qkv + (size_t)(row0 + tb) * w + hb * HD;
        if (flags & FLASH_PP_ROPE_Q)
            flash_load_q_rope<HD>(qf, qa, qb, qs, t4, rope_cs + (size_t)(row0 + ta) * HD,
                                  rope_cs + (size_t)(row0 + tb) * HD, interleaved);
        else
            flash_load_q<HD>(qf, qa, qb, qs, t4);
    }
    // Keys before this are in every row of the warp's past (rows are in position order).
    const int warp_first = pos0 + min(64 * c + warp * 16, nrows - 1) / grp;
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float s[NT][4];
    unsigned pf[NT / 2][4];
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    // S of the tile at kb (stage st) onto the tensor cores (K-major B, as the WG form).
    auto issue_s = [&](int st) {
        const unsigned ks_at = kvs_at + st * 2 * KV_BYTES;
#pragma unroll
        for (int k = 0; k < KS; k++) {
            const unsigned at = ks_at + (k / 4) * (PP_KEYS * 128) + (k % 4) * 32;
            wgmma_rs<PP_KEYS, 0>(&s[0][0], qf[k], wg_desc_sw128(at, 16, 1024), k != 0);
        }
        wg_commit();
    };
    // O += P·V of the tile in stage st (N-major B: 16 keys per k-step).
    auto issue_pv = [&](int st) {
        const unsigned vs_at = kvs_at + st * 2 * KV_BYTES + KV_BYTES;
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++)
            wgmma_rs<HD, 1>(&o[0][0], pf[kk], wg_desc_sw128(vs_at + kk * 2048, PP_KEYS * 128, 1024));
        wg_commit();
    };
    // The softmax of the S of the tile at kb: mask, row maxima, exponentials and sums;
    // returns O's rescale factors (applied by the caller once its P·V is done).
    auto softmax = [&](int kb, float& a0, float& a1) {
        if (!(flags & FLASH_MASK_EDGE) || kb + PP_KEYS > min(warp_first + 1, k1)) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int j = kb + nt * 8 + 2 * t4 + e;
                    if (j > pa || j >= k1) s[nt][e] = NEG_INF;
                    if (j > pb || j >= k1) s[nt][2 + e] = NEG_INF;
                }
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        // A row may have no key yet (a split before its position).
        const float r0 = n0 == NEG_INF ? 0.f : n0, r1 = n1 == NEG_INF ? 0.f : n1;
        a0 = fa_exp2<true>(m0 - r0);
        a1 = fa_exp2<true>(m1 - r1);
        m0 = n0;
        m1 = n1;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][0] = fa_exp2<true>(s[nt][0] - r0);
            s[nt][1] = fa_exp2<true>(s[nt][1] - r0);
            s[nt][2] = fa_exp2<true>(s[nt][2] - r1);
            s[nt][3] = fa_exp2<true>(s[nt][3] - r1);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            rs0 += s[nt][0] + s[nt][1];
            rs1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * a0 + rs0;  // this thread's columns only; summed over the quad at the end
        l1 = l1 * a1 + rs1;
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) {
            pf[kk][0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
            pf[kk][1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
            pf[kk][2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pf[kk][3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    };
    auto rescale = [&](float a0, float a1) {
        if (!(flags & FLASH_LAZY_RESCALE) || !__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f))
#pragma unroll
            for (int d = 0; d < DT; d++) {
                o[d][0] *= a0;
                o[d][1] *= a0;
                o[d][2] *= a1;
                o[d][3] *= a1;
            }
    };
    const bool turns = flags & FLASH_PP_TURNS;
    const int mine = 1 + c, other = 2 - c;  // the named barriers this consumer waits on / signals
    if (turns && c == 1) named_bar_arrive(1, 256);  // consumer 0 takes the first turn
    if (n_tiles > 0) {
        // Turn 0: S of tile 0.
        mbar_wait(full_at, 0);
        fence_proxy_async();  // the producer's copies, seen through the barrier, to wgmma
        if (turns) named_bar_sync(mine, 256);
        wg_fence();
        issue_s(0);
        if (turns) named_bar_arrive(other, 256);
        wg_wait<NT * 4>(&s[0][0]);
        float a0, a1;
        softmax(k0, a0, a1);
        pack_p();
        // Turns 1 … n_tiles − 1: S of tile n with P·V of tile n − 1.
        for (int n = 1; n < n_tiles; n++) {
            const int st = n % PP_STAGES, prev = (n - 1) % PP_STAGES;
            mbar_wait(full_at + 8 * st, (n / PP_STAGES) & 1);
            fence_proxy_async();
            if (turns) named_bar_sync(mine, 256);
            wg_pin<DT * 4>(&o[0][0]);
            wg_pin_u<NT * 2>(&pf[0][0]);
            wg_fence();
            issue_s(st);
            issue_pv(prev);
            if (turns) named_bar_arrive(other, 256);
            wg_wait1<NT * 4>(&s[0][0]);
            softmax(k0 + n * PP_KEYS, a0, a1);
            wg_wait<DT * 4>(&o[0][0]);
            mbar_arrive(empty_at + 8 * prev);
            rescale(a0, a1);
            pack_p();
        }
        // The last turn: P·V of the last tile.
        const int last = (n_tiles - 1) % PP_STAGES;
        if (turns) named_bar_sync(mine, 256);
        wg_pin<DT * 4>(&o[0][0]);
        wg_pin_u<NT * 2>(&pf[0][0]);
        wg_fence();
        issue_pv(last);
        if (turns) named_bar_arrive(other, 256);
        wg_wait<DT * 4>(&o[0][0]);
        mbar_arrive(empty_at + 8 * last);
    }
    if (turns && c == 0) named_bar_sync(1, 256);  // consumer 1's last arrival
    l0 += __shfl_xor_sync(0xffffffff, l0, 1);
    l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1);
    l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    flash_store_rows<HD>(o, m0, m1, l0, l1, ra < nrows, rb < nrows, row0 + ta, row0 + tb, ha, hb, n_heads, t4, z,
                         splits, out, part, flags);
#else
    __trap();
#endif
}
#define PP_KERNEL(NAME, LEAN) \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(FLASH_ARGS, const float* rope_cs, int interleaved) { \
        pdl_wait(); \
        flash_pp_impl<LEAN>(FLASH_CALL, rope_cs, interleaved); \
    }
PP_KERNEL(flash_attn_pp_f16_d128, true)
PP_KERNEL(flash_attn_ppg_f16_d128, false)  // the general producer loop (DISAGG_CUDA_FLASH_PP_LEAN=0)

// ---- Decode attention with the keys as the MMA's M ("KM") ----
// One query token per tile (decode), the query heads of one KV head (group ≤ 8) as the
// N = 8 columns: per warp S^T = K·Q^T (16 keys × 8 heads), then O^T += V^T·P^T (head_dim
// as M), P^T made from S^T's accumulator layout by movmatrix.trans. Against the WS form
// above, whose 16-row tiles hold only the group's rows (4 of 16 for Llama-3-8B), a tile
// costs half the MMAs, accumulators (32 floats of O per thread) and exponentials, and far
// fewer registers (90–93 against 157 at head_dim 128), so more blocks stay resident and
// the ring of K/V stages can be three deep. Arguments as the flash kernels' (FLASH_ARGS;
// `flags` unused: the form always loads by ldmatrix with lean per-key addresses, the
// bare ex2 and 32-bit shared offsets). Keys past the end read as zeros and are masked;
// split z covers the same key chunk as the flash kernels', partials in their layout
// (attention_merge).

// The transpose of an 8×8 b16 matrix held in the MMA fragment layout (lane T: row T/4,
// columns 2(T%4), 2(T%4)+1), in the same layout.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

// Cluster barrier (all threads of every block of the cluster), release/acquire; with
// `relaxed` the arrive has no release: for where no thread's writes need be seen by another
// block after it. A relaxed arrive does not wait for the thread's loads still in flight,
// so their values must have been used before it.
__device__ __forceinline__ void cluster_sync_all(bool relaxed = false) {
#if __CUDA_ARCH__ >= 900
    if (relaxed)
        asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    else
        asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
// Four floats at shared address `a` of cluster block `rank`.
__device__ __forceinline__ float4 ld_dsmem_f4(unsigned a, unsigned rank) {
    float4 v;
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(r) : "memory");
#else
    v = make_float4(0.f, 0.f, 0.f, 0.f);
    __trap();
#endif
    return v;
}
// A float at shared address `a` of cluster block `rank` (sm_90).
__device__ __forceinline__ float ld_dsmem_f32(unsigned a, unsigned rank) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(r) : "memory");
#else
    __trap();
#endif
    return v;
}

// The key splits of one (row, KV head) launched as one cluster along z, merged in place of
// attention_merge: split z's partial for head hh (M, L, sums as attention_merge reads them)
// lies at cpart + hh·(HD + 2) in block z's shared memory; each block merges a share of the
// grp·HD outputs, reading the others' partials through the cluster, in attention_merge's
// order and arithmetic (the same bits), to `out` from `at` (f32, or bf16 with `bf16`).
// With `ilp` every split's M, L and sum come in one round of loads (at most 16 splits, the
// cluster's limit) and the same arithmetic follows; else M's loads, then each split's L
// and sum after its M is known (a round trip per split). With `relaxed_exit` the barrier
// that keeps each block's shared memory until the others have read it arrives without
// release, so the outputs' stores need not drain first; every value read from another
// block is used before it (the ILP form's L and sum of empty splits through `touched`).
template <int HD>
__device__ void cluster_merge(const float* cpart, int grp, int splits, int z, float* out, size_t at, bool bf16,
                              bool ilp, bool relaxed_exit) {
    cluster_sync_all();  // every split's partial written
    const unsigned base = smem_u32(cpart);
    float touched = 0.f;
    for (int i = z * blockDim.x + threadIdx.x; i < grp * HD; i += splits * blockDim.x) {
        const int hh = i / HD, d = i % HD;
        const unsigned p = base + hh * (HD + 2) * 4;
        float M = NEG_INF, L = 0.f, acc = 0.f;
        if (ilp) {
            float ms[16], ls[16], as[16];
#pragma unroll
            for (int s = 0; s < 16; s++)
                if (s < splits) {
                    ms[s] = ld_dsmem_f32(p, s);
                    ls[s] = ld_dsmem_f32(p + 4, s);
                    as[s] = ld_dsmem_f32(p + (2 + d) * 4, s);
                }
#pragma unroll
            for (int s = 0; s < 16; s++)
                if (s < splits) M = fmaxf(M, ms[s]);
#pragma unroll
            for (int s = 0; s < 16; s++)
                if (s < splits && ms[s] != NEG_INF) {
                    const float w = expf(ms[s] - M);
                    L += ls[s] * w;
                    acc += as[s] * w;
                }
            if (relaxed_exit)
#pragma unroll
                for (int s = 0; s < 16; s++)
                    if (s < splits) touched += ls[s] + as[s];
        } else {
            for (int s = 0; s < splits; s++) M = fmaxf(M, ld_dsmem_f32(p, s));
            for (int s = 0; s < splits; s++) {
                const float ms = ld_dsmem_f32(p, s);
                if (ms != NEG_INF) {
                    const float w = expf(ms - M);
                    L += ld_dsmem_f32(p + 4, s) * w;
                    acc += ld_dsmem_f32(p + (2 + d) * 4, s) * w;
                }
            }
        }
        if (bf16)
            ((unsigned short*)out)[at + i] = f32_to_bf16(acc / L);
        else
            out[at + i] = acc / L;
    }
    if (relaxed_exit) {
        // Every loaded value used before the arrive: a compare reads their sum, guarding a
        // store to this block's own scratch that nothing reads (in asm, so that neither
        // compiler drops the use).
        __shared__ float sink;
#if __CUDA_ARCH__ >= 900
        asm volatile("{\n.reg .pred p;\nsetp.eq.f32 p, %0, 0f0DA24260;\n@p st.shared.f32 [%1], %0;\n}\n" ::"f"(touched),
                     "r"(smem_u32(&sink))
                     : "memory");
#endif
    }
    cluster_sync_all(relaxed_exit);  // no block leaves while another still reads its shared memory
}

#define KM_KEYS 64
#define KM_SMEM_BYTES(HD, STAGES) ((STAGES) * 2 * KM_KEYS * ((HD) + 8) * 2)
// With an FP8 cache the stages hold the tiles' bytes as stored (rows of head_dim + 16
// bytes, so the 8 rows of an ldmatrix fall in distinct banks).
#define KM_SMEM_BYTES_FP8(HD, STAGES) ((STAGES) * 2 * KM_KEYS * ((HD) + 16))

// With FLASH_ROPE the kernel also does what rope_write_kv_groups does for its row before
// it (one launch per layer fewer): it rotates the group's q as it reads them (the same
// cos/sin and rotation, so the same bits), and the block whose keys end at the row's own
// position rotates k and stores k and v at the row's slot before it loads that key.
// KT: the cache's element, f16 bits or FP8 E4M3 bytes. With FP8 a stage holds the bytes
// as stored and the MMAs' A fragments come from ldmatrix over them, each register's four
// bytes converted to two f16 pairs (exactly) on the way:
// - K (S^T = K · Q^T): an 8 × 16-byte matrix gives lane (g, t4) key g's dims 4t4..4t4+3
//   of a 16-dim chunk, which fill the k-columns 2t4, 2t4 + 1 and 2t4 + 8, 2t4 + 9 of
//   that chunk's MMA; q's B fragments take the same dims (dims 4t4, +1 and +2, +3), so
//   each MMA sums the same 16 products as the f16 form, in another order;
// - V (O^T += V^T · P^T): ldmatrix.trans of 2-byte elements gives lane (g, t4) keys
//   2t4, 2t4 + 1 at dims 2g, 2g + 1; a byte permute makes the pairs (dim 2g: both keys)
//   and (dim 2g + 1: both keys), the A rows g and g + 8 of the chunk's MMA, so O^T's
//   rows are the chunk's dims in the order 0, 2, …, 14, 1, 3, …, 15, undone at the end.
// Half of the f16 form's ldmatrix count, and no pass through shared memory for the
// conversion.
// LAB: forms of the tile loop that only `tools/gpu-lab/decodelab.cu` instantiates (the
// engine's kernels are LAB 0, so their code is as without them): KM_LAB_S_ILP, a tile's f16
// scores summed in two chains of MMAs (even and odd 16-dim chunks) and added at the end,
// half the chain before the softmax (other bits); KM_LAB_LATE_LOAD, the next tile asked
// for after this tile's scores and softmax instead of before them; KM_LAB_SPLIT_LOAD (with
// FLASH_BATCH_LOADS, cp.async), the next tile's block-table entries asked for before this
// tile's scores and its copies after the softmax, so the entries' round trip runs under them.
#define KM_LAB_S_ILP 1
#define KM_LAB_LATE_LOAD 2
#define KM_LAB_SPLIT_LOAD 4
template <int HD, int STAGES, typename KT, int LAB = 0>
__device__ void flash_decode_km_impl(const float* qkv, const KT* cache, long long half, const int* tiles,
                                     const unsigned int* tables, int n_heads, int n_kv, int block_size, float scale,
                                     const int* max_ctx, float* out, float* part, int flags, const float* inv_freq,
                                     const long long* slots, int interleaved) {
    constexpr bool F8 = sizeof(KT) == 1;
    static_assert(HD % 32 == 0 && (HD + 4) * 4 * 8 * 4 + 256 + 8 * (HD + 2) * 4 <=
                                      (F8 ? KM_SMEM_BYTES_FP8(HD, STAGES) : KM_SMEM_BYTES(HD, STAGES)),
                  "the parts fit the stages");
    // CH: 16-byte chunks of a row as stored; EPC: elements per chunk; RB: a staged row's
    // bytes (padded by 16); ST: an f16 row's halves (padded by 8).
    constexpr int KS = HD / 16, DT = HD / 16, EPC = 16 / sizeof(KT), CH = HD / EPC, KPP = 128 / CH,
                  PASSES = KM_KEYS / KPP, ST = HD + 8, RB = F8 ? HD + 16 : ST * 2;
    static_assert(128 % CH == 0 && KM_KEYS % KPP == 0, "whole passes of the 128 threads");
    constexpr unsigned KBYTES = KM_KEYS * RB, STAGE_BYTES = 2 * KBYTES;
    KM_STAMP(0);
    extern __shared__ __align__(16) unsigned char km_smem[];
    const unsigned base = smem_u32(km_smem);
    const int* tile = tiles + 4 * blockIdx.x;
    const int row0 = tile[0], pos0 = tile[2];
    const unsigned int* table = tables + tile[3];
    const int kvh = blockIdx.y, grp = n_heads / n_kv, z = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int w = (n_heads + 2 * n_kv) * HD;
    const float qs = scale * 1.4426950408889634f;
    const bool rope = (flags & FLASH_ROPE) != 0, bulk = (flags & FLASH_BULK) != 0;
    constexpr int HH = HD / 2;
    __shared__ float rope_c[HH], rope_s[HH];
    // FLASH_BULK: a stage's barrier counts its tile's bytes in.
    __shared__ __align__(8) unsigned long long km_bar[STAGES];
    const unsigned bar0 = smem_u32(km_bar);
    if (bulk) {
        if (threadIdx.x == 0) {
            for (int i = 0; i < STAGES; i++) mbar_init(bar0 + 8 * i, 1);
            fence_proxy_async();  // the initialised barriers visible to the copies' updates
        }
        __syncthreads();
    }
    // q's values as this lane's B fragments take them (FLASH_BATCH_LOADS): lane (g, t4),
    // head g of the group (columns past it load head 0 and are zeroed when packed).
    // FP8: the k-columns 2t4, 2t4 + 1 | 2t4 + 8, 2t4 + 9 are dims 4t4, +1 | +2, +3.
    constexpr int B1 = F8 ? 2 : 8;
    const bool q_real = g < grp;
    const float* q_row = qkv + (size_t)row0 * w + (kvh * grp + (q_real ? g : 0)) * HD;
    auto q_col = [&](int ks, int e) { return 16 * ks + (F8 ? 4 : 2) * t4 + (e >> 1) * B1 + (e & 1); };
    float qx[KS][4];
    auto load_q = [&]() {
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int e = 0; e < 4; e++) qx[ks][e] = q_row[q_col(ks, e)];
    };
    // FLASH_WAIT_FIRST: the kernel before has finished (no early trigger), so waiting costs
    // nothing here, and q's loads, asked for now, share their round trip with the first
    // tiles' block-table entries below instead of following their copies.
    const bool wait_first = (flags & FLASH_WAIT_FIRST) != 0 && (flags & FLASH_BATCH_LOADS) != 0;
    if (wait_first) {
        pdl_wait();
        load_q();
    }
    // FLASH_KV_EARLY (with RoPE, after the wait above): this thread's RoPE frequency and its
    // share of the row's k and v (one pair of k, one value of v: head_dim ≤ 128 for 128
    // threads) asked for beside q, and RoPE's cos/sin computed after the early tiles are
    // asked for, so neither the cos/sin nor the k/v write waits for a load of its own
    // (unsplit, every block holds its row's key and writes it). The same values: the same bits.
    // With 128 threads and head_dim ≤ 128 the loops below over pairs and dims run at most
    // once a thread (j = threadIdx.x), so the preloaded values are that iteration's.
    static_assert(HD <= 128, "a thread's share of k and v in registers");
    const bool preload = (flags & FLASH_KV_EARLY) != 0 && rope && wait_first;
    float fx = 0.f, kx0 = 0.f, kx1 = 0.f, vx = 0.f;
    auto rope_tables = [&]() {
        for (int j = threadIdx.x; j < HH; j += blockDim.x)
            rope_cs((float)pos0, preload ? fx : inv_freq[j], rope_c[j], rope_s[j]);
        __syncthreads();
    };
    if (preload && threadIdx.x < HH) fx = inv_freq[threadIdx.x];
    if (rope && !preload) rope_tables();
    // Pair j's dims (a, b), as rope_write_kv_impl pairs them.
    auto pair_a = [&](int j) { return interleaved ? 2 * j : j; };
    auto pair_b = [&](int j) { return interleaved ? 2 * j + 1 : j + HH; };
    // The pair that dim c of a head belongs to.
    auto pair_of = [&](int c) { return interleaved ? c >> 1 : (c < HH ? c : c - HH); };
    // Dim c of a q head (rotated with RoPE here).
    auto q_at = [&](const float* q, int c) {
        if (!rope) return q[c];
        const int j = pair_of(c);
        float x0 = q[pair_a(j)], x1 = q[pair_b(j)];
        rope_apply(rope_c[j], rope_s[j], x0, x1);
        return c == pair_a(j) ? x0 : x1;
    };
    // O^T accumulators: o[dt][0] dim 16dt + g, head 2t4; [1] head 2t4 + 1; [2], [3] dim + 8.
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // heads 2t4, 2t4 + 1 (this warp's keys)
    int k0 = 0, k1 = pos0 + 1;
    if (splits > 1) {
        const int chunk = ((max_ctx[0] + splits - 1) / splits + FA_KEYS - 1) / FA_KEYS * FA_KEYS;
        k0 = z * chunk;
        k1 = min(k1, k0 + chunk);
    }
    // Lean loads: a thread keeps one 16-byte column and steps over keys.
    const int my_c = (threadIdx.x % CH) * EPC, my_key = threadIdx.x / CH;
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    auto block_of = [&](int j) { return bs_pow2 ? j >> bs_shift : j / block_size; };  // key j's cache block
    const KT* head_src = cache + (size_t)kvh * block_size * HD;  // this KV head's rows
    const KT* my_src = head_src + my_c;
    const size_t blk_stride = (size_t)n_kv * block_size * HD;
    // FLASH_BATCH_LOADS: the block-table entries of this thread's keys of the tile from key
    // kb, then their copies into the stage at `at` (`stage_at`).
    auto table_entries = [&](int kb, int* bi, unsigned* blk) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int j = min(kb + my_key + p * KPP, k1 - 1);
            bi[p] = block_of(j);
            blk[p] = table[bi[p]];
        }
    };
    auto stage_at = [&](int st) { return base + st * STAGE_BYTES + my_key * RB + my_c * sizeof(KT); };
    auto batch_copies = [&](int kb, unsigned at, const int* bi, const unsigned* blk) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int j = kb + my_key + p * KPP;
            const bool real = j < k1;
            const KT* src = real ? my_src + blk[p] * blk_stride + (size_t)(j - bi[p] * block_size) * HD : cache;
            cp_async16_at(at + p * KPP * RB, src, real ? 16 : 0);
            cp_async16_at(at + KBYTES + p * KPP * RB, real ? src + half : cache, real ? 16 : 0);
        }
    };
    auto load_tile = [&](int kb, int st) {
        if (kb < k1 && bulk) {
            // Thread t copies key t % 64's K (t < 64) or V row: keys past the end copy
            // the last key again (finite values; their scores are masked).
            static_assert(2 * KM_KEYS == 128, "a key row per thread");
            const unsigned bar = bar0 + 8 * st;
            if (threadIdx.x == 0) mbar_arrive_expect_tx(bar, 2 * KM_KEYS * HD * sizeof(KT));
            const int r = threadIdx.x % KM_KEYS, j = min(kb + r, k1 - 1);
            const int bi = block_of(j);
            const KT* src =
                head_src + table[bi] * blk_stride + (size_t)(j - bi * block_size) * HD + (threadIdx.x < KM_KEYS ? 0 : half);
            bulk_copy_g2s(base + st * STAGE_BYTES + (threadIdx.x / KM_KEYS) * KBYTES + r * RB, src, HD * sizeof(KT), bar);
        } else if (kb < k1 && (flags & FLASH_BATCH_LOADS)) {
            // Every pass's block-table entry asked for before the first copy needs one (keys
            // past the end read the last key's entry), so the copies wait for one round trip.
            const unsigned at = stage_at(st);
            int bi[PASSES];
            unsigned blk[PASSES];
            table_entries(kb, bi, blk);
            batch_copies(kb, at, bi, blk);
        } else if (kb < k1) {
            const unsigned at = stage_at(st);
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int j = kb + my_key + p * KPP;
                const KT* src = cache;
                int bytes = 0;
                if (j < k1) {
                    const int bi = block_of(j);
                    src = my_src + table[bi] * blk_stride + (size_t)(j - bi * block_size) * HD;
                    bytes = 16;
                }
                cp_async16_at(at + p * KPP * RB, src, bytes);
                cp_async16_at(at + KBYTES + p * KPP * RB, bytes ? src + half : cache, bytes);
            }
        }
        if (!bulk) cp_async_commit();
    };
    const int ntiles = k1 > k0 ? (k1 - k0 + KM_KEYS - 1) / KM_KEYS : 0;
    // RoPE: the row's k (rotated) and v into the cache, by the block holding its key.
    const bool writes_kv = rope && k0 <= pos0 && pos0 < k1;
    auto write_kv = [&]() {
        const long long slot = slots[row0];
        const long long blk = slot / block_size, off = slot % block_size;
        const size_t at = (size_t)(((blk * n_kv + kvh) * block_size + off) * HD);
        const float* k = qkv + (size_t)row0 * w + (size_t)(n_heads + kvh) * HD;
        const float* v = k + (size_t)n_kv * HD;
        KT* c = const_cast<KT*>(cache);
        for (int j = threadIdx.x; j < HH; j += blockDim.x) {
            float x0 = preload ? kx0 : k[pair_a(j)], x1 = preload ? kx1 : k[pair_b(j)];
            rope_apply(rope_c[j], rope_s[j], x0, x1);
            kv_store(c, at + pair_a(j), x0);
            kv_store(c, at + pair_b(j), x1);
        }
        for (int d = threadIdx.x; d < HD; d += blockDim.x) kv_store(c, (size_t)half + at + d, preload ? vx : v[d]);
        if (bulk) fence_proxy_async_global();  // the bulk copies of the tile read them
    };
    // FLASH_KV_EARLY: the row's k and v asked for beside q (the wait for the kernel that
    // wrote them is done).
    if (preload && writes_kv) {
        const float* k = qkv + (size_t)row0 * w + (size_t)(n_heads + kvh) * HD;
        if (threadIdx.x < HH) kx0 = k[pair_a(threadIdx.x)], kx1 = k[pair_b(threadIdx.x)];
        if (threadIdx.x < HD) vx = k[(size_t)n_kv * HD + threadIdx.x];
    }
    // With FLASH_EARLY the first tiles of keys before the row's own (written by earlier
    // steps) are asked for before waiting for the kernel before, which wrote q (and,
    // without FLASH_ROPE, the row's k and v); with FLASH_WAIT_FIRST, after that wait,
    // beside q's loads.
    int pre = 0;
    if (flags & FLASH_EARLY)
        for (; pre < STAGES - 1 && k0 + (pre + 1) * KM_KEYS <= pos0; pre++) load_tile(k0 + pre * KM_KEYS, pre);
    if (preload) rope_tables();
    KM_STAMP(1);
    if (!wait_first) pdl_wait();
    KM_STAMP(2);
    // Q^T as B fragments (k = dims, n = heads): b0 = dims 16ks + 2t4, +1 of head g; b1 = +8.
    // Columns past the group are zero (never written).
    unsigned qf[KS][2];
    {
        if (flags & FLASH_BATCH_LOADS) {
            // Every value loaded before any is used, so the loads take one round trip, not
            // one per pack. With RoPE each value's pair partner is one of the lane's own:
            // interleaved, column c ^ 1 (entry e ^ 1); else c ± HD/2 (the same entry KS/2
            // chunks on). The rotation is q_at's, on the same values: the same bits.
            if (!wait_first) load_q();
            if (rope) {
                float r[KS][4];
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int c = q_col(ks, e), j = pair_of(c);
                        const float own = qx[ks][e], other = interleaved ? qx[ks][e ^ 1] : qx[(ks + KS / 2) % KS][e];
                        const bool is_a = c == pair_a(j);
                        float x0 = is_a ? own : other, x1 = is_a ? other : own;
                        rope_apply(rope_c[j], rope_s[j], x0, x1);
                        r[ks][e] = is_a ? x0 : x1;
                    }
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
#pragma unroll
                    for (int e = 0; e < 4; e++) qx[ks][e] = r[ks][e];
            }
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                qf[ks][0] = q_real ? pack_f16x2(qx[ks][0] * qs, qx[ks][1] * qs) : 0u;
                qf[ks][1] = q_real ? pack_f16x2(qx[ks][2] * qs, qx[ks][3] * qs) : 0u;
            }
        } else {
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                const int c0 = 16 * ks + (F8 ? 4 : 2) * t4;
                qf[ks][0] = q_real ? pack_f16x2(q_at(q_row, c0) * qs, q_at(q_row, c0 + 1) * qs) : 0u;
                qf[ks][1] = q_real ? pack_f16x2(q_at(q_row, c0 + B1) * qs, q_at(q_row, c0 + B1 + 1) * qs) : 0u;
            }
        }
    }
    KM_STAMP(3);
    // The key's tile is the last: in the first loads, write it before them; else the
    // loop loads it after its first barrier, which orders the write before the load.
    if (writes_kv && ntiles < STAGES) {
        write_kv();
        __syncthreads();
    }
    for (int i = pre; i < STAGES - 1; i++) load_tile(k0 + i * KM_KEYS, i);
    if (writes_kv && ntiles >= STAGES) write_kv();
    for (int i = 0; i < ntiles; i++) {
        if (bulk)
            mbar_wait(bar0 + 8 * (i % STAGES), (i / STAGES) & 1);
        else
            cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile i staged by all; tile i − 1's stage free
        // The next tile (key kn, into stage sn): asked for here, or in the lab forms
        // wholly or in part after this tile's softmax (`rest_of_load`).
        const int kn = k0 + (i + STAGES - 1) * KM_KEYS, sn = (i + STAGES - 1) % STAGES;
        constexpr bool late = (LAB & KM_LAB_LATE_LOAD) != 0;
        const bool split_load = (LAB & KM_LAB_SPLIT_LOAD) != 0 && !bulk && (flags & FLASH_BATCH_LOADS);
        int nbi[PASSES];
        unsigned nblk[PASSES];
        if (split_load) {
            if (kn < k1) table_entries(kn, nbi, nblk);
        } else if (!late) {
            load_tile(kn, sn);
        }
        auto rest_of_load = [&]() {
            if (split_load) {
                if (kn < k1) batch_copies(kn, stage_at(sn), nbi, nblk);
                cp_async_commit();
            } else if (late) {
                load_tile(kn, sn);
            }
        };
        const int kw = k0 + i * KM_KEYS + 16 * warp;  // this warp's first key
        if (kw >= k1) {
            rest_of_load();
            continue;
        }
        const unsigned ks_at = base + (i % STAGES) * STAGE_BYTES, vs_at = ks_at + KBYTES;
        // FP8: lane l's row address for ldmatrix: key 16·warp + l % 8 (+ 8 for matrices 1
        // and 3) of chunk l / 16 (of a pair of 16-byte chunks); K's and V's the same.
        const unsigned f8_row = (16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8) * RB + (lane >> 4) * 16;
        // S^T (16 keys × 8 heads) = K · Q^T: A = K rows by ldmatrix.
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        if (F8) {
#pragma unroll
            for (int kk = 0; kk < KS / 2; kk++) {
                unsigned r[4];
                ldsm_x4_at<false>(r[0], r[1], r[2], r[3], ks_at + f8_row + 32 * kk);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const unsigned x = r[2 * h], y = r[2 * h + 1];  // keys g, g + 8
                    unsigned a[4] = {e4m3x2_to_f16x2(x & 0xffff), e4m3x2_to_f16x2(y & 0xffff),
                                     e4m3x2_to_f16x2(x >> 16), e4m3x2_to_f16x2(y >> 16)};
                    mma_f16_16816(s, a, qf[2 * kk + h][0], qf[2 * kk + h][1]);
                }
            }
        } else {
            const unsigned a_row = ks_at + ((16 * warp + (lane & 15)) * ST + 8 * (lane >> 4)) * 2;
            if constexpr ((LAB & KM_LAB_S_ILP) != 0) {
                float s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < KS; ks += 2) {
                    unsigned a[4], b[4];
                    ldsm_x4_at<false>(a[0], a[1], a[2], a[3], a_row + 32 * ks);
                    ldsm_x4_at<false>(b[0], b[1], b[2], b[3], a_row + 32 * (ks + 1));
                    mma_f16_16816(s, a, qf[ks][0], qf[ks][1]);
                    mma_f16_16816(s2, b, qf[ks + 1][0], qf[ks + 1][1]);
                }
#pragma unroll
                for (int e = 0; e < 4; e++) s[e] += s2[e];
            } else {
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    unsigned a[4];
                    ldsm_x4_at<false>(a[0], a[1], a[2], a[3], a_row + 32 * ks);
                    mma_f16_16816(s, a, qf[ks][0], qf[ks][1]);
                }
            }
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
        if (!(flags & FLASH_LAZY_RESCALE) || !__all_sync(0xffffffffu, c0 == 1.f && c1 == 1.f))
#pragma unroll
            for (int d = 0; d < DT; d++) {
                o[d][0] *= c0, o[d][1] *= c1, o[d][2] *= c0, o[d][3] *= c1;
            }
        rest_of_load();
        // P^T as B fragments (k = keys, n = heads): the transposes of the 8×8 matrices
        // (keys 0–7 | 8–15) × heads that S^T's accumulators hold.
        const unsigned b0 = movmatrix_trans(pack_f16x2(p0, p1)), b1 = movmatrix_trans(pack_f16x2(p2, p3));
        // O^T (dims × heads) += V^T · P^T: A = V^T by ldmatrix.trans of the V rows.
        if (F8) {
#pragma unroll
            for (int kk = 0; kk < DT / 2; kk++) {
                unsigned r[4];
                ldsm_x4_at<true>(r[0], r[1], r[2], r[3], vs_at + f8_row + 32 * kk);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    // Bytes (key 2t4: dims 2g, 2g + 1; key 2t4 + 1: the same) to (dim 2g:
                    // both keys | dim 2g + 1: both keys); keys 0–7, then 8–15.
                    const unsigned x = __byte_perm(r[2 * h], 0, 0x3120), y = __byte_perm(r[2 * h + 1], 0, 0x3120);
                    unsigned a[4] = {e4m3x2_to_f16x2(x & 0xffff), e4m3x2_to_f16x2(x >> 16),
                                     e4m3x2_to_f16x2(y & 0xffff), e4m3x2_to_f16x2(y >> 16)};
                    mma_f16_16816(o[2 * kk + h], a, b0, b1);
                }
            }
        } else {
            const unsigned v_row =
                vs_at + ((16 * warp + (lane & 7) + ((lane >> 4) << 3)) * ST + 8 * ((lane >> 3) & 1)) * 2;
#pragma unroll
            for (int d = 0; d < DT; d++) {
                unsigned a[4];
                ldsm_x4_at<true>(a[0], a[1], a[2], a[3], v_row + 32 * d);
                mma_f16_16816(o[d], a, b0, b1);
            }
        }
    }
    KM_STAMP(4);
    // This warp's sums over its keys: add the lanes of each head column.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    if (!bulk) cp_async_wait<0>();
    __syncthreads();  // the stages are done with: the warps' parts go there
    constexpr int RS = HD + 4;
    float* ro = reinterpret_cast<float*>(km_smem);  // [warp][head][RS]
    float* ml = ro + 4 * 8 * RS;                    // [warp][head][2]
    float* mine = ro + warp * 8 * RS;
    // O^T's rows g, g + 8 of chunk d: dims g, g + 8 (FP8: 2g, 2g + 1).
    const int r0 = F8 ? 2 * g : g, r8 = F8 ? 2 * g + 1 : g + 8;
#pragma unroll
    for (int d = 0; d < DT; d++) {
        mine[(2 * t4) * RS + 16 * d + r0] = o[d][0];
        mine[(2 * t4 + 1) * RS + 16 * d + r0] = o[d][1];
        mine[(2 * t4) * RS + 16 * d + r8] = o[d][2];
        mine[(2 * t4 + 1) * RS + 16 * d + r8] = o[d][3];
    }
    if (g == 0) {
        ml[(warp * 8 + 2 * t4) * 2] = m0;
        ml[(warp * 8 + 2 * t4) * 2 + 1] = l0;
        ml[(warp * 8 + 2 * t4 + 1) * 2] = m1;
        ml[(warp * 8 + 2 * t4 + 1) * 2 + 1] = l1;
    }
    __syncthreads();
    // The four warps' parts merged, four columns of one head per thread: to `out`, to the
    // split's partial for attention_merge, or, in a cluster, to this block's shared memory.
    const bool bf16 = (flags & FLASH_OUT_BF16) != 0, cluster = (flags & FLASH_CLUSTER) != 0 && splits > 1;
    float* cpart = ml + 4 * 8 * 2;  // [head][M, L, sums]: the cluster's partials, one per block
    constexpr int C4 = HD / 4;
    for (int i = threadIdx.x; i < grp * C4; i += blockDim.x) {
        const int hh = i / C4, c = (i % C4) * 4;
        const size_t th = (size_t)row0 * n_heads + kvh * grp + hh;  // (token, head)
        float* pp = splits == 1 ? nullptr : cluster ? cpart + hh * (HD + 2) : part + (th * splits + z) * (HD + 2);
        merge_warp_parts<HD, true>(ml, ro, 8, RS, hh, c, out, th * HD + c, pp, bf16);
    }
    KM_STAMP(5);
    if (cluster)
        cluster_merge<HD>(cpart, grp, splits, z, out, ((size_t)row0 * n_heads + kvh * grp) * HD, bf16,
                          (flags & FLASH_MERGE_ILP) != 0 && splits <= 16, (flags & FLASH_RELAXED_EXIT) != 0);
    KM_STAMP(6);
}

// Three stages: two blocks per SM at head_dim 128 (the lab's best at batch 64; two
// stages fit three blocks but were slower, four fit one).
#define KM_STAGES 3
// KT: the cache's element (f16 bits; FP8 bytes).
#define KM_KERNEL(NAME, HD, KT) \
    extern "C" __global__ void __launch_bounds__(128) NAME(FLASH_ARGS_KT(KT), const float* inv_freq, \
                                                           const long long* slots, int interleaved) { \
        flash_decode_km_impl<HD, KM_STAGES>(qkv, cache, half, tiles, tables, n_heads, n_kv, block_size, scale, \
                                            max_ctx, out, part, flags, inv_freq, slots, interleaved); \
    }
KM_KERNEL(flash_decode_km_f16_d64, 64, unsigned short)
KM_KERNEL(flash_decode_km_f16_d128, 128, unsigned short)
KM_KERNEL(flash_decode_km_fp8_d64, 64, unsigned char)
KM_KERNEL(flash_decode_km_fp8_d128, 128, unsigned char)

// ---- Small-batch GEMM (decode): out[m][n] (+)= Σ_k x[m][k] · W[n][k] ----
// W: bf16 [rows][k] row-major (k a multiple of 8), x: f32 [M][k], out: f32 [M][n_out].
// At a few tokens a GEMM is a read of W at memory bandwidth. Each warp takes two rows of
// W; each lane loads 8 weights (16 bytes) per row per step, GEMV_UNROLL steps at a time
// so that enough bytes are in flight, and reads x (f32, L1-resident since every warp of
// the SM reads it) directly: no bf16 copy of the activations is made. U is how many
// 16-byte loads per row a lane has in flight (4 was measured no faster than 2 at four
// blocks per SM; grids of at most two or three blocks per SM take the deep kernels
// below, which keep 4 or 3). Sums are f32, reduced across the warp in a fixed order.
// Two fusions (the decode step's neighbours):
//   NORM: x is the residual stream, normalised by RMSNorm (as rms_norm_rows does): with
//         NORM_BLOCK the block first computes each token's scale and multiplies x by
//         scale · nw[k] as it reads it. With NORM_PART (one token) the kernel that wrote
//         the residual left x · nw and the sums of x² per block's rows (NORM_SPAN
//         elements; EPI_STATS below): x is that product and nw those sums, the loop is
//         the plain one's and each warp scales its two dot products at the end, so no pass over x, no block barrier and
//         no second vector per step (the lab, tools/gpu-lab/normlab.cu: the block's norm
//         made the QKV and gate/up GEMVs 28% and 15% slower than plain ones);
//   SILU: W is [gate; up] (2·n_out rows): a warp takes gate row n and up row n + n_out
//         and writes silu(g) · u (as silu_mul_rows does), so n_out = ff.
#define GEMV_WARPS 8
#define NORM_NONE 0
#define NORM_BLOCK 1
#define NORM_PART 2
// The elements of x whose squares one partial sum of NORM_PART holds: one block's rows.
#define NORM_SPAN (2 * GEMV_WARPS)
// The epilogue: write (or add to) out; RoPE + KV write (EPI_ROPE); or, after adding to the
// residual, also write x · g and the block's sum of x² for the next NORM_PART GEMV (EPI_STATS).
#define EPI_OUT 0
#define EPI_ROPE 1
#define EPI_STATS 2

__device__ __forceinline__ uint4 ld_stream_u4(const unsigned short* p) {
    uint4 v;
#if __CUDA_ARCH__ >= 800
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
    return v;
}

__device__ __forceinline__ float dot8_bf16(uint4 w, const float (&v)[8]) {
    float s = __uint_as_float(w.x << 16) * v[0];
    s = fmaf(__uint_as_float(w.x & 0xffff0000u), v[1], s);
    s = fmaf(__uint_as_float(w.y << 16), v[2], s);
    s = fmaf(__uint_as_float(w.y & 0xffff0000u), v[3], s);
    s = fmaf(__uint_as_float(w.z << 16), v[4], s);
    s = fmaf(__uint_as_float(w.z & 0xffff0000u), v[5], s);
    s = fmaf(__uint_as_float(w.w << 16), v[6], s);
    s = fmaf(__uint_as_float(w.w & 0xffff0000u), v[7], s);
    return s;
}

// x[kk .. kk+8) of one token, times scale · nw with NORM_BLOCK (scale: the token's RMSNorm
// scale).
template <int NORM>
__device__ __forceinline__ void load_x8(const float* __restrict__ xr, const float* __restrict__ nw, float scale, int kk,
                                        float (&v)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(xr + kk);
    const float4 b = *reinterpret_cast<const float4*>(xr + kk + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    if (NORM == NORM_BLOCK) {
        const float4 c = *reinterpret_cast<const float4*>(nw + kk);
        const float4 d = *reinterpret_cast<const float4*>(nw + kk + 4);
        const float g[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = v[i] * scale * g[i];
    }
}

// What the one-token QKV GEMV's RoPE epilogue needs: the token's position, slot and the
// RoPE frequencies (device), the heads, and the layer's f16 cache (keys, then values
// `half` elements further; the layout of rope_write_kv_impl).
struct RopeKv {
    const int* pos;
    const float* inv_freq;
    const long long* slots;
    int n_heads, n_kv, hd, interleaved, block_size;
    unsigned short* cache;
    long long half;
    // 1: let the kernel after (the attention) be scheduled as each block starts; 2: as the
    // first of each block's warps leaves its loop (one thread's trigger counts for its
    // block); 0: not before this kernel ends. The attention is scheduled once every block
    // has triggered, so none of this kernel's blocks waits for room behind it.
    int trigger;
};

// Rotation pair `i` of a token's [q|k|v] row: its two elements (neighbours when
// interleaved, half a head apart otherwise).
__device__ __forceinline__ void rope_pair_rows(const RopeKv& rk, int i, int& r0, int& r1) {
    const int hh = rk.hd / 2, h = i / hh, j = i % hh;
    r0 = h * rk.hd + (rk.interleaved ? 2 * j : j);
    r1 = r0 + (rk.interleaved ? 1 : hh);
}

// What EPI_STATS writes for the next NORM_PART GEMV: xg = x · g (g: that GEMV's norm
// weight) and parts[b] = Σ x² over block b's rows, elements [NORM_SPAN · b, NORM_SPAN · (b + 1)).
struct NormStats {
    const float* g;
    float* xg;
    float* parts;
};

// With EPI_ROPE (one token, rows [q|k|v] of whole heads): a warp takes the two rows of one
// rotation pair instead of two neighbours, rotates q and k as rope_write_kv_groups_impl
// does (the same rope_cs and rope_apply, same bits), writes q|k|v to `out` (`accumulate` ignored) and k, v
// into the cache. EPI_STATS (one token, plain rows, n_out a multiple of NORM_SPAN so every warp
// of a block has rows): out written as usual, then the block's x · g and sum of squares.
template <int M, int NORM, bool SILU, int U, bool PIPE, int EPI = EPI_OUT>
__device__ void gemv_bf16_impl(const unsigned short* __restrict__ w, const float* __restrict__ x,
                               const float* __restrict__ nw, float eps, int n_out, int k, float* __restrict__ out,
                               int accumulate, const RopeKv rk = RopeKv{}, const NormStats ns = NormStats{}) {
    constexpr bool ROPE = EPI == EPI_ROPE;
    static_assert(EPI == EPI_OUT || (M == 1 && !SILU), "RoPE and stats epilogues: one token, plain rows");
    static_assert(NORM != NORM_PART || (M == 1 && PIPE), "the producer's norm: one token, pipelined");
    if (ROPE && rk.trigger == 1) pdl_trigger();
    GEMV_STAMP(EPI, 0);
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    // The two rows of W this warp reads (none past the outputs).
    int r0 = 0, r1 = 0;
    bool active;
    if (SILU) {
        active = warp < n_out;
        if (active) r0 = warp, r1 = warp + n_out;
    } else if (ROPE) {
        active = warp < n_out / 2;
        if (active) rope_pair_rows(rk, warp, r0, r1);
    } else {
        active = 2 * warp < n_out;
        if (active) r0 = 2 * warp, r1 = min(r0 + 1, n_out - 1);
    }
    const unsigned short* w0 = w + (size_t)r0 * k;
    const unsigned short* w1 = w + (size_t)r1 * k;
    const int step = 32 * 8;
    int k0 = lane * 8;
    auto load = [&](uint4 (&a)[U], uint4 (&b)[U], int kk) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            a[u] = ld_stream_u4(w0 + kk + u * step);
            b[u] = ld_stream_u4(w1 + kk + u * step);
        }
    };
    // The pipelined loop's first loads read only W, so they are issued before waiting for
    // the kernel that writes x (programmatic dependent launch; no wait without it).
    const bool whole = PIPE && active && k0 + (U - 1) * step < k;
    uint4 a[U], b[U];
    if (whole) load(a, b, k0);
    pdl_wait();
    __shared__ float scale[M > 0 ? M : 1];
    if (NORM == NORM_BLOCK) {
        __shared__ float part[GEMV_WARPS];
        for (int m = 0; m < M; m++) {
            const float* xr = x + (size_t)m * k;
            float s = 0.f;
            for (int i = threadIdx.x; i < k; i += blockDim.x) s += xr[i] * xr[i];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffff, s, o);
            if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
            __syncthreads();
            if (threadIdx.x == 0) {
                float t = 0.f;
                for (int i = 0; i < GEMV_WARPS; i++) t += part[i];
                scale[m] = rsqrtf(t / k + eps);
            }
            __syncthreads();
        }
    }
    if (!active) return;
    float acc[2][M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[0][m] = acc[1][m] = 0.f;
    auto consume = [&](const uint4 (&a)[U], const uint4 (&b)[U], int kk) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int m = 0; m < M; m++) {
                float v[8];
                load_x8<NORM>(x + (size_t)m * k, nw, NORM == NORM_BLOCK ? scale[m] : 1.f, kk + u * step, v);
                acc[0][m] += dot8_bf16(a[u], v);
                acc[1][m] += dot8_bf16(b[u], v);
            }
    };
    if (PIPE) {
        // Whole groups of U steps, software-pipelined: the next group's loads are issued
        // before this group's are used, so a lane never waits with nothing in flight.
        if (whole) {
            for (;;) {
                const int kn = k0 + U * step;
                const bool more = kn + (U - 1) * step < k;
                uint4 an[U], bn[U];
                if (more) load(an, bn, kn);
                consume(a, b, k0);
                k0 = kn;
                if (!more) break;
#pragma unroll
                for (int u = 0; u < U; u++) a[u] = an[u], b[u] = bn[u];
            }
        }
    } else {
        // Whole groups of U steps: every load is issued before the first use.
        for (; k0 + (U - 1) * step < k; k0 += U * step) {
            uint4 a[U], b[U];
            load(a, b, k0);
            consume(a, b, k0);
        }
    }
    for (; k0 < k; k0 += step) {
        const uint4 a = ld_stream_u4(w0 + k0), b = ld_stream_u4(w1 + k0);
#pragma unroll
        for (int m = 0; m < M; m++) {
            float v[8];
            load_x8<NORM>(x + (size_t)m * k, nw, NORM == NORM_BLOCK ? scale[m] : 1.f, k0, v);
            acc[0][m] += dot8_bf16(a, v);
            acc[1][m] += dot8_bf16(b, v);
        }
    }
    if (ROPE && rk.trigger == 2) pdl_trigger();
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float s = acc[r][m];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            acc[r][m] = s;
        }
    if (NORM == NORM_PART) {
        // The token's sum of squares from the k / NORM_SPAN partial sums, in a fixed order.
        float ss = 0.f;
        for (int i = lane; i < k / NORM_SPAN; i += 32) ss += nw[i];
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
        const float sc = rsqrtf(ss / k + eps);
        acc[0][0] *= sc, acc[1][0] *= sc;
    }
    if constexpr (EPI == EPI_STATS) {
        __shared__ float sq[GEMV_WARPS];
        if (lane == 0) {
            float* o = out + r0;
            const float y0 = accumulate ? o[0] + acc[0][0] : acc[0][0];
            const float y1 = accumulate ? o[1] + acc[1][0] : acc[1][0];
            o[0] = y0, o[1] = y1;
            ns.xg[r0] = y0 * ns.g[r0], ns.xg[r0 + 1] = y1 * ns.g[r0 + 1];
            sq[threadIdx.x >> 5] = y0 * y0 + y1 * y1;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0.f;
            for (int i = 0; i < GEMV_WARPS; i++) t += sq[i];
            ns.parts[blockIdx.x] = t;
        }
        GEMV_STAMP(EPI, 1);
        return;
    }
    if (lane != 0) return;
    if constexpr (ROPE) {
        const int hh = rk.hd / 2, h = warp / hh, j = warp % hh;
        float x0 = acc[0][0], x1 = acc[1][0];
        if (h < rk.n_heads + rk.n_kv) rope_rotate((float)rk.pos[0], rk.inv_freq[j], x0, x1);
        out[r0] = x0;
        out[r1] = x1;
        if (h >= rk.n_heads) {
            const int kh = (h - rk.n_heads) % rk.n_kv;
            const long long slot = rk.slots[0];
            const long long block = slot / rk.block_size, off = slot % rk.block_size;
            const size_t at = (size_t)(((block * rk.n_kv + kh) * rk.block_size + off) * rk.hd) +
                              (h >= rk.n_heads + rk.n_kv ? (size_t)rk.half : 0);
            kv_store(rk.cache, at + (r0 - h * rk.hd), x0);
            kv_store(rk.cache, at + (r1 - h * rk.hd), x1);
        }
        GEMV_STAMP(EPI, 1);
    } else {
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (SILU) {
                const float g = acc[0][m], u = acc[1][m];
                out[(size_t)m * n_out + warp] = silu_gate(g, u);
            } else {
                float* o = out + (size_t)m * n_out + r0;
                o[0] = accumulate ? o[0] + acc[0][m] : acc[0][m];
                if (r0 + 1 < n_out) o[1] = accumulate ? o[1] + acc[1][m] : acc[1][m];
            }
        }
    }
}

#define GEMV_ARGS \
    const unsigned short *w, const float *x, const float *nw, float eps, int n_out, int k, float *out, int accumulate
#define GEMV_KERNELS(M, PIPE, LB, SUFFIX) \
    extern "C" __global__ void __launch_bounds__ LB gemv_bf16_m##M##SUFFIX(GEMV_ARGS) { \
        gemv_bf16_impl<M, NORM_NONE, false, 2, PIPE>(w, x, nw, eps, n_out, k, out, accumulate); \
    } \
    extern "C" __global__ void __launch_bounds__ LB gemv_norm_bf16_m##M##SUFFIX(GEMV_ARGS) { \
        gemv_bf16_impl<M, NORM_BLOCK, false, 2, PIPE>(w, x, nw, eps, n_out, k, out, accumulate); \
    } \
    extern "C" __global__ void __launch_bounds__ LB gemv_norm_silu_bf16_m##M##SUFFIX(GEMV_ARGS) { \
        gemv_bf16_impl<M, NORM_BLOCK, true, 2, PIPE>(w, x, nw, eps, n_out, k, out, accumulate); \
    }
// One token, software-pipelined: 4 blocks per SM fit in 64 registers without spills (74
// unbounded, which leaves 3); without the pipelining (DISAGG_CUDA_GEMV_PIPE=0) as before,
// for A/B runs. 2–8 tokens (only with DISAGG_CUDA_GEMV_MAX_TOKENS > 1) keep the loop
// without pipelining, as measured.
GEMV_KERNELS(1, true, (GEMV_WARPS * 32, 4), )
GEMV_KERNELS(1, false, (GEMV_WARPS * 32), _flat)
// One token: the residual GEMV that leaves the next GEMV's norm inputs (EPI_STATS), and the
// GEMVs that take them (NORM_PART; DISAGG_CUDA_GEMV_PRENORM=0 for the block's norm).
#define GEMV_STATS_KERNEL(NAME, U, PER_SM) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, PER_SM) NAME(GEMV_ARGS, const float* g, float* xg, \
                                                                               float* parts) { \
        gemv_bf16_impl<1, NORM_NONE, false, U, true, EPI_STATS>(w, x, nw, eps, n_out, k, out, accumulate, RopeKv{}, \
                                                                 NormStats{g, xg, parts}); \
    }
GEMV_STATS_KERNEL(gemv_stats_bf16_m1, 2, 4)
// The same with four 16-byte loads per row in flight (U = 4) at two blocks per SM (up to
// 128 registers: no spills), for residual GEMVs whose grid is at most two blocks per SM (o and
// down at 4,096 outputs: 256 blocks), which at U = 2 keep only half the SM's loads in flight.
// Each lane adds its columns in the same order: the same bits.
GEMV_STATS_KERNEL(gemv_stats_u4_bf16_m1, 4, 2)
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) gemv_pnorm_bf16_m1(GEMV_ARGS) {
    gemv_bf16_impl<1, NORM_PART, false, 2, true>(w, x, nw, eps, n_out, k, out, accumulate);
}
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) gemv_pnorm_silu_bf16_m1(GEMV_ARGS) {
    gemv_bf16_impl<1, NORM_PART, true, 2, true>(w, x, nw, eps, n_out, k, out, accumulate);
}
// One token's QKV with RMSNorm, RoPE and the f16 KV write in the epilogue (pipelined, as
// gemv_norm_bf16_m1): the decode step's rope_write_kv launch folded into the GEMV.
#define GEMV_ROPE_KERNEL(NAME, NORM, U, PER_SM) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, PER_SM) NAME( \
        GEMV_ARGS, const int* pos, const float* inv_freq, const long long* slots, int n_heads, int n_kv, int hd, \
        int interleaved, int block_size, unsigned short* cache, long long half, int trigger) { \
        const RopeKv rk{pos, inv_freq, slots, n_heads, n_kv, hd, interleaved, block_size, cache, half, trigger}; \
        gemv_bf16_impl<1, NORM, false, U, true, EPI_ROPE>(w, x, nw, eps, n_out, k, out, accumulate, rk); \
    }
GEMV_ROPE_KERNEL(gemv_norm_rope_bf16_m1, NORM_BLOCK, 2, 4)
GEMV_ROPE_KERNEL(gemv_pnorm_rope_bf16_m1, NORM_PART, 2, 4)
// Three loads per row in flight at three blocks per SM (QKV at 6,144 rows: 384 blocks, under
// three per SM on an H200), the same bits.
GEMV_ROPE_KERNEL(gemv_pnorm_rope_u3_bf16_m1, NORM_PART, 3, 3)
#define GEMV_FLAT_KERNELS(M) GEMV_KERNELS(M, false, (GEMV_WARPS * 32), )
GEMV_FLAT_KERNELS(2)
GEMV_FLAT_KERNELS(3)
GEMV_FLAT_KERNELS(4)
GEMV_FLAT_KERNELS(5)
GEMV_FLAT_KERNELS(6)
GEMV_FLAT_KERNELS(7)
GEMV_FLAT_KERNELS(8)

// The read-bandwidth probe (CudaBackend::read_bandwidth): streams n 16-byte chunks as
// the GEMV reads W; the sink is written only if the xor of everything is a value no
// zero-filled buffer has (per thread), so the loads are not optimised away.
extern "C" __global__ void stream_read(const unsigned short* p, long long n, unsigned* sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = ld_stream_u4(p + 8 * (i + u * stride));
#pragma unroll
        for (int u = 0; u < 4; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = ld_stream_u4(p + 8 * i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// ---- Skinny GEMM: y[m][n] (+)= Σ_k x[m][k] · W[n][k] for a few tokens ----
// Steps of a few tokens read every weight once for little arithmetic; cuBLAS' tiles
// leave SMs idle on the narrow shapes (4,096 outputs in 64-row tiles are 64 blocks). Here a block of SK_WARPS warps takes 32·SK_WARPS rows of W
// (32 per warp: two m16 tiles) over one of S splits of K. Slab by slab (64 columns), all
// its threads copy the rows' 128-byte spans and the tokens' bf16 activations into a ring
// of SK_STAGES stages with cp.async (whole lines per warp instruction; tokens past M read
// as zeros; 16-byte chunk c of row r stored at c ^ (r & 7), so ldmatrix reads are
// conflict-free), and each warp runs mma.sync m16n8k16 over its rows and all NT n8 token
// tiles, A and B fragments by ldmatrix. Splits of one row block form a thread-block
// cluster (sm_90): each block leaves its f32 partial sums in its shared memory and, after
// a cluster barrier, block c adds the S partials of its 1/S of the rows in rank order
// (a fixed order: results do not depend on scheduling) from distributed shared memory
// and writes them; S = 1 writes its own. `accumulate` adds y's old value (the residual).
// Measured against cuBLAS in tools/gpu-lab/skinnylab.cu and in the engine (docs/PERF.md).
#define SK_SLAB 64
#define SK_STAGES 4
// Shared memory of a block of WARPS warps (32·WARPS rows) for NT token tiles: the
// staging ring, reused for the partial sums ([token][row], rows padded by 4 floats).
#define SK_SMEM_BYTES(NT, WARPS) \
    ((SK_STAGES * (32 * (WARPS) + (NT) * 8) * SK_SLAB * 2) > ((NT) * 8 * (32 * (WARPS) + 4) * 4) \
         ? (SK_STAGES * (32 * (WARPS) + (NT) * 8) * SK_SLAB * 2) : ((NT) * 8 * (32 * (WARPS) + 4) * 4))

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Slab j (of the ns this block's key split covers, from slab s0) into ring stage
// j % STAGES at shared address `base`, asynchronously: W's ROWS rows from row0 (rows
// past n repeat the last), then the XROWS token rows (tokens past m_tokens read as
// zeros); each row's 64 columns are 128 bytes, its 16-byte chunk c stored at c ^ (row & 7)
// (ldmatrix conflict-free, and the 128-byte swizzle wgmma reads). Commits a group even
// past the last slab, so the waits count alike.
template <int ROWS, int XROWS, int THREADS, int STAGES>
__device__ __forceinline__ void skinny_stage(unsigned base, int j, int ns, int s0, const unsigned short* __restrict__ w,
                                             const unsigned short* __restrict__ x, int row0, int n, int k,
                                             int m_tokens) {
    if (j < ns) {
        const unsigned st = base + (j % STAGES) * (ROWS + XROWS) * 128;
        const size_t kc = (size_t)(s0 + j) * SK_SLAB;
#pragma unroll
        for (int p = 0; p < ROWS * 8 / THREADS; p++) {
            const int piece = threadIdx.x + THREADS * p, r = piece >> 3, c = piece & 7;
            const unsigned short* src = w + (size_t)min(row0 + r, n - 1) * k + kc + 8 * c;
            cp_async16_at<true>(st + r * 128 + ((c ^ (r & 7)) << 4), src, 16);
        }
        for (int i = threadIdx.x; i < XROWS * 8; i += THREADS) {
            const int r = i >> 3, c = i & 7;
            const bool in = r < m_tokens;
            const unsigned short* src = x + (size_t)(in ? r : 0) * k + kc + 8 * c;
            cp_async16_at(st + (ROWS + r) * 128 + ((c ^ (r & 7)) << 4), src, in ? 16 : 0);
        }
    }
    cp_async_commit();
}

// The end of a skinny GEMM block: its partial sums red[token][row] (rows padded by 4
// floats) are in its shared memory, and after a cluster barrier (S > 1) block `split`
// adds the S partials of its 1/S of the rows, 4 at a time, in rank order (a fixed order:
// results do not depend on scheduling) from distributed shared memory and writes them
// (adding y's old value with `accumulate`); S = 1 writes its own.
template <int S, int ROWS, int THREADS>
__device__ __forceinline__ void skinny_reduce(const float* red, int ntok, int split, int row0, int m_tokens, int n,
                                              float* __restrict__ y, int accumulate) {
    constexpr int RSTRIDE = ROWS + 4;
    constexpr int SLICE = ROWS / S;
    const unsigned red_a = smem_u32(red);
    for (int i = threadIdx.x; i < ntok * SLICE / 4; i += THREADS) {
        const int tok = i / (SLICE / 4), r = split * SLICE + 4 * (i % (SLICE / 4));
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        const unsigned off = (unsigned)(tok * RSTRIDE + r) * 4;
        if (S > 1) {
#pragma unroll
            for (int c = 0; c < S; c++) {
                const float4 p = ld_dsmem_f4(red_a + off, c);
                v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
            }
        } else {
            v = *reinterpret_cast<const float4*>(red + tok * RSTRIDE + r);
        }
        const int row = row0 + r;
        if (tok < m_tokens && row < n) {
            float* o = y + (size_t)tok * n + row;
            if (row + 3 < n && (n & 3) == 0) {
                float4* o4 = reinterpret_cast<float4*>(o);
                if (accumulate) {
                    const float4 old = *o4;
                    v.x += old.x, v.y += old.y, v.z += old.z, v.w += old.w;
                }
                *o4 = v;
            } else {
                const float vv[4] = {v.x, v.y, v.z, v.w};
                for (int e = 0; e < 4 && row + e < n; e++) o[e] = accumulate ? o[e] + vv[e] : vv[e];
            }
        }
    }
}

template <int NT, int S, int WARPS>
__device__ void skinny_impl(const unsigned short* __restrict__ w, const unsigned short* __restrict__ x, int m_tokens,
                            int n, int k, float* __restrict__ y, int accumulate) {
    extern __shared__ __align__(128) unsigned char sk_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int SK_ROWS = 32 * WARPS, SK_RSTRIDE = SK_ROWS + 4, THREADS = 32 * WARPS;
    const int row0 = blockIdx.x * SK_ROWS;
    const int split = blockIdx.y;
    const int slabs = k / SK_SLAB;
    const int per = (slabs + S - 1) / S;
    const int s0 = min(split * per, slabs), s1 = min(s0 + per, slabs);
    const int ns = s1 - s0;
    // A stage (skinny_stage): W's SK_ROWS rows × 64 columns, then the tokens' NT·8 rows.
    constexpr int STAGE = (SK_ROWS + NT * 8) * SK_SLAB * 2;
    const unsigned base = smem_u32(sk_smem);
    auto stage = [&](int j) { skinny_stage<SK_ROWS, NT * 8, THREADS, SK_STAGES>(base, j, ns, s0, w, x, row0, n, k, m_tokens); };
#pragma unroll
    for (int j = 0; j < SK_STAGES - 1; j++) stage(j);
    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.f;
    // ldmatrix rows: A (W) rows warp·32 + mt·16 + (lane & 15), chunk 2s + (lane >> 4);
    // B (tokens) rows nt·8 + (lane & 7), chunk 2·(s pair) + (lane >> 3).
    const int ar = warp * 32 + (lane & 15), ac = lane >> 4;
    const int br = lane & 7, bc = lane >> 3;
    for (int j = 0; j < ns; j++) {
        cp_async_wait<SK_STAGES - 2>();
        __syncthreads();  // slab j staged by all; slab j - 1's stage free
        stage(j + SK_STAGES - 1);
        const unsigned st = base + (j % SK_STAGES) * STAGE;
#pragma unroll
        for (int sp = 0; sp < 2; sp++) {  // pairs of k16 steps
            unsigned b[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int r = SK_ROWS + nt * 8 + br, c = 4 * sp + bc;
                ldsm_x4_at<false>(b[nt][0], b[nt][1], b[nt][2], b[nt][3], st + r * 128 + ((c ^ (r & 7)) << 4));
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int s = 2 * sp + h;
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    unsigned a[4];
                    const int r = ar + mt * 16, c = 2 * s + ac;
                    ldsm_x4_at<false>(a[0], a[1], a[2], a[3], st + r * 128 + ((c ^ (r & 7)) << 4));
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
                        mma_bf16_16816(acc[mt][nt], a[0], a[1], a[2], a[3], b[nt][2 * h], b[nt][2 * h + 1]);
                }
            }
        }
    }
    // Partial sums to shared memory as [token][row] (the staging ring is done with).
    cp_async_wait<0>();
    __syncthreads();
    float* red = reinterpret_cast<float*>(sk_smem);
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int r = warp * 32 + mt * 16 + g, tok = nt * 8 + 2 * t;
            red[tok * SK_RSTRIDE + r] = acc[mt][nt][0];
            red[(tok + 1) * SK_RSTRIDE + r] = acc[mt][nt][1];
            red[tok * SK_RSTRIDE + r + 8] = acc[mt][nt][2];
            red[(tok + 1) * SK_RSTRIDE + r + 8] = acc[mt][nt][3];
        }
    if (S > 1) cluster_sync_all();
    else __syncthreads();
    skinny_reduce<S, SK_ROWS, THREADS>(red, NT * 8, split, row0, m_tokens, n, y, accumulate);
    if (S > 1) cluster_sync_all();  // no block leaves while another reads its partials
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SK_CLUSTER(S)
#else
#define SK_CLUSTER(S) __cluster_dims__(1, S, 1)
#endif
#define SK_ARGS const unsigned short *w, const unsigned short *x, int m_tokens, int n, int k, float *y, int accumulate
#define SK_WARPS 4
#define SK_KERNEL(NT, S, CL) \
    extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) CL skinny_bf16_t##NT##_s##S(SK_ARGS) { \
        pdl_wait(); \
        skinny_impl<NT, S, SK_WARPS>(w, x, m_tokens, n, k, y, accumulate); \
    }
#define SK_KERNELS(NT) \
    SK_KERNEL(NT, 1, ) \
    SK_KERNEL(NT, 2, SK_CLUSTER(2)) \
    SK_KERNEL(NT, 4, SK_CLUSTER(4)) \
    SK_KERNEL(NT, 8, SK_CLUSTER(8))
// The engine takes 2–8 tokens (one n8 tile); tools/gpu-lab/skinnylab.cu instantiates
// 2, 4 and 8 tiles as well, which lost to cuBLAS there or in the engine.
SK_KERNELS(1)

// ---- Sampling where the logits are (engine/src/sampling.rs defines the semantics) ----
// One block of SAMPLE_THREADS per logits row. Per row: the raw logits' log-sum-exp and
// its best `n_logprobs` raw logits (unsorted; the host sorts them); then the row's logit
// edits in place (bias, min_tokens masks, penalties: l ← rep(l + add) − sub, the
// original kept in edit_orig); then
//   greedy (temperature 0): the first index of the largest edited logit;
//   top-k / top-p: the best min(finite, SAMPLE_CANDIDATES, top_k) tokens by scaled
//     logit xs = l / T, for the host to finish with the CPU's code (out_n: how many, and
//     how many are finite; out_z: Σ exp(xs − max xs) over all finite; out_f[2]: max xs);
//   otherwise (temperature, min-p): the draw itself, over the kept tokens in id order:
//     the first whose running sum of exp(xs − max) exceeds u · total.
// Every reduction has a fixed shape, so results do not depend on scheduling. Needs
// __match_any_sync (sm_70+); the backend does not launch it on older GPUs.
#define SAMPLE_THREADS 1024
#define SAMPLE_CANDIDATES 1024
#define SAMPLE_MAX_LOGPROBS 20

// Larger key = earlier in the order: value descending, then id ascending.
__device__ __forceinline__ unsigned long long order_key(float v, int id) {
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - (unsigned)id);
}

// Block-wide reduction (blockDim.x == SAMPLE_THREADS, 32 warps); every thread gets the
// result. Butterfly shuffles give every lane the same value.
template <typename T, typename Op>
__device__ T block_all_reduce(T v, T* sh, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[threadIdx.x & 31];
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
struct OpMax {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct OpAdd {
    template <typename T>
    __device__ T operator()(T a, T b) const { return a + b; }
};
// Exclusive prefix sum over the threads in order; *total gets the sum of all.
__device__ double block_excl_scan_d(double v, double* sh, double* total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    double x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffff, x, o);
        if (lane >= o) x += y;
    }
    double ex = __shfl_up_sync(0xffffffff, x, 1);
    if (lane == 0) ex = 0.0;
    __syncthreads();
    if (lane == 31) sh[w] = x;
    __syncthreads();
    if (w == 0) {
        double s = sh[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const double y = __shfl_up_sync(0xffffffff, s, o);
            if (lane >= o) s += y;
        }
        sh[lane] = s;
    }
    __syncthreads();
    *total = sh[31];
    return (w > 0 ? sh[w - 1] : 0.0) + ex;
}

#if __CUDA_ARCH__ >= 700
// The key of the m-th largest (1-based; m ≤ how many keys are set) of the keys that
// keyf(i, key) sets: radix select over 8 digits of 8 bits, with per-warp aggregated
// histogram counts.
template <typename KeyF>
__device__ unsigned long long block_select(int dim, int m, KeyF keyf, unsigned* hist, unsigned long long* sh_key,
                                           int* sh_rem) {
    unsigned long long prefix = 0;
    int rem = m;
    const int lane = threadIdx.x & 31;
    for (int pass = 0; pass < 8; pass++) {
        const int shift = 56 - 8 * pass;
        const unsigned long long hi = pass == 0 ? 0ull : (~0ull << (shift + 8));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < dim; base += blockDim.x) {
            const int i = base + threadIdx.x;
            int digit = -1;
            unsigned long long key = 0;
            if (i < dim && keyf(i, key) && (key & hi) == prefix) digit = (int)((key >> shift) & 255);
            const unsigned grp = __match_any_sync(0xffffffff, digit);
            if (digit >= 0 && lane == __ffs(grp) - 1) atomicAdd(&hist[digit], (unsigned)__popc(grp));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned cum = 0;
            int d = 255;
            for (; d > 0; d--) {
                if (cum + hist[d] >= (unsigned)rem) break;
                cum += hist[d];
            }
            *sh_rem = rem - (int)cum;
            *sh_key = prefix | ((unsigned long long)d << shift);
        }
        __syncthreads();
        prefix = *sh_key;
        rem = *sh_rem;
    }
    return prefix;
}

// The m best of the keys keyf sets (block_select), their (id, logit l[id]) written to
// ids / vals in any order; returns how many (m, at most cap).
template <typename KeyF>
__device__ int block_select_gather(const float* l, int dim, int m, KeyF keyf, int cap, unsigned* ids, float* vals,
                                   unsigned* hist, unsigned long long* sh_key, int* sh_rem, int* sh_n) {
    const unsigned long long t = block_select(dim, m, keyf, hist, sh_key, sh_rem);
    if (threadIdx.x == 0) *sh_n = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        unsigned long long k;
        if (keyf(i, k) && k >= t) {
            const int p = atomicAdd(sh_n, 1);
            if (p < cap) {
                ids[p] = i;
                vals[p] = l[i];
            }
        }
    }
    __syncthreads();
    return min(*sh_n, cap);
}
#endif

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(float* logits, int dim, const float* pf, const int* pi, const double* pu, const int* edit_ids,
                const float* edit_vals, float* edit_orig, unsigned* out_tok, float* out_f, double* out_z, int* out_n,
                unsigned* cand_ids, float* cand_vals, unsigned* top_ids, float* top_vals) {
#if __CUDA_ARCH__ >= 700
    __shared__ unsigned hist[256];
    __shared__ float shf[32];
    __shared__ double shd[32];
    __shared__ int shi[32];
    __shared__ unsigned long long sh_key;
    __shared__ int sh_rem, sh_n;
    __shared__ unsigned sh_tok;
    const int r = blockIdx.x, tid = threadIdx.x;
    float* l = logits + (size_t)r * dim;
    const float temperature = pf[4 * r], top_p = pf[4 * r + 1], min_p = pf[4 * r + 2];
    const int top_k = pi[4 * r], e_off = pi[4 * r + 1], n_e = pi[4 * r + 2], n_lp = pi[4 * r + 3];
    float* of = out_f + 4 * (size_t)r;

    // 1. Logprobs from the raw logits (n_lp < 0: none asked).
    if (n_lp >= 0) {
        float mx = NEG_INF;
        for (int i = tid; i < dim; i += blockDim.x) mx = fmaxf(mx, l[i]);
        mx = block_all_reduce(mx, shf, OpMax());
        double s = 0.0;
        if (mx != NEG_INF)
            for (int i = tid; i < dim; i += blockDim.x) s += exp((double)(l[i] - mx));
        s = block_all_reduce(s, shd, OpAdd());
        if (tid == 0) of[1] = mx == NEG_INF ? NEG_INF : mx + (float)log(s);
        const int n = min(n_lp, min(dim, SAMPLE_MAX_LOGPROBS));
        if (n > 0) {
            auto raw_key = [&](int i, unsigned long long& k) {
                const float v = l[i];
                if (v != v) return false;
                k = order_key(v, i);
                return true;
            };
            block_select_gather(l, dim, n, raw_key, SAMPLE_MAX_LOGPROBS, top_ids + (size_t)r * SAMPLE_MAX_LOGPROBS,
                                top_vals + (size_t)r * SAMPLE_MAX_LOGPROBS, hist, &sh_key, &sh_rem, &sh_n);
        }
    }
    __syncthreads();

    // 2. The edits, in place.
    for (int e = tid; e < n_e; e += blockDim.x) {
        const int id = edit_ids[e_off + e];
        const float* ev = edit_vals + 3 * (size_t)(e_off + e);
        float v = l[id];
        edit_orig[e_off + e] = v;
        // Rounded op by op, as the host's LogitEdit::apply (no FMA contraction).
        v = __fadd_rn(v, ev[0]);
        if (ev[1] != 1.f) v = v > 0.f ? __fdiv_rn(v, ev[1]) : __fmul_rn(v, ev[1]);
        l[id] = __fsub_rn(v, ev[2]);
    }
    if (tid == 0) sh_tok = 0xffffffffu;
    __syncthreads();

    // 3. The token (or the candidates).
    const float inv_t = temperature > 0.f ? 1.f / temperature : 0.f;
    bool greedy = !(temperature > 0.f);
    float mx = NEG_INF;
    if (!greedy) {
        int cnt = 0;
        for (int i = tid; i < dim; i += blockDim.x) {
            const float v = l[i];
            if (v > NEG_INF) {
                mx = fmaxf(mx, __fmul_rn(v, inv_t));
                cnt++;
            }
        }
        mx = block_all_reduce(mx, shf, OpMax());
        cnt = block_all_reduce(cnt, shi, OpAdd());
        greedy = cnt == 0;  // nothing finite: the argmax, as the CPU does
        if (!greedy && ((top_k > 0 && top_k < cnt) || top_p < 1.f)) {
            double z = 0.0;
            for (int i = tid; i < dim; i += blockDim.x) {
                const float v = l[i];
                if (v > NEG_INF) z += (double)expf(__fsub_rn(__fmul_rn(v, inv_t), mx));
            }
            z = block_all_reduce(z, shd, OpAdd());
            int m = min(cnt, SAMPLE_CANDIDATES);
            if (top_k > 0) m = min(m, top_k);
            auto key = [&](int i, unsigned long long& k) {
                const float v = l[i];
                if (!(v > NEG_INF)) return false;
                k = order_key(__fmul_rn(v, inv_t), i);
                return true;
            };
            const int got = block_select_gather(l, dim, m, key, SAMPLE_CANDIDATES, cand_ids + (size_t)r * SAMPLE_CANDIDATES,
                                                cand_vals + (size_t)r * SAMPLE_CANDIDATES, hist, &sh_key, &sh_rem, &sh_n);
            if (tid == 0) {
                out_tok[r] = 0xffffffffu;
                out_n[2 * r] = got;
                out_n[2 * r + 1] = cnt;
                out_z[r] = z;
                of[2] = mx;
            }
            return;
        }
    }
    if (greedy) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = tid; i < dim; i += blockDim.x) {
            const float v = l[i];
            if (v > bv) {
                bv = v;
                bi = i;
            }
        }
        warp_argmax(bv, bi);
        __syncthreads();
        if ((tid & 31) == 0) {
            shf[tid >> 5] = bv;
            shi[tid >> 5] = bi;
        }
        __syncthreads();
        if (tid < 32) {
            bv = shf[tid];
            bi = shi[tid];
            warp_argmax(bv, bi);
            if (tid == 0) sh_tok = bi == 0x7fffffff ? 0u : (unsigned)bi;
        }
    } else {
        // The draw: kept tokens in id order, each thread a contiguous range of ids.
        // weight(i): exp(xs − max) of a kept token (possibly 0), −1 for the others.
        auto weight = [&](int i) {
            const float v = l[i];
            if (!(v > NEG_INF)) return -1.f;
            const float e = expf(__fsub_rn(__fmul_rn(v, inv_t), mx));
            return min_p > 0.f && !(e >= min_p) ? -1.f : e;
        };
        const int chunk = (dim + blockDim.x - 1) / blockDim.x;
        const int lo = min(tid * chunk, dim), hi = min(lo + chunk, dim);
        double local = 0.0;
        int last = -1;
        for (int i = lo; i < hi; i++) {
            const float e = weight(i);
            if (e < 0.f) continue;
            local += (double)e;
            last = i;
        }
        double total;
        const double excl = block_excl_scan_d(local, shd, &total);
        // The threads' ranges [excl, next thread's excl) partition [0, total) exactly.
        __shared__ double sh_ex[SAMPLE_THREADS];
        sh_ex[tid] = excl;
        __syncthreads();
        const double upto = tid + 1 < (int)blockDim.x ? sh_ex[tid + 1] : total;
        const double target = pu[r] * total;
        if (last >= 0 && target >= excl && target < upto) {
            double acc = excl;
            int pick = last;  // the walk's own rounding may end short of the target
            for (int i = lo; i < hi; i++) {
                const float e = weight(i);
                if (e < 0.f) continue;
                acc += (double)e;
                if (target < acc) {
                    pick = i;
                    break;
                }
            }
            atomicMin(&sh_tok, (unsigned)pick);
        }
        // The target at or past the total (u · total rounded up): the last kept token.
        int lastmax = last;
        for (int o = 16; o > 0; o >>= 1) lastmax = max(lastmax, __shfl_xor_sync(0xffffffff, lastmax, o));
        __syncthreads();
        if ((tid & 31) == 0) shi[tid >> 5] = lastmax;
        __syncthreads();
        if (tid == 0 && sh_tok == 0xffffffffu) {
            int m = -1;
            for (int w = 0; w < 32; w++) m = max(m, shi[w]);
            sh_tok = m < 0 ? 0u : (unsigned)m;
        }
    }
    __syncthreads();
    const unsigned tok = sh_tok;
    if (tid == 0) {
        out_tok[r] = tok;
        out_n[2 * r] = 0;
        of[0] = l[tok];
        of[3] = l[tok];
    }
    __syncthreads();
    // The raw logit of the token: its value before an edit.
    for (int e = tid; e < n_e; e += blockDim.x)
        if (edit_ids[e_off + e] == (int)tok) of[3] = edit_orig[e_off + e];
#endif
}
