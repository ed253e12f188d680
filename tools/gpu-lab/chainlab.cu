// Chain lab (issue 5, batch 1): what a kernel boundary costs the one-token GEMVs, and ways
// around it. The 32 layers' GEMVs (QKV, o, gate/up with SiLU·gate, down; the bare per-warp
// loop of normlab.cu, 13.96 GB of bf16, L2 cold) replayed from one CUDA graph:
//   1. the 128 launches several ways: plain, programmatic (first loads before
//      griddepcontrol.wait), with griddepcontrol.launch_dependents at a block's start, last
//      pair or end, and persistent grids of 1–4 blocks per SM taking row pairs in a stride;
//   2. each shape alone (32 in a row);
//   3. fused_chain: o → gate/up → down → next QKV as phases of one persistent kernel per
//      layer, a warp of a phase waiting (acquire) for the 512-output chunks of the phase
//      before it counts complete (release), against the same four launches; its results
//      are compared bit for bit; the blocks take units in a stride or by tickets, and
//      mode 2 drops the waits (wrong results: the form's bound);
//   4. gate/up with the engine's [gate; up] rows, interleaved rows, and plain pairs;
//   5. the floor: one GEMV over all 13.96 GB in one launch, and stream_read of them;
//   6. (./chainlab stream [stages]: this part only) stream_chain: a block per SM, one
//      producer warp streaming each phase's weights through a ring of shared-memory stages
//      by bulk copies, never waiting for activations, and 8 consumer warps waiting per
//      input chunk as in 3 — fused per layer, one launch per phase, and one launch per
//      phase that lets the next launch at once (griddepcontrol.launch_dependents), against
//      the four launches, and its bits against theirs (first run: twenty-seventh session);
//   7. (./chainlab staged: this part only) staged_gemv: persistent launches (2 blocks per
//      SM) that let the next launch in at entry, half-way, three quarters of the way or at
//      their last pair, and stage the first columns of their warps' first row pairs in
//      shared memory by bulk copies before griddepcontrol.wait; against the programmatic
//      launches and the one-launch floor, bits compared (forty-ninth session);
//   8. (./chainlab tiles: this part and 9) stream_tiles: part 6 with every shared-memory
//      stage shared by all consumer warps (a group of row pairs × C columns; bulk copies per
//      row, by lane 0 or by the lanes, cp.async, or 2-D tensor maps), all 32 layers in one
//      launch or a launch per layer, against the 128 programmatic launches (fiftieth session);
//   9. (./chainlab tiles, after part 8; ./chainlab tiles ldg times it without part 8's
//      forms) ldg_chain: all 128 phases in one persistent launch of register-streaming
//      warps (part 3's loop), the phases dealt out round-robin, bits compared;
//      ldg_chain_bound, the same with chain_gemv's loop and no waits (the spill-free
//      bound); ldg_chain_sync, that loop with a barrier per phase (counts adjacent or a
//      line apart, sleeps between polls, every warp or one per block polling, fences at
//      gpu or block scope before the block's count).
// Results and what they mean: docs/PERF.md (twenty-sixth, twenty-seventh, forty-ninth and
// fiftieth sessions).
// Not part of the build;
// on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/chainlab.cu -lcuda -o chainlab && ./chainlab
//   (./chainlab fused: parts 3–5 only)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#include "graph_time.h"
#include "../../kernels/src/cuda/ops.cu"

// Lets the kernel after this one be scheduled once every block has called it or exited
// (ops.cu's kernels never call it: PERF.md, twentieth session).
__device__ __forceinline__ void pdl_trigger() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Eight f32 inputs by two plain float4 loads (not ops.cu's load_x8: its __restrict__ input
// may be read through the non-coherent cache, and the fused kernels read inputs that other
// blocks of the same launch write).
__device__ __forceinline__ void x8(const float* p, float (&v)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// A warp's two dot products (rows w0, w1) from column k0 (the lane's offset included) to k,
// a[] and b[] already holding the first U loads: each 16-byte load U groups ahead.
template <int U>
__device__ __forceinline__ void pair_stream(const unsigned short* w0, const unsigned short* w1, const float* in, int k0, int k,
                                            uint4 (&a)[U], uint4 (&b)[U], float& s0, float& s1) {
    const int step = 256;
    for (;; k0 += U * step) {
        const bool more = k0 + U * step < k;
        uint4 an[U], bn[U];
        if (more) {
#pragma unroll
            for (int u = 0; u < U; u++) an[u] = ld_stream_u4(w0 + k0 + U * step + u * step), bn[u] = ld_stream_u4(w1 + k0 + U * step + u * step);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float v[8];
            x8(in + k0 + step * u, v);
            s0 += dot8_bf16(a[u], v);
            s1 += dot8_bf16(b[u], v);
        }
        if (!more) break;
#pragma unroll
        for (int u = 0; u < U; u++) a[u] = an[u], b[u] = bn[u];
    }
}
// The warp's two sums reduced and written: kind 0 two outputs, 1 added to two outputs, 2 and
// 3 SiLU·gate of the pair into one.
__device__ __forceinline__ void pair_store(float* out, int p, int kind, float s0, float s1) {
    for (int o = 16; o > 0; o >>= 1) s0 += __shfl_xor_sync(0xffffffffu, s0, o), s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    if ((threadIdx.x & 31) == 0) {
        if (kind >= 2) out[p] = silu_gate(s0, s1);
        else if (kind == 1) out[2 * p] += s0, out[2 * p + 1] += s1;
        else out[2 * p] = s0, out[2 * p + 1] = s1;
    }
}

// trig: 0 none, 1 at start, 2 when the warp starts its last pair, 3 after the warp's loop.
template <int U>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) chain_gemv(const unsigned short* w, const float* in, float* out, int pairs, int k, int kind, int trig) {
    const int lane = threadIdx.x & 31;
    const int stride = gridDim.x * GEMV_WARPS;
    int p = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (trig == 1) pdl_trigger();
    bool first = true;
    if (p >= pairs) { pdl_wait(); if (trig >= 2) pdl_trigger(); return; }
    for (; p < pairs; p += stride) {
        if (trig == 2 && p + stride >= pairs) pdl_trigger();
        const unsigned short* w0 = w + (size_t)(kind == 2 ? p : 2 * p) * k;  // kind 3: 2p, 2p + 1
        const unsigned short* w1 = w + (size_t)(kind == 2 ? p + pairs : 2 * p + 1) * k;
        const int step = 256;
        uint4 a[U], b[U];
        int k0 = lane * 8;
#pragma unroll
        for (int u = 0; u < U; u++) a[u] = ld_stream_u4(w0 + k0 + u * step), b[u] = ld_stream_u4(w1 + k0 + u * step);
        if (first) { pdl_wait(); first = false; }
        float s0 = 0.f, s1 = 0.f;
        pair_stream<U>(w0, w1, in, k0, k, a, b, s0, s1);
        pair_store(out, p, kind, s0, s1);
    }
    if (trig == 3) pdl_trigger();
}


// The fused chain: one persistent kernel runs several dependent GEMVs (phases) in order;
// each warp, after writing its outputs, counts them into its phase's 512-output chunk
// (release); a warp of the next phase, before consuming a 512-wide group of its input,
// waits (acquire) until that chunk is complete. Its weight loads never wait, so they
// overlap the previous phase's tail. Every block must be resident (grid <= capacity).
struct Phase { const unsigned short* w; const float* in; float* out; int pairs, k, kind; };
// mode: 0 spin, 1 spin with sleeps, 2 no waits (wrong results: the bound). cnt: [4][64]
// chunk counts (index 63: the phase's total), [256] blocks done, [600] the next ticket.
// trig (stream_chain only): every thread calls griddepcontrol.launch_dependents first, so the
// next launch's blocks, where they fit beside this one's, start streaming their weights early.
struct Chain { Phase ph[4]; int nph, tickets, mode; unsigned* cnt; int trig; };
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int chunk_expect(const Phase& P, int c) {
    const int n_out = P.kind == 2 ? P.pairs : 2 * P.pairs;
    const int n = min(512, n_out - 512 * c);
    return P.kind == 2 ? n : n / 2;
}
// Waits (lane 0 polls, then the warp) until the outputs [col, col + n) of phase ph − 1 (its
// 512-output chunks) are complete; returns how many input columns are now known complete:
// all k once that whole phase is (one check of its total first).
__device__ __forceinline__ int wait_cols(const Phase& Q, const unsigned* cb, int col, int n, int k, bool sleep);
__device__ __forceinline__ int wait_inputs(const Chain& c, int ph, int col, int n, int k, bool sleep) {
    return wait_cols(c.ph[ph - 1], c.cnt + (ph - 1) * 64, col, n, k, sleep);
}
// The same for phase Q, its chunk counts at cb.
__device__ __forceinline__ int wait_cols(const Phase& Q, const unsigned* cb, int col, int n, int k, bool sleep) {
    const int n_prev = Q.kind == 2 ? Q.pairs : 2 * Q.pairs;
    int r = 0;
    if ((threadIdx.x & 31) == 0) {
        if (ld_acquire(cb + 63) >= (unsigned)Q.pairs) r = k;
        else {
            for (int q = col / 512; q < (col + n) / 512 && q * 512 < n_prev; q++) {
                const unsigned want = chunk_expect(Q, q);
                while (ld_acquire(cb + q) < want)
                    if (sleep) __nanosleep(128);
            }
            r = col + n;
        }
    }
    r = __shfl_sync(0xffffffffu, r, 0);
    __syncwarp();
    return r;
}
// The warp's two dot products reduced, written as phase ph's kind says (P: that phase), and
// counted into the phase's chunk and total (release).
__device__ __forceinline__ void store_pair(const Phase& P, unsigned* cnt, int ph, int p, float s0, float s1) {
    for (int o = 16; o > 0; o >>= 1) s0 += __shfl_xor_sync(0xffffffffu, s0, o), s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    if ((threadIdx.x & 31) != 0) return;
    int oi;
    if (P.kind == 2) P.out[p] = silu_gate(s0, s1), oi = p;
    else if (P.kind == 1) P.out[2 * p] = __ldcg(P.out + 2 * p) + s0, P.out[2 * p + 1] = __ldcg(P.out + 2 * p + 1) + s1, oi = 2 * p;
    else P.out[2 * p] = s0, P.out[2 * p + 1] = s1, oi = 2 * p;
    red_release(cnt + ph * 64 + (oi >> 9), 1u);
    red_release(cnt + ph * 64 + 63, 1u);
}
// The block's end: the last block to finish zeroes the first n counts for the next launch.
__device__ __forceinline__ void finish_launch(unsigned* cnt, int n) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(cnt + 256, 1u) == gridDim.x - 1) {
            __threadfence();
            for (int i = 0; i < n; i++) cnt[i] = 0;
            __threadfence();
        }
    }
}
// A warp's row pair p of phase P (the phase before it Q, its chunk counts at cb), waiting
// per 512-column group of its input unless `ready` (the input columns known complete)
// covers it; mode as Chain's. Its result is stored and counted (store_pair); returns the
// columns known complete after it. WAIT false: the caller knows them all complete (or
// waits for none), so the loop carries no wait.
template <bool WAIT>
__device__ __forceinline__ int waited_pair(const Phase& P, const Phase* Q, const unsigned* cb, unsigned* cnt, int ph, int p, int ready, int mode) {
    const int lane = threadIdx.x & 31, k = P.k;
    const unsigned short* w0 = P.w + (size_t)(P.kind == 2 ? p : 2 * p) * k;
    const unsigned short* w1 = P.w + (size_t)(P.kind == 2 ? p + P.pairs : 2 * p + 1) * k;
    uint4 a[2], b[2];
    int k0 = lane * 8;
    a[0] = ld_stream_u4(w0 + k0), b[0] = ld_stream_u4(w1 + k0);
    a[1] = ld_stream_u4(w0 + k0 + 256), b[1] = ld_stream_u4(w1 + k0 + 256);
    float s0 = 0.f, s1 = 0.f;
    for (int g = 0;; g += 512) {
        const bool more = g + 512 < k;
        uint4 an[2], bn[2];
        if (more) {
            an[0] = ld_stream_u4(w0 + k0 + 512), bn[0] = ld_stream_u4(w1 + k0 + 512);
            an[1] = ld_stream_u4(w0 + k0 + 768), bn[1] = ld_stream_u4(w1 + k0 + 768);
        }
        if (WAIT && g >= ready && mode < 2) ready = wait_cols(*Q, cb, g, 512, k, mode == 1);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float v[8];
            x8(P.in + k0 + 256 * u, v);
            s0 += dot8_bf16(a[u], v);
            s1 += dot8_bf16(b[u], v);
        }
        if (!more) break;
        k0 += 512;
        a[0] = an[0], a[1] = an[1], b[0] = bn[0], b[1] = bn[1];
    }
    store_pair(P, cnt, ph, p, s0, s1);
    return ready;
}
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) fused_chain(const Chain c) {
    const int wib = threadIdx.x >> 5;
    pdl_wait();
    // One unit (GEMV_WARPS pairs) of phase ph.
    auto unit_run = [&](int ph, int unit) {
        const int p = unit * GEMV_WARPS + wib;
        if (p >= c.ph[ph].pairs) return;
        if (ph == 0 || c.mode == 2) waited_pair<false>(c.ph[ph], nullptr, c.cnt, c.cnt, ph, p, c.ph[ph].k, c.mode);
        else waited_pair<true>(c.ph[ph], &c.ph[ph - 1], c.cnt + (ph - 1) * 64, c.cnt, ph, p, 0, c.mode);
    };
    if (c.tickets) {
        // Dynamic: tickets over the phases' units in order (the next one taken while this
        // one runs), so blocks share the work whatever each phase's size.
        int ends[4], total = 0;
        for (int ph = 0; ph < 4; ph++) total += (c.ph[ph].pairs + GEMV_WARPS - 1) / GEMV_WARPS, ends[ph] = total;
        __shared__ int tk[2];
        if (threadIdx.x == 0) tk[0] = (int)atomicAdd(c.cnt + 600, 1u);
        __syncthreads();
        int t = tk[0], slot = 0;
        while (t < total) {
            if (threadIdx.x == 0) tk[slot ^ 1] = (int)atomicAdd(c.cnt + 600, 1u);
            int ph = 0;
            while (t >= ends[ph]) ph++;
            unit_run(ph, t - (ph ? ends[ph - 1] : 0));
            __syncthreads();
            slot ^= 1;
            t = tk[slot];
        }
    } else {
        for (int ph = 0; ph < 4; ph++) {
            const int units = (c.ph[ph].pairs + GEMV_WARPS - 1) / GEMV_WARPS;
            for (int unit = blockIdx.x; unit < units; unit += gridDim.x) unit_run(ph, unit);
        }
    }
    finish_launch(c.cnt, 1024);  // (with the ticket count at 600)
}


// The streamed chain: a block per SM, one producer warp streaming the weights of its rows,
// phase after phase, through a ring of shared-memory stages (two rows × SC_CH columns, bulk
// copies onto an mbarrier) without ever waiting for activations; NC consumer warps take the
// block's row pairs in turn, wait for a stage and, from the second phase on, for the
// 512-output chunks of the phase before that its columns need (as fused_chain), and count
// their outputs the same way. While consumers wait at a phase's start, the producer keeps
// the memory busy until the ring is full (~5 µs of the card's bandwidth at 24 stages).
#define SC_CH 2048
#define SC_STAGE (2 * SC_CH * 2)
__device__ __forceinline__ uint4 lds128(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
    return v;
}
template <int NC>
__global__ void __launch_bounds__(32 * (NC + 1), 1) stream_chain(const Chain c, int stages) {
    extern __shared__ __align__(1024) unsigned char sc_smem[];
    const unsigned base = ((unsigned)__cvta_generic_to_shared(sc_smem) + 1023u) & ~1023u;
    // issued_at: how many stages the producer has issued. A consumer skips the other warps'
    // stages, so it may reach a stage's use n while use n − 1 is still pending, and a parity
    // wait cannot tell use n from use n − 2; once use n is issued, use n − 1 was released
    // (its full phase complete), so the parity wait is exact.
    const unsigned full_at = base + stages * SC_STAGE, empty_at = full_at + 8 * stages, issued_at = empty_at + 8 * stages;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = gridDim.x, b = blockIdx.x;
    if (c.trig) pdl_trigger();
    if (threadIdx.x == 0) {
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(issued_at), "r"(0) : "memory");
        for (int s = 0; s < stages; s++) mbar_init(full_at + 8 * s, 1), mbar_init(empty_at + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {
        if (lane == 0) {
            int s = 0;
            for (int ph = 0; ph < c.nph; ph++) {
                const Phase P = c.ph[ph];
                const int p0 = (int)((long long)P.pairs * b / G), p1 = (int)((long long)P.pairs * (b + 1) / G);
                const int chunks = P.k / SC_CH;
                for (int p = p0; p < p1; p++) {
                    const unsigned short* w0 = P.w + (size_t)(P.kind == 2 ? p : 2 * p) * P.k;
                    const unsigned short* w1 = P.w + (size_t)(P.kind == 2 ? p + P.pairs : 2 * p + 1) * P.k;
                    for (int j = 0; j < chunks; j++, s++) {
                        const int st = s % stages;
                        mbar_wait(empty_at + 8 * st, ((s / stages) & 1) ^ 1);
                        mbar_arrive_expect_tx(full_at + 8 * st, SC_STAGE);
                        const unsigned dst = base + st * SC_STAGE;
                        bulk_copy_g2s(dst, w0 + (size_t)j * SC_CH, SC_CH * 2, full_at + 8 * st);
                        bulk_copy_g2s(dst + SC_CH * 2, w1 + (size_t)j * SC_CH, SC_CH * 2, full_at + 8 * st);
                        asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(issued_at), "r"(s + 1) : "memory");
                    }
                }
            }
        }
    } else {
        const int cw = warp - 1;
        pdl_wait();
        int s = 0;
        for (int ph = 0; ph < c.nph; ph++) {
            const Phase P = c.ph[ph];
            const int p0 = (int)((long long)P.pairs * b / G), p1 = (int)((long long)P.pairs * (b + 1) / G);
            const int chunks = P.k / SC_CH;
            // Input columns known complete (chunks never become incomplete again).
            int ready = ph == 0 || c.mode == 2 ? P.k : 0;
            for (int p = p0; p < p1; p++) {
                if ((p - p0) % NC != cw) {
                    s += chunks;
                    continue;
                }
                float s0 = 0.f, s1 = 0.f;
                for (int j = 0; j < chunks; j++, s++) {
                    const int st = s % stages;
                    if (j * SC_CH >= ready) ready = wait_inputs(c, ph, j * SC_CH, SC_CH, P.k, true);
                    if (lane == 0) {
                        unsigned n;
                        do asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(n) : "r"(issued_at) : "memory");
                        while (n <= (unsigned)s);
                    }
                    __syncwarp();
                    mbar_wait(full_at + 8 * st, (s / stages) & 1);
                    const unsigned ws = base + st * SC_STAGE;
#pragma unroll
                    for (int t = 0; t < SC_CH / 256; t++) {
                        const uint4 a = lds128(ws + (t * 256 + lane * 8) * 2);
                        const uint4 bb = lds128(ws + SC_CH * 2 + (t * 256 + lane * 8) * 2);
                        float v[8];
                        x8(P.in + (size_t)j * SC_CH + t * 256 + lane * 8, v);
                        s0 += dot8_bf16(a, v);
                        s1 += dot8_bf16(bb, v);
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty_at + 8 * st);
                }
                store_pair(P, c.cnt, ph, p, s0, s1);
            }
        }
    }
    finish_launch(c.cnt, 257);  // the chunk counts and the blocks-done count
}

// Part 8 (./chainlab tiles): the streamed chain with every stage shared by all consumer
// warps. A block per SM; the blocks take groups of NC row pairs in turn (group g to block
// g mod G, so a phase's outputs complete roughly in column order); a stage holds the
// group's 2·NC rows × C columns (copied as mode says, below), and consumer warp w multiplies
// rows 2w and 2w + 1 of every stage, so no warp starves while another holds the ring (part
// 6's pair order). The producer never waits for activations, only for free stages; the consumers wait
// per C-column chunk of their input as in part 3. The phases come from an array (all 32
// layers' 128 in one launch, or 4 a launch), their counts at cnt + 64·phase, zeroed before
// the launch. Per-lane sums run in chain_gemv's column order: the same bits.
// mode & 3: 1 waits, 2 no waits (wrong results: the bound), 3 no waits and no arithmetic
// (the ring's streaming rate alone). mode & 16: 2-D tensor-map copies (maps[ph], boxes of
// 256 columns × the group's 2·NC rows, or NC gate and NC up rows for gate/up), a stage laid
// out box by box as [2·NC rows][256 columns]; every phase's pairs a multiple of NC.
__device__ __forceinline__ void tma_2d(unsigned dst, const CUtensorMap* map, int x, int y, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(map), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}
template <int NC, int C>
__global__ void __launch_bounds__(32 * (NC + 1), 1) stream_tiles(const Phase* phs, int nph, unsigned* cnt, int stages, int mode, const CUtensorMap* maps) {
    extern __shared__ __align__(1024) unsigned char tiles_smem[];
    constexpr int SB = NC * 2 * C * 2;  // a stage's bytes
    const unsigned base = ((unsigned)__cvta_generic_to_shared(tiles_smem) + 1023u) & ~1023u;
    const unsigned full_at = base + stages * SB, empty_at = full_at + 8 * stages;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) mbar_init(full_at + 8 * s, mode & 8 ? 32 : 1), mbar_init(empty_at + 8 * s, NC);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {
        // mode & 4: the stage's rows copied by as many lanes at once (else lane 0 copies all);
        // mode & 8: the lanes copy the stage by cp.async, 16 bytes each, each lane's copies
        // arriving on the full barrier (32 arrivals) instead of bulk copies.
        const bool lanes = mode & 12, cpa = mode & 8, tm = mode & 16;
        if (lanes || lane == 0) {
            int s = 0;
            for (int ph = 0; ph < nph; ph++) {
                const Phase P = phs[ph];
                const int groups = (P.pairs + NC - 1) / NC, chunks = P.k / C;
                for (int g = b; g < groups; g += G) {
                    const int n = min(NC, P.pairs - g * NC);
                    for (int j = 0; j < chunks; j++, s++) {
                        const int st = s % stages;
                        const unsigned dst = base + st * SB;
                        if (lane == 0) {
                            mbar_wait(empty_at + 8 * st, ((s / stages) & 1) ^ 1);
                            if (!cpa) mbar_arrive_expect_tx(full_at + 8 * st, n * 2 * C * 2);
                        }
                        if (tm) {
                            for (int t = 0; t < C / 256; t++) {
                                const unsigned d = dst + t * (2 * NC * 512), x = j * C + t * 256;
                                if (P.kind == 2) {
                                    tma_2d(d, maps + ph, x, g * NC, full_at + 8 * st);
                                    tma_2d(d + NC * 512, maps + ph, x, P.pairs + g * NC, full_at + 8 * st);
                                } else
                                    tma_2d(d, maps + ph, x, 2 * g * NC, full_at + 8 * st);
                            }
                            continue;
                        }
                        if (lanes) __syncwarp();
                        if (cpa) {
                            for (int q = lane; q < 2 * n * (C / 8); q += 32) {
                                const int r = q / (C / 8), o = q % (C / 8) * 8, p = g * NC + r / 2;
                                const int row = P.kind == 2 ? (r & 1 ? p + P.pairs : p) : 2 * p + (r & 1);
                                cp_async16_at(dst + (r * C + o) * 2, P.w + (size_t)row * P.k + (size_t)j * C + o, 16);
                            }
                            cp_async_mbar_arrive(full_at + 8 * st);
                            continue;
                        }
                        for (int r = lanes ? lane : 0; r < 2 * n; r += lanes ? 32 : 1) {
                            const int p = g * NC + r / 2;
                            const int row = P.kind == 2 ? (r & 1 ? p + P.pairs : p) : 2 * p + (r & 1);
                            bulk_copy_g2s(dst + r * C * 2, P.w + (size_t)row * P.k + (size_t)j * C, C * 2, full_at + 8 * st);
                        }
                    }
                }
            }
        }
        return;
    }
    const int cw = warp - 1;
    pdl_wait();
    int s = 0;
    for (int ph = 0; ph < nph; ph++) {
        const Phase P = phs[ph];
        const int groups = (P.pairs + NC - 1) / NC, chunks = P.k / C;
        int ready = ph == 0 || (mode & 3) >= 2 ? P.k : 0;  // input columns known complete
        for (int g = b; g < groups; g += G) {
            const bool mine = g * NC + cw < P.pairs;
            float s0 = 0.f, s1 = 0.f;
            for (int j = 0; j < chunks; j++, s++) {
                const int st = s % stages;
                if (mine && j * C >= ready) ready = wait_cols(phs[ph - 1], cnt + (ph - 1) * 64, j * C, C, P.k, true);
                mbar_wait(full_at + 8 * st, (s / stages) & 1);
                if (mine && (mode & 3) != 3) {
                    // The pair's two rows: 256 columns a box ([2·NC][256]) or whole C-column rows.
                    const bool tm = mode & 16;
                    const int r0 = tm && P.kind == 2 ? cw : 2 * cw, r1 = tm && P.kind == 2 ? NC + cw : 2 * cw + 1;
                    const unsigned ws = base + st * SB;
#pragma unroll
                    for (int t = 0; t < C / 256; t++) {
                        float v[8];
                        x8(P.in + (size_t)j * C + t * 256 + lane * 8, v);
                        const unsigned a0 = tm ? ws + t * (2 * NC * 512) + r0 * 512 + lane * 16 : ws + (r0 * C + t * 256 + lane * 8) * 2;
                        const unsigned a1 = tm ? ws + t * (2 * NC * 512) + r1 * 512 + lane * 16 : ws + (r1 * C + t * 256 + lane * 8) * 2;
                        s0 += dot8_bf16(lds128(a0), v);
                        s1 += dot8_bf16(lds128(a1), v);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_at + 8 * st);
            }
            if (mine) store_pair(P, cnt, ph, g * NC + cw, s0, s1);
        }
    }
}

// Part 9 (./chainlab tiles, after part 8): the chain's phases in one persistent launch of
// chain_gemv's grid shape (GEMV_WARPS warps a block, 4 blocks per SM), each warp streaming
// its row pairs by loads into registers (fused_chain's loop, U = 2) phase after phase:
// pair p of phase ph goes to warp (rot_ph + p) mod W, rot_ph the pairs of the phases
// before it, so the phases are dealt out as one round-robin and every warp has the same
// share ± 1 pair. A warp waits per 512-column group of its input (mode 1) or never
// (mode 2: wrong results, the bound); the counts as part 8's.
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) ldg_chain(const Phase* phs, int nph, unsigned* cnt, int mode) {
    const int W = gridDim.x * GEMV_WARPS, w = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    pdl_wait();
    int rot = 0;
    for (int ph = 0; ph < nph; ph++) {
        const Phase P = phs[ph];
        int ready = ph == 0 || mode == 2 ? P.k : 0;
        for (int p = ((w - rot) % W + W) % W; p < P.pairs; p += W)
            ready = ready >= P.k ? waited_pair<false>(P, nullptr, cnt, cnt, ph, p, ready, mode)
                                 : waited_pair<true>(P, phs + ph - 1, cnt + (ph - 1) * 64, cnt, ph, p, ready, mode);
        rot = (rot + P.pairs) % W;
    }
}

// Part 9's bound without its waits' registers: the same round-robin over the phases, each
// pair by chain_gemv's own loop and store (pair_stream, pair_store), no counts, no waits
// (wrong results: the bound of a fused chain whose loop spills nothing). The phases sit in
// constant memory, so their fields need no registers of their own (as chain_gemv's
// parameters).
__constant__ Phase c_phases[128];
// Pair p's two rows and their first loads (U = 2, from the lane's column k0), as chain_gemv
// starts a pair.
__device__ __forceinline__ void pair_open(const Phase& P, int p, int k0, const unsigned short*& w0, const unsigned short*& w1, uint4 (&a)[2], uint4 (&b)[2]) {
    w0 = P.w + (size_t)(P.kind == 2 ? p : 2 * p) * P.k;
    w1 = P.w + (size_t)(P.kind == 2 ? p + P.pairs : 2 * p + 1) * P.k;
#pragma unroll
    for (int u = 0; u < 2; u++) a[u] = ld_stream_u4(w0 + k0 + u * 256), b[u] = ld_stream_u4(w1 + k0 + u * 256);
}
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) ldg_chain_bound(int nph) {
    const int lane = threadIdx.x & 31;
    const int W = gridDim.x * GEMV_WARPS, w = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    int rot = 0;
    for (int ph = 0; ph < nph; ph++) {
        const Phase& P = c_phases[ph];
        for (int p = ((w - rot) % W + W) % W; p < P.pairs; p += W) {
            const unsigned short *w0, *w1;
            uint4 a[2], b[2];
            const int k0 = lane * 8;
            pair_open(P, p, k0, w0, w1, a, b);
            float s0 = 0.f, s1 = 0.f;
            pair_stream<2>(w0, w1, P.in, k0, P.k, a, b, s0, s1);
            pair_store(P.out, p, P.kind, s0, s1);
        }
        rot = (rot + P.pairs) % W;
    }
}

// Part 9 with a barrier per phase instead of waits per column group: the bound's loop, and
// before its first pair of a phase (its first loads issued) a warp waits until every block
// has counted the phase before complete. A warp counts its phase done into its block's
// shared count after a fence (lane 0 stored all its outputs); the block's last warp, after
// a fence of its own, adds 1 to the phase's global count. Waiting: lane 0 polls the count
// with relaxed loads (no L1 invalidation per poll), then one acquire fence. bar: nph counts
// `pad` words apart (1, or 32: a 128-byte line each), zeroed before the launch; sleep: ns
// between polls (0: spin). bpoll: one warp of the block polls (the first to need the count)
// and opens a shared flag for the others, so 528 lanes poll instead of 4,224. cta: a warp
// fences at block scope before its shared count (the last warp's gpu-scope fence is
// cumulative), instead of every warp fencing at gpu scope; cta 2 (written after the
// fiftieth session's last run, not yet run) also has the block's last warp count by one
// release reduction, and the warps that find the shared flag open acquire at block scope
// (the poller's gpu-scope acquire before it opened the flag is cumulative). pf (also not yet
// run): before it waits, a warp asks L2 for the first pf bytes of each of its pair's rows
// (prefetch.global.L2, a 128-byte line per lane), so that the memory keeps working through
// the barrier.
__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) ldg_chain_sync(int nph, unsigned* bar, int sleep, int pad, int bpoll, int cta, int pf) {
    __shared__ unsigned done[128], owner[128], opened[128];
    const int lane = threadIdx.x & 31;
    const int W = gridDim.x * GEMV_WARPS, w = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    for (int i = threadIdx.x; i < 128; i += blockDim.x) done[i] = 0, owner[i] = 0, opened[i] = 0;
    __syncthreads();
    int rot = 0;
    for (int ph = 0; ph < nph; ph++) {
        const Phase& P = c_phases[ph];
        bool first = ph > 0;
        for (int p = ((w - rot) % W + W) % W; p < P.pairs; p += W) {
            const unsigned short *w0, *w1;
            uint4 a[2], b[2];
            const int k0 = lane * 8;
            pair_open(P, p, k0, w0, w1, a, b);
            if (first) {
                for (int off = 1024 + lane * 128; off < pf; off += 32 * 128) {  // (the first 1 KiB is loaded already)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)w0 + off));
                    asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)w1 + off));
                }
                if (lane == 0) {
                    volatile unsigned* fl = opened + ph - 1;
                    if (!bpoll || atomicCAS_block(owner + ph - 1, 0u, 1u) == 0u) {
                        while (ld_relaxed(bar + (ph - 1) * pad) < gridDim.x)
                            if (sleep) __nanosleep(sleep);
                        asm volatile("fence.acq_rel.gpu;" ::: "memory");
                        *fl = 1u;
                    } else
                        while (!*fl) __nanosleep(32);
                }
                __syncwarp();
                if (cta == 2 && bpoll) asm volatile("fence.acq_rel.cta;" ::: "memory");
                else asm volatile("fence.acq_rel.gpu;" ::: "memory");
                first = false;
            }
            float s0 = 0.f, s1 = 0.f;
            pair_stream<2>(w0, w1, P.in, k0, P.k, a, b, s0, s1);
            pair_store(P.out, p, P.kind, s0, s1);
        }
        if (lane == 0) {
            if (cta) asm volatile("fence.acq_rel.cta;" ::: "memory");
            else asm volatile("fence.acq_rel.gpu;" ::: "memory");
            if (atomicAdd_block(done + ph, 1u) == GEMV_WARPS - 1) {
                if (cta == 2) red_release(bar + ph * pad, 1u);
                else {
                    asm volatile("fence.acq_rel.gpu;" ::: "memory");
                    atomicAdd(bar + ph * pad, 1u);
                }
            }
        }
        rot = (rot + P.pairs) % W;
    }
}

// Part 7 (./chainlab staged): a launch that lets the next one in early
// (griddepcontrol.launch_dependents, at entry or later: trig_pm) and, before its
// griddepcontrol.wait, copies the first `cols` columns of each warp's first row pair into
// shared memory by bulk copies, so blocks that start beside the launch before them fetch
// weights while it finishes (the
// megakernels' "loads never wait" at a launch boundary). The grid is per_sm blocks per SM,
// warps taking row pairs in a stride as chain_gemv's persistent ways; the staged columns are
// summed first, then the rest as chain_gemv (U = 2), in the same order: the same bits.
template <int NW>
__global__ void __launch_bounds__(NW * 32, 4) staged_gemv(const unsigned short* w, const float* in, float* out, int pairs, int k, int kind, int cols, int trig_pm) {
    extern __shared__ __align__(128) unsigned char st_smem[];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int stride = gridDim.x * NW;
    int p = blockIdx.x * NW + wib;
    // The warp lets the next launch in as it starts pair number trig_pm / 1000 of its n_w
    // (0: at entry; 1000: its last pair).
    const int n_w = p < pairs ? (pairs - p + stride - 1) / stride : 0;
    const int trig_i = trig_pm >= 1000 ? n_w - 1 : (int)((long long)n_w * trig_pm / 1000);
    const int p_trig = trig_pm == 0 ? -1 : p + stride * trig_i;
    if (trig_pm == 0) pdl_trigger();
    const unsigned base = (unsigned)__cvta_generic_to_shared(st_smem);
    const unsigned bar = base + 8 * wib;
    const unsigned buf = base + 128 + (unsigned)(wib * cols * 4);
    const bool staged = cols > 0 && p < pairs;
    if (staged) {
        if (lane == 0) {
            mbar_init(bar, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
            mbar_arrive_expect_tx(bar, cols * 4);
            bulk_copy_g2s(buf, w + (size_t)(kind == 2 ? p : 2 * p) * k, cols * 2, bar);
            bulk_copy_g2s(buf + cols * 2, w + (size_t)(kind == 2 ? p + pairs : 2 * p + 1) * k, cols * 2, bar);
        }
        __syncwarp();
    }
    if (p >= pairs) { pdl_wait(); return; }
    bool first = true;
    for (; p < pairs; p += stride) {
        if (p == p_trig) pdl_trigger();
        const unsigned short* w0 = w + (size_t)(kind == 2 ? p : 2 * p) * k;
        const unsigned short* w1 = w + (size_t)(kind == 2 ? p + pairs : 2 * p + 1) * k;
        const int step = 256;
        int k0 = (first && staged ? cols : 0) + lane * 8;
        const bool rest = k0 - lane * 8 < k;
        uint4 a[2], b[2];
        if (rest) {
#pragma unroll
            for (int u = 0; u < 2; u++) a[u] = ld_stream_u4(w0 + k0 + u * step), b[u] = ld_stream_u4(w1 + k0 + u * step);
        }
        float s0 = 0.f, s1 = 0.f;
        if (first) {
            pdl_wait();
            if (staged) {
                mbar_wait(bar, 0);
                for (int c = lane * 8; c < cols; c += step) {
                    float v[8];
                    x8(in + c, v);
                    s0 += dot8_bf16(lds128(buf + c * 2), v);
                    s1 += dot8_bf16(lds128(buf + cols * 2 + c * 2), v);
                }
            }
            first = false;
        }
        if (rest) pair_stream<2>(w0, w1, in, k0, k, a, b, s0, s1);
        pair_store(out, p, kind, s0, s1);
    }
}


struct Way { const char* name; int per_sm; bool pdl; int trig; int u; };

int main(int argc, char** argv) {
    const int L = 32, H = 4096, QKV = 6144, FF = 14336;
    int nsm;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    std::vector<float> hx(FF);
    for (int i = 0; i < FF; i++) hx[i] = ((i * 37) % 101) / 50.f - 1;
    float *x, *qkv, *act, *res;
    CK(cudaMalloc(&x, FF * 4));
    CK(cudaMemcpy(x, hx.data(), FF * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&qkv, QKV * 4));
    CK(cudaMalloc(&act, FF * 4));
    CK(cudaMalloc(&res, 2 * FF * 4));
    struct Shape { const char* name; int rows, k, kind; };
    const Shape shapes[4] = {{"QKV", QKV, H, 0}, {"o", H, H, 1}, {"gate/up", 2 * FF, H, 2}, {"down", H, FF, 1}};
    size_t sbytes[4], layer = 0;
    for (int s = 0; s < 4; s++) sbytes[s] = (size_t)shapes[s].rows * shapes[s].k * 2, layer += sbytes[s];
    const size_t total = layer * L;
    unsigned short* all;
    CK(cudaMalloc(&all, total));
    fill_bf16<<<4 * nsm, 256>>>(all, total / 2, 7u, 1.f / 64);
    CK(cudaDeviceSynchronize());
    auto wp = [&](int s, int l) { size_t off = layer * l; for (int i = 0; i < s; i++) off += sbytes[i]; return all + off / 2; };
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    // Any of the lab's kernels on st, with programmatic dependent launch or without.
    auto launch_ex = [&](bool pdl, int grid, int threads, int smem, auto kernel, auto... args) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, kernel, args...));
    };
    auto launch = [&](int s, int l, const Way& wy, const float* in, float* out) {
        const Shape& sh = shapes[s];
        const int pairs = sh.kind == 2 ? FF : sh.rows / 2;
        const int full = (pairs + GEMV_WARPS - 1) / GEMV_WARPS;
        const int grid = wy.per_sm ? std::min(full, wy.per_sm * nsm) : full;
        launch_ex(wy.pdl, grid, GEMV_WARPS * 32, 0, wy.u == 4 ? chain_gemv<4> : chain_gemv<2>, (const unsigned short*)wp(s, l), in, out,
                  pairs, sh.k, sh.kind, wy.trig);
    };
    // Parts 3 and 6: the chain's counts, down's output, layer l as four launches (o, gate/up,
    // down, next QKV), and the inputs of a bit comparison.
    unsigned* cnt;
    CK(cudaMalloc(&cnt, 1024 * 4));
    CK(cudaMemset(cnt, 0, 1024 * 4));
    float* res2;
    CK(cudaMalloc(&res2, H * 4));
    auto four_launches = [&](int l, const Way& wy) {
        launch(1, l, wy, qkv, res);
        launch(2, l, wy, res, act);
        launch(3, l, wy, act, res2);
        launch(0, (l + 1) % L, wy, res2, qkv);
    };
    auto phase = [&](int i, int l) -> Phase {
        if (i == 0) return {wp(1, l), qkv, res, H / 2, H, 1};
        if (i == 1) return {wp(2, l), res, act, FF, H, 2};
        if (i == 2) return {wp(3, l), act, res2, H / 2, FF, 1};
        return {wp(0, (l + 1) % L), res2, qkv, QKV / 2, H, 0};
    };
    const std::vector<float> h0(2 * FF, 0.25f);
    auto reset = [&]() {
        CK(cudaMemcpy(res, h0.data(), H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(res2, h0.data(), H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(act, 0, FF * 4));
        CK(cudaMemcpy(qkv, hx.data(), QKV * 4, cudaMemcpyHostToDevice));
    };
    std::vector<Way> ways = {
        {"plain", 0, false, 0, 2},
        {"pdl", 0, true, 0, 2},
        {"pdl trig-last", 0, true, 2, 2},
        {"pdl trig-after", 0, true, 3, 2},
        {"pers2 pdl", 2, true, 0, 2},
        {"pers2 pdl trig-last", 2, true, 2, 2},
        {"pers2 pdl trig-start", 2, true, 1, 2},
        {"pers3 pdl trig-last", 3, true, 2, 2},
        {"pers4 pdl", 4, true, 0, 2},
        {"pers1 pdl trig-last U4", 1, true, 2, 4},
        {"pers2 pdl trig-last U4", 2, true, 2, 4},
        {"plain U4", 0, false, 0, 4},
    };
    const double gb = total / 1e9;
    // Parts 7 and 8's floor: one GEMV over all the bytes in one launch (k = 4096).
    auto print_floor = [&]() {
        const int pairs = (int)(total / 2 / H / 2);
        float* fo;
        CK(cudaMalloc(&fo, (size_t)pairs * 2 * 4));
        float best = 1e30f;
        for (int r = 0; r < 3; r++)
            best = std::min(best, graph_us(st, 1, [&](int) { chain_gemv<2><<<(pairs + GEMV_WARPS - 1) / GEMV_WARPS, GEMV_WARPS * 32, 0, st>>>(all, x, fo, pairs, H, 0, 0); }));
        CK(cudaFree(fo));
        printf("one GEMV over all %.2f GB: %.1f us  %.0f GB/s\n", gb, best, gb / (best * 1e-6));
    };
    // Parts 6 and 8's outputs for a bit comparison: every buffer the chain writes.
    auto grab_all = [&]() {
        std::vector<float> h(QKV + 2 * H + FF);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        CK(cudaMemcpy(h.data(), qkv, QKV * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h.data() + QKV, res, H * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h.data() + QKV + H, res2, H * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h.data() + QKV + 2 * H, act, FF * 4, cudaMemcpyDeviceToHost));
        return h;
    };
    auto differ = [](const std::vector<float>& a, const std::vector<float>& b) {
        int n = 0;
        for (size_t i = 0; i < a.size(); i++) n += memcmp(&a[i], &b[i], 4) != 0;
        return n;
    };
    auto chain = [&](const Way& wy) {
        float best = 1e30f;
        for (int r = 0; r < 3; r++)
            best = std::min(best, graph_us(st, 1, [&](int) {
                for (int l = 0; l < L; l++) {
                    launch(0, l, wy, x, qkv);
                    launch(1, l, wy, qkv, res);
                    launch(2, l, wy, x, act);
                    launch(3, l, wy, act, res);
                }
            }));
        return best;
    };
    // Part 7 (argument "staged": this part only): the launches with the next one let in early
    // (at entry or later) and the first columns of each warp's first pair staged in shared
    // memory before the wait, against the engine's programmatic launches; bits first.
    if (argc > 1 && !strcmp(argv[1], "staged")) {
        struct St { int per_sm, cols, trig_pm; };
        const std::vector<St> sts = {{2, 0, 0}, {2, 1024, 0}, {2, 0, 500}, {2, 1024, 500}, {2, 0, 750}, {2, 1024, 750}, {2, 512, 750}, {2, 0, 1000}, {2, 1024, 1000}};
        // The staged columns must be whole 512-column groups within k (pair_stream's loop), and
        // the kernel may take the largest form's shared memory.
        int smem_max = 49152;
        for (const St& c : sts) {
            if (c.cols % 512 || c.cols > H) { printf("staged columns must be a multiple of 512, at most %d\n", H); return 1; }
            smem_max = std::max(smem_max, 128 + GEMV_WARPS * c.cols * 4);
        }
        CK(cudaFuncSetAttribute(staged_gemv<GEMV_WARPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
        auto slaunch = [&](int s, int l, const St& c, const float* in, float* out) {
            const Shape& sh = shapes[s];
            const int pairs = sh.kind == 2 ? FF : sh.rows / 2;
            launch_ex(true, c.per_sm * nsm, GEMV_WARPS * 32, 128 + GEMV_WARPS * c.cols * 4, staged_gemv<GEMV_WARPS>, (const unsigned short*)wp(s, l), in, out,
                      pairs, sh.k, sh.kind, c.cols, c.trig_pm);
        };
        auto body = [&](auto one) {
            for (int l = 0; l < L; l++) one(0, l, x, qkv), one(1, l, qkv, res), one(2, l, x, act), one(3, l, act, res);
        };
        auto grab = [&]() {
            std::vector<float> h(QKV + H + FF);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            CK(cudaMemcpy(h.data(), qkv, QKV * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h.data() + QKV, res, H * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h.data() + QKV + H, act, FF * 4, cudaMemcpyDeviceToHost));
            return h;
        };
        reset();
        body([&](int s, int l, const float* in, float* out) { launch(s, l, ways[1], in, out); });
        const std::vector<float> ref = grab();
        for (const St& c : sts) {
            reset();
            body([&](int s, int l, const float* in, float* out) { slaunch(s, l, c, in, out); });
            const std::vector<float> got = grab();
            const int diff = differ(ref, got);
            int fits = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, staged_gemv<GEMV_WARPS>, GEMV_WARPS * 32, 128 + GEMV_WARPS * c.cols * 4));
            printf("staged %d/SM, %d columns, trigger at %d/1000 (%d blocks fit per SM): %d of %zu outputs differ in bits from pdl\n", c.per_sm, c.cols, c.trig_pm, fits, diff, ref.size());
        }
        print_floor();
        for (int round = 0; round < 3; round++) {
            for (int wi : {1, 2, 4, 6}) {
                const float us = chain(ways[wi]);
                printf("round %d  %-26s chain %.1f us  %.0f GB/s\n", round, ways[wi].name, us, gb / (us * 1e-6));
            }
            for (const St& c : sts) {
                float best = 1e30f;
                for (int r = 0; r < 3; r++)
                    best = std::min(best, graph_us(st, 1, [&](int) { body([&](int s, int l, const float* in, float* out) { slaunch(s, l, c, in, out); }); }));
                printf("round %d  staged %d/SM %4d cols trig %4d chain %.1f us  %.0f GB/s\n", round, c.per_sm, c.cols, c.trig_pm, best, gb / (best * 1e-6));
            }
        }
        return 0;
    }
    // Parts 8 and 9 (argument "tiles": these parts only; "tiles ldg": part 8's bits but not its
    // timings): the streamed chain with shared stages, all 32 layers in one launch and a
    // launch per layer, and ldg_chain, against the 128 programmatic launches and the
    // one-launch floor; bits first (a broken ring could hang the timing).
    if (argc > 1 && !strcmp(argv[1], "tiles")) {
        const int NPH = 4 * L;  // c_phases and ldg_chain_sync's shared counts hold 128
        if (NPH > 128) { printf("parts 8 and 9 take at most 128 phases\n"); return 1; }
        std::vector<Phase> hp(NPH);
        for (int l = 0; l < L; l++)
            for (int i = 0; i < 4; i++) hp[4 * l + i] = phase(i, l);
        Phase* dp;
        CK(cudaMalloc(&dp, NPH * sizeof(Phase)));
        CK(cudaMemcpy(dp, hp.data(), NPH * sizeof(Phase), cudaMemcpyHostToDevice));
        CK(cudaMemcpyToSymbol(c_phases, hp.data(), NPH * sizeof(Phase)));
        unsigned* tc;
        CK(cudaMalloc(&tc, NPH * 64 * 4));
        // Each phase's tensor map for 8 and for 16 pairs a group (boxes of 256 columns × 16 or
        // 32 rows, gate/up's 8 or 16), in device memory.
        auto make_maps = [&](int nc) {
            std::vector<CUtensorMap> hm(NPH);
            for (int i = 0; i < NPH; i++) {
                const Phase& P = hp[i];
                if (P.pairs % nc) { printf("phase %d: %d pairs, not a multiple of %d\n", i, P.pairs, nc); exit(1); }
                cuuint64_t dims[2] = {(cuuint64_t)P.k, (cuuint64_t)(2 * P.pairs)};
                cuuint64_t strides[1] = {(cuuint64_t)P.k * 2};
                cuuint32_t box[2] = {256, (cuuint32_t)(P.kind == 2 ? nc : 2 * nc)}, es[2] = {1, 1};
                CUresult r = cuTensorMapEncodeTiled(&hm[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)P.w, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                    CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
                if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", (int)r); exit(1); }
            }
            CUtensorMap* d;
            CK(cudaMalloc(&d, NPH * sizeof(CUtensorMap)));
            CK(cudaMemcpy(d, hm.data(), NPH * sizeof(CUtensorMap), cudaMemcpyHostToDevice));
            return (const CUtensorMap*)d;
        };
        const CUtensorMap *maps8 = make_maps(8), *maps16 = make_maps(16);
        const int smem_cap = 200 * 1024;
        struct Tf { const char* name; void (*k)(const Phase*, int, unsigned*, int, int, const CUtensorMap*); int nc, sb; };
        const Tf tfs[3] = {{"8 warps x 1024 cols", stream_tiles<8, 1024>, 8, 8 * 2 * 1024 * 2},
                           {"16 warps x 512 cols", stream_tiles<16, 512>, 16, 16 * 2 * 512 * 2},
                           {"8 warps x 2048 cols", stream_tiles<8, 2048>, 8, 8 * 2 * 2048 * 2}};
        auto tlaunch = [&](const Tf& f, bool one, int mode) {
            const int stages = smem_cap / f.sb, smem = stages * f.sb + 16 * stages + 1024;
            CK(cudaMemsetAsync(tc, 0, NPH * 64 * 4, st));
            // (The launch after the memset without programmatic serialization: it follows no kernel.)
            const CUtensorMap* mp = f.nc == 8 ? maps8 : maps16;
            if (one) launch_ex(false, nsm, 32 * (f.nc + 1), smem, f.k, (const Phase*)dp, NPH, tc, stages, mode, mp);
            else
                for (int l = 0; l < L; l++)
                    launch_ex(l > 0, nsm, 32 * (f.nc + 1), smem, f.k, (const Phase*)(dp + 4 * l), 4, tc + 4 * l * 64, stages, mode, mp + 4 * l);
        };
        for (const Tf& f : tfs) {
            const int stages = smem_cap / f.sb, smem = stages * f.sb + 16 * stages + 1024;
            CK(cudaFuncSetAttribute(f.k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            int fits = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, f.k, 32 * (f.nc + 1), smem));
            printf("tiles %s: %d stages of %d bytes, %d bytes of shared memory, %d blocks fit per SM\n", f.name, stages, f.sb, smem, fits);
            if (fits < 1) return 1;
        }
        const Way wpdl = {"", 0, true, 0, 2};
        reset();
        for (int l = 0; l < L; l++) four_launches(l, wpdl);
        const std::vector<float> ref = grab_all();
        for (const Tf& f : tfs)
            for (int one = 1; one >= 0; one--)
                for (int rep = 0; rep < 4; rep++) {
                    reset();
                    tlaunch(f, one, rep == 0 ? 1 : rep == 1 ? 5 : rep == 2 ? 9 : 17);  // run 1: the lanes copy; 2: cp.async; 3: 2-D maps
                    const std::vector<float> got = grab_all();
                    const int diff = differ(ref, got);
                    printf("tiles %s, %s, run %d: %d of %zu outputs differ in bits from the 128 launches\n", f.name, one ? "one launch" : "a launch per layer", rep, diff, ref.size());
                }
        // Part 9: the chain in one launch of register-streaming warps.
        int ldg_per = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ldg_per, ldg_chain, GEMV_WARPS * 32, 0));
        printf("ldg_chain: %d blocks per SM\n", ldg_per);
        auto ldg_launch = [&](int mode) {
            CK(cudaMemsetAsync(tc, 0, NPH * 64 * 4, st));
            launch_ex(false, ldg_per * nsm, GEMV_WARPS * 32, 0, ldg_chain, (const Phase*)dp, NPH, tc, mode);
        };
        for (int rep = 0; rep < 2; rep++) {
            reset();
            ldg_launch(1);
            const std::vector<float> got = grab_all();
            const int diff = differ(ref, got);
            printf("ldg_chain, run %d: %d of %zu outputs differ in bits from the 128 launches\n", rep, diff, ref.size());
        }
        // (Every block must be resident: the grid is what fits at once.)
        int sync_per = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&sync_per, ldg_chain_sync, GEMV_WARPS * 32, 0));
        printf("ldg_chain_sync: %d blocks per SM\n", sync_per);
        auto sync_launch = [&](int sleep, int pad, int bpoll, int cta, int pf) {
            CK(cudaMemsetAsync(tc, 0, NPH * 64 * 4, st));
            launch_ex(false, sync_per * nsm, GEMV_WARPS * 32, 0, ldg_chain_sync, NPH, tc, sleep, pad, bpoll, cta, pf);
        };
        const char* fences[3] = {"gpu-scope", "block-scope", "block-scope, lean"};
        for (int cta : {0, 1, 2}) {
            reset();
            sync_launch(64, 32, 1, cta, cta == 2 ? 8192 : 0);
            const std::vector<float> got = grab_all();
            printf("ldg_chain_sync, a poller per block, %s fences: %d of %zu outputs differ in bits from the 128 launches\n", fences[cta], differ(ref, got), ref.size());
        }
        const bool ldg_only = argc > 2 && !strcmp(argv[2], "ldg");
        print_floor();
        for (int round = 0; round < (ldg_only ? 3 : 2); round++) {
            float best = 1e30f;
            for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { for (int l = 0; l < L; l++) four_launches(l, wpdl); }));
            printf("round %d  128 launches (pdl): %.1f us  %.0f GB/s\n", round, best, gb / (best * 1e-6));
            for (int mode : {1, 2}) {
                best = 1e30f;
                for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { ldg_launch(mode); }));
                printf("round %d  ldg_chain, %s: %.1f us  %.0f GB/s\n", round, mode == 1 ? "one launch" : "one launch, no waits (wrong results)", best, gb / (best * 1e-6));
            }
            best = 1e30f;
            for (int r = 0; r < 3; r++)
                best = std::min(best, graph_us(st, 1, [&](int) { launch_ex(false, ldg_per * nsm, GEMV_WARPS * 32, 0, ldg_chain_bound, NPH); }));
            printf("round %d  ldg_chain_bound (chain_gemv's loop, no waits, wrong results): %.1f us  %.0f GB/s\n", round, best, gb / (best * 1e-6));
            for (int cta : {0, 1, 2})
                for (int sleep : {64, 128, 256}) {
                    best = 1e30f;
                    for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { sync_launch(sleep, 32, 1, cta, 0); }));
                    printf("round %d  ldg_chain_sync (a barrier per phase, counts a line apart, a poller per block, %s fences, sleep %d ns): %.1f us  %.0f GB/s\n", round, fences[cta], sleep, best, gb / (best * 1e-6));
                }
            // The lean barrier with the first bytes of each row asked of L2 before the wait.
            for (int pf : {4096, 8192, 16384}) {
                best = 1e30f;
                for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { sync_launch(64, 32, 1, 2, pf); }));
                printf("round %d  ldg_chain_sync (lean barrier, 64 ns sleep, %d bytes of each row prefetched to L2 before the wait): %.1f us  %.0f GB/s\n", round, pf, best, gb / (best * 1e-6));
            }
            if (ldg_only) continue;
            for (const Tf& f : tfs)
                for (int way : {4, 5, 6, 7, 16, 17, 18, 19}) {
                    // 0–3 lane 0 copies: one launch, a launch per layer, no waits, no
                    // arithmetic; 4–7 the same with the lanes copying; 8–11 by cp.async;
                    // 16–19 by 2-D tensor maps (timed: the lanes' and the maps').
                    const int m = way & 3, mode = (m == 0 || m == 1 ? 1 : m) | (way & 28);
                    best = 1e30f;
                    for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { tlaunch(f, m != 1, mode); }));
                    const char* names[4] = {"one launch", "a launch per layer", "one launch, no waits (wrong results)", "one launch, no waits, no arithmetic (the ring alone)"};
                    printf("round %d  tiles %s, %s, %s: %.1f us  %.0f GB/s\n", round, f.name, way & 16 ? "2-D maps" : way & 8 ? "cp.async" : way & 4 ? "lanes copy" : "lane 0 copies", names[m], best, gb / (best * 1e-6));
                }
        }
        return 0;
    }
    // Each way twice, interleaved (rounds), so drift shows.
    for (int round = 0; round < (argc > 1 ? 0 : 2); round++)
        for (const Way& wy : ways) {
            const float us = chain(wy);
            printf("round %d  %-26s chain %.1f us  %.0f GB/s\n", round, wy.name, us, gb / (us * 1e-6));
        }
    // Per shape (32 of one shape in a row), three ways.
    for (int s = 0; s < (argc > 1 ? 0 : 4); s++)
        for (int wi : {0, 1, 5}) {
            const Way& wy = ways[wi];
            float* out = shapes[s].kind == 0 ? qkv : shapes[s].kind == 2 ? act : res;
            float best = 1e30f;
            for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { for (int l = 0; l < L; l++) launch(s, l, wy, x, out); }));
            printf("shape %-8s %-26s %.2f us each  %.0f GB/s\n", shapes[s].name, wy.name, best / L, sbytes[s] * L / 1e9 / (best * 1e-6));
        }
    // The streamed chain (argument "stream": this part only): fused per layer and one phase
    // per launch, against the separate launches, and its bits against theirs.
    if (argc > 1 && !strcmp(argv[1], "stream")) {
        const int stages = argc > 2 ? atoi(argv[2]) : 24;
        const int smem = stages * SC_STAGE + 16 * stages + 16 + 1024;  // ring, full and empty barriers, the issued count, alignment
        constexpr int NC = 8;
        CK(cudaFuncSetAttribute(stream_chain<NC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int fits = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, stream_chain<NC>, 32 * (NC + 1), smem));
        if (fits < 1 || H % SC_CH || FF % SC_CH) { printf("stream_chain does not fit (%d blocks per SM)\n", fits); return 1; }
        int mode = 1;
        auto sc_launch = [&](Chain c) { launch_ex(true, nsm, 32 * (NC + 1), smem, stream_chain<NC>, c, stages); };
        auto fused = [&](int l) {
            Chain c = {};
            for (int i = 0; i < 4; i++) c.ph[i] = phase(i, l);
            c.nph = 4, c.mode = mode, c.cnt = cnt;
            sc_launch(c);
        };
        int trig = 0;
        auto split = [&](int l) {
            for (int i = 0; i < 4; i++) {
                Chain c = {};
                c.ph[0] = phase(i, l);
                c.nph = 1, c.mode = mode, c.cnt = cnt, c.trig = trig;
                sc_launch(c);
            }
        };
        // Bits first (a broken ring could hang the timing): layer 0 through the four launches,
        // then through the streamed forms, from the same inputs; every output buffer compared.
        {
            reset();
            four_launches(0, Way{"", 0, false, 0, 2});
            const std::vector<float> ref = grab_all();
            for (int way = 0; way < 3; way++)
                for (int rep = 0; rep < 3; rep++) {
                    reset();
                    mode = 1;
                    trig = way == 2;
                    if (way != 1) split(0);
                    else fused(0);
                    const std::vector<float> got = grab_all();
                    const int diff = differ(ref, got);
                    printf("streamed (%s), run %d: %d of %zu outputs differ in bits from the four launches\n", way == 1 ? "fused" : way ? "a launch per phase, early trigger" : "a launch per phase", rep, diff, ref.size());
                }
        }
        printf("streamed chain: %d stages of %d bytes, %d bytes of shared memory, %d blocks fit per SM\n", stages, SC_STAGE, smem, fits);
        for (int round = 0; round < 2; round++) {
            const Way wy = {"", 0, true, 0, 2};
            float best = 1e30f;
            for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { for (int l = 0; l < L; l++) four_launches(l, wy); }));
            printf("separate (pdl): %.1f us  %.0f GB/s\n", best, gb / (best * 1e-6));
            for (int way = 0; way < 4; way++) {
                mode = way == 2 ? 2 : 1;
                trig = way == 3;
                best = 1e30f;
                for (int r = 0; r < 3; r++)
                    best = std::min(best, graph_us(st, 1, [&](int) {
                        for (int l = 0; l < L; l++) {
                            if (way == 0 || way == 3) split(l);
                            else fused(l);
                        }
                    }));
                printf("streamed, %s: %.1f us  %.0f GB/s\n", way == 0 ? "a launch per phase" : way == 1 ? "fused" : way == 2 ? "fused, no waits (wrong results)" : "a launch per phase, early trigger", best, gb / (best * 1e-6));
            }
        }
        return 0;
    }
    // The fused chain: per layer one kernel (o, gate/up, down, next QKV), against the same
    // four GEMVs as separate launches (plain, pdl) in the same buffers.
    {
        int per = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, fused_chain, GEMV_WARPS * 32, 0));
        printf("fused_chain: %d blocks per SM\n", per);
        int tickets = 0, mode = 0;
        auto phases = [&](int l) {
            Chain c = {};
            c.tickets = tickets;
            c.mode = mode;
            for (int i = 0; i < 4; i++) c.ph[i] = phase(i, l);
            c.nph = 4;
            c.cnt = cnt;
            return c;
        };
        for (int round = 0; round < 2; round++) {
            for (int pdl = 0; pdl < 2; pdl++) {
                const Way wy = {"", 0, pdl == 1, 0, 2};
                float best = 1e30f;
                for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { for (int l = 0; l < L; l++) four_launches(l, wy); }));
                printf("separate (%s): %.1f us  %.0f GB/s\n", pdl ? "pdl" : "plain", best, gb / (best * 1e-6));
            }
            for (int pdl = 0; pdl < 4; pdl++) {
                tickets = pdl > 0;
                mode = pdl == 3 ? 2 : pdl == 2 ? 0 : 1;
                float best = 1e30f;
                for (int r = 0; r < 3; r++)
                    best = std::min(best, graph_us(st, 1, [&](int) {
                        for (int l = 0; l < L; l++) launch_ex(true, per * nsm, GEMV_WARPS * 32, 0, fused_chain, phases(l));
                    }));
                printf("fused (mode %d, %s): %.1f us  %.0f GB/s\n", mode, tickets ? "tickets" : "static", best, gb / (best * 1e-6));
            }
        }
        // Same results? Run layer 0 both ways from the same inputs and compare qkv.
        std::vector<float> hq(QKV), hf(QKV);
        reset();
        four_launches(0, Way{"", 0, false, 0, 2});
        CK(cudaMemcpy(hq.data(), qkv, QKV * 4, cudaMemcpyDeviceToHost));
        reset();
        mode = 1, tickets = 1;
        fused_chain<<<per * nsm, GEMV_WARPS * 32, 0, st>>>(phases(0));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(hf.data(), qkv, QKV * 4, cudaMemcpyDeviceToHost));
        double md = 0, mx = 0;
        for (int i = 0; i < QKV; i++) md = std::max(md, (double)fabsf(hq[i] - hf[i])), mx = std::max(mx, (double)fabsf(hq[i]));
        printf("fused vs separate, layer 0's QKV: largest difference %.3e of %.3e\n", md, mx);
    }
    // gate/up: [gate; up] (kind 2, the engine's), rows interleaved (kind 3), plain pairs (kind 0).
    for (int kind : {2, 3, 0, 2, 3, 0}) {
        const int pairs = FF;
        float best = 1e30f;
        for (int r = 0; r < 3; r++)
            best = std::min(best, graph_us(st, 1, [&](int) {
                for (int l = 0; l < L; l++) chain_gemv<2><<<pairs / GEMV_WARPS, GEMV_WARPS * 32, 0, st>>>(wp(2, l), x, kind == 0 ? res : act, pairs, H, kind, 0);
            }));
        printf("gate/up kind %d: %.2f us each  %.0f GB/s\n", kind, best / L, sbytes[2] * L / 1e9 / (best * 1e-6));
    }
    // The floor: one GEMV over all the bytes (k = 4096), and stream_read of them.
    {
        const long long rows = (long long)(total / 2 / H);
        const int pairs = (int)(rows / 2);
        float* fo;  // one output per row (act holds only FF)
        CK(cudaMalloc(&fo, (size_t)rows * 4));
        for (int per : {0, 2, 4}) {
            float best = 1e30f;
            for (int r = 0; r < 3; r++)
                best = std::min(best, graph_us(st, 1, [&](int) {
                    const int full = (pairs + GEMV_WARPS - 1) / GEMV_WARPS;
                    chain_gemv<2><<<per ? per * nsm : full, GEMV_WARPS * 32, 0, st>>>(all, x, fo, pairs, H, 0, 0);
                }));
            printf("one GEMV over all %.2f GB (grid %s): %.1f us  %.0f GB/s\n", gb, per ? (per == 2 ? "2/SM" : "4/SM") : "full", best, gb / (best * 1e-6));
        }
        unsigned* sink;
        CK(cudaMalloc(&sink, 4));
        float best = 1e30f;
        for (int r = 0; r < 3; r++) best = std::min(best, graph_us(st, 1, [&](int) { stream_read<<<4 * nsm, 256, 0, st>>>(all, (long long)(total / 16), sink); }));
        printf("stream_read all: %.1f us  %.0f GB/s\n", best, gb / (best * 1e-6));
    }
    return 0;
}
