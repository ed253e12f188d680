// Decode attention lab (docs/PERF.md, thirteenth session): one query token per sequence
// over a paged f16 KV cache, GQA (the query heads of one KV head in one block), head_dim
// 128, on the engine's cache layout and arguments. Times the engine's decode kernel
// (ops.cu `flash_decode_sa_f16_d128`, the four warps splitting each 64-key tile, the
// query heads as the rows of 16-row MMA tiles: 4 of 16 real for Llama-3-8B) against the
// "keys on M" form (ops.cu `flash_decode_km_impl`, first written here): per warp S^T = K·Q^T (16 keys as M, up to 8 query heads
// as N: half of the N=8 tile real instead of a quarter of M=16) and O^T += V^T·P^T
// (head_dim as M), P^T turned from S^T's accumulator layout into the B operand by
// movmatrix.trans, so a tile costs half the MMAs, half the accumulators (32 floats of O
// per thread instead of 64) and half the exponentials. Both with key splits 1–16 (+ the
// engine's merge kernel) and checked against a plain f32 reference. Batch 64 at 1k
// context reads 8.7 GB of KV per step; the engine's kernel ran at ~3.0 TB/s there.
// Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/decodelab.cu -o decodelab && ./decodelab [batch ctx]
//   (DL_SPLITS="1 4 16 33" picks the split counts, up to 64; DL_ENGINE_ONLY=1 times the
//   engine's keys-on-M form alone, e.g. `DL_ENGINE_ONLY=1 ./decodelab 8 32768`; DL_STAGES="3 6"
//   the keys-on-M stage counts, 2–6; DL_KM_FLAGS its flag bits, e.g. 8704 for the engine's
//   FLASH_BATCH_LOADS | FLASH_LAZY_RESCALE; DL_NO_SA=1 and DL_NO_BULK=1 leave out the flash
//   decode form and the bulk copies; DL_KM_LAB="0 1 2 4 5" times the keys-on-M kernel's lab
//   forms alone, KM_LAB_* in ops.cu, e.g. `DL_KM_LAB="0 1" DL_SPLITS=1 DL_KM_FLAGS=41600
//   ./decodelab 64 1040`; DL_ROPE=1 gives the kernel RoPE frequencies and slots, for the
//   engine's FLASH_ROPE (flag 32), and DL_SEQ_TABLES=1 block tables in order. Built with
//   -DKM_STAMPS, each keys-on-M timing and KM_LOADS' also prints its last launch's blocks
//   as a timeline: `timeline` below.)
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#include "../../kernels/src/cuda/ops.cu"
#include "graph_time.h"

// With DL_ROPE=1 the RoPE frequencies (theta 500,000) and each row's slot (its last key's,
// so FLASH_ROPE rotates q and writes the row's k and v there, as the engine's decode steps
// do); null otherwise.
__device__ const float* lab_inv_freq;
__device__ const long long* lab_slots;

// The keys-on-M kernel of ops.cu (`flash_decode_km_impl`, the engine's at 3 stages) with
// 2–4 stages of K/V tiles; LAB: its lab forms (KM_LAB_* in ops.cu; the engine's is 0).
template <int STAGES, int LAB = 0>
__global__ void __launch_bounds__(128) decode_km_f16_d128(FLASH_ARGS) {
    flash_decode_km_impl<128, STAGES, unsigned short, LAB>(qkv, cache, half, tiles, tables, n_heads, n_kv, block_size,
                                                           scale, max_ctx, out, part, flags, lab_inv_freq, lab_slots, 0);
}

// One tile's copies as the keys-on-M kernel asks for them (lean loads, no batching): keys
// [kb, kb + 64) below k1, this thread's 16-byte column of each (`my_src`: the KV head's rows
// from the column on), a block-table read per key; K at `at`, V KBYTES on.
__device__ __forceinline__ void km_lab_copies(unsigned at, const unsigned short* cache, long long half,
                                              const unsigned short* my_src, const unsigned int* table,
                                              size_t blk_stride, int block_size, int kb, int k1) {
    constexpr int HD = 128, CH = HD / 8, KPP = 128 / CH, PASSES = KM_KEYS / KPP, ST = HD + 8;
    constexpr unsigned KBYTES = KM_KEYS * ST * 2;
    const int my_key = threadIdx.x / CH, bs_shift = __ffs(block_size) - 1;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int j = kb + my_key + p * KPP;
        const unsigned short* src = cache;
        int bytes = 0;
        if (j < k1) {
            const int bi = j >> bs_shift;
            src = my_src + table[bi] * blk_stride + (size_t)(j - bi * block_size) * HD;
            bytes = 16;
        }
        cp_async16_at(at + p * KPP * ST * 2, src, bytes);
        cp_async16_at(at + KBYTES + p * KPP * ST * 2, bytes ? src + half : cache, bytes);
    }
}

// A tile's stand-in use: one shared load a thread from the stage at `at`, then `spin`
// clock cycles (for a tile's MMAs and softmax).
__device__ __forceinline__ void km_lab_use(unsigned at, int spin, unsigned& acc) {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(at + threadIdx.x * 4));
    acc ^= v;
    if (spin > 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < spin) acc += 1;
    }
}

// The keys-on-M kernel's tile loads alone (twenty-eighth session): its grid, its three
// stages of padded 64-key K and V tiles (two blocks per SM), its cp.async pattern (a
// thread keeps one 16-byte column and steps over keys, a block-table read per key) and its
// wait and barrier per tile, but no arithmetic: each tile is touched by one shared load per
// thread, then the block spins `spin` clock cycles (a stand-in for a tile's MMAs and
// softmax) before the next. What the load structure reaches, and how a tile's work adds.
template <int STAGES>
__global__ void __launch_bounds__(128) km_loads(const unsigned short* cache, long long half, const int* tiles,
                                                const unsigned int* tables, int n_kv, int block_size, int spin,
                                                unsigned* sink) {
    constexpr int HD = 128, CH = HD / 8, ST = HD + 8;
    constexpr unsigned STAGE_BYTES = 2 * KM_KEYS * ST * 2;
    extern __shared__ __align__(16) unsigned char km_lab_smem[];
    const unsigned base = smem_u32(km_lab_smem);
    const int* tile = tiles + 4 * blockIdx.x;
    const unsigned int* table = tables + tile[3];
    const int k1 = tile[2] + 1, kvh = blockIdx.y;
    const int my_c = (threadIdx.x % CH) * 8, my_key = threadIdx.x / CH;
    const unsigned short* my_src = cache + (size_t)kvh * block_size * HD + my_c;
    const size_t blk_stride = (size_t)n_kv * block_size * HD;
    auto load_tile = [&](int kb, int st) {
        if (kb < k1) {
            const unsigned at = base + st * STAGE_BYTES + (my_key * ST + my_c) * 2;
            km_lab_copies(at, cache, half, my_src, table, blk_stride, block_size, kb, k1);
        }
        cp_async_commit();
    };
    const int ntiles = (k1 + KM_KEYS - 1) / KM_KEYS;
#ifdef KM_STAMPS
    constexpr int flags = 0;  // KM_STAMP's launch bit (one launch a layer here)
#endif
    KM_STAMP(0);
    for (int i = 0; i < STAGES - 1; i++) load_tile(i * KM_KEYS, i);
    KM_STAMP(1);  // (no wait and no q here: 1 to 3 is the loop's start)
    KM_STAMP(2);
    KM_STAMP(3);
    unsigned acc = 0;
    for (int i = 0; i < ntiles; i++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_tile((i + STAGES - 1) * KM_KEYS, (i + STAGES - 1) % STAGES);
        km_lab_use(base + (i % STAGES) * STAGE_BYTES, spin, acc);
    }
    KM_STAMP(4);
    if (acc == 0x9e3779b9u) sink[0] = acc;
    KM_STAMP(6);
}

// The same loads taken as work (sixty-ninth session): a resident grid (as many blocks as
// fit) whose blocks take units from a counter as they free up, a unit being one (sequence,
// KV head) item's keys from `chunk` * cut on (`cuts` an item); the ring runs on from one
// unit into the next. Thread 0 claims a block's units ahead, so a claim's round trip hides
// behind a unit's tiles: the n-th unit the block starts is the one in next_unit[n % 4].
// Slots 0 and 1 are written before the first barrier (the first loads may start two units);
// after that a load starts at most one unit, so before each tile's barrier thread 0 writes
// the slot after the next one to be read (the claim it made at the last write), and a slot
// is written again only three barriers or more after its read. `taken[block]`: the units
// it took; the last block to leave resets the counter for the next launch. Equal blocks of a fixed grid
// end unequally (an SM served faster, 16 of 264 slots without a second block); with units
// taken, a block on a fast SM takes more. What that is worth to the loads alone.
template <int STAGES>
__global__ void __launch_bounds__(128) km_loads_taken(const unsigned short* cache, long long half, const int* tiles,
                                                      const unsigned int* tables, int n_kv, int block_size, int spin,
                                                      unsigned* sink, unsigned* counter, int n_items, int cuts, int chunk,
                                                      unsigned* taken) {
    constexpr int HD = 128, CH = HD / 8, ST = HD + 8;
    constexpr unsigned STAGE_BYTES = 2 * KM_KEYS * ST * 2;
    extern __shared__ __align__(16) unsigned char km_lab_smem[];
    __shared__ unsigned next_unit[4];
    const unsigned base = smem_u32(km_lab_smem);
    const int my_c = (threadIdx.x % CH) * 8, my_key = threadIdx.x / CH;
    const size_t blk_stride = (size_t)n_kv * block_size * HD;
    const unsigned n_units = (unsigned)n_items * cuts;
#ifdef KM_STAMPS
    constexpr int flags = 0;
#endif
    KM_STAMP(0);
    unsigned pend = 0;  // thread 0: the unit claimed for the next slot written
    if (threadIdx.x == 0) {
        next_unit[0] = atomicAdd(counter, 1u);
        next_unit[1] = atomicAdd(counter, 1u);
        pend = atomicAdd(counter, 1u);
    }
    __syncthreads();
    // The load cursor, the same in every thread: unit lu's keys [lkb, lk1).
    unsigned lu = n_units;
    int lkb = 0, lk1 = 0, bnd = 0, written = 2, loaded = 0, units = 0;  // units started, slots written
    const unsigned int* table = tables;
    const unsigned short* my_src = cache;
    auto start_unit = [&](unsigned u) {
        lu = u;
        if (u >= n_units) return;
        const int item = u / cuts, cut = u % cuts;
        const int* tile = tiles + 4 * (item / n_kv);
        lkb = cut * chunk;
        lk1 = min(tile[2] + 1, lkb + chunk);
        table = tables + tile[3];
        my_src = cache + (size_t)(item % n_kv) * block_size * HD + my_c;
        units++;
    };
    auto load_next = [&](int st) {
        if (lu < n_units && lkb >= lk1) start_unit(next_unit[bnd++ % 4]);
        if (lu < n_units) {
            const unsigned at = base + st * STAGE_BYTES + (my_key * ST + my_c) * 2;
            km_lab_copies(at, cache, half, my_src, table, blk_stride, block_size, lkb, lk1);
            lkb += KM_KEYS, loaded++;
        }
        cp_async_commit();
    };
    start_unit(next_unit[bnd++]);
    for (int i = 0; i < STAGES - 1; i++) load_next(i);
    KM_STAMP(1);
    KM_STAMP(2);
    KM_STAMP(3);
    unsigned acc = 0;
    for (int i = 0; i < loaded; i++) {
        if (lu < n_units && written < bnd + 2) {
            if (threadIdx.x == 0) next_unit[written % 4] = pend, pend = atomicAdd(counter, 1u);
            written++;
        }
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_next((i + STAGES - 1) % STAGES);
        km_lab_use(base + (i % STAGES) * STAGE_BYTES, spin, acc);
    }
    KM_STAMP(4);
    if (acc == 0x9e3779b9u) sink[0] = acc;
    if (threadIdx.x == 0) {
        taken[blockIdx.x] = units;
        __threadfence();
        if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) counter[0] = 0, counter[1] = 0;
    }
    KM_STAMP(6);
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

// A list of numbers from the environment ("1 4 16"), each clamped to [lo, hi]; `dflt` unset.
static std::vector<int> env_list(const char* name, std::vector<int> dflt, long lo, long hi) {
    const char* e = getenv(name);
    if (!e) return dflt;
    std::vector<int> v;
    for (const char* p = e; *p;) { char* q; long x = strtol(p, &q, 10); if (q == p) break; v.push_back((int)std::min(std::max(x, lo), hi)); p = q; }
    return v;
}

// Built with -DKM_STAMPS (`decodelab_st`): after each timing, the last launch's blocks as
// a timeline from their stamps (entry 0, tile loop done 4, exit 6; ops.cu KM_STAMP), µs
// from the first block's entry: the span; entries and exits at quantiles; a block's median
// time in its loop and after it; how many blocks are alive at each tenth of the span; the
// ramp (until the alive count first reaches 90% of its peak) and the tail (from its last
// fall below 90% of the peak to the end). So the launch's time splits into its blocks'
// start, steady state and end.
static void timeline(int nb) {
#ifdef KM_STAMPS
    static unsigned long long ks[KM_STAMP_ROWS][8];
    CK(cudaMemcpyFromSymbol(ks, km_stamps, sizeof(ks)));
    nb = std::min(nb, KM_STAMP_ROWS / 2);
    unsigned long long t0 = ~0ull, t1 = 0;
    for (int b = 0; b < nb; b++) t0 = std::min(t0, ks[b][0]), t1 = std::max(t1, ks[b][6]);
    auto rel = [&](unsigned long long t) { return ((long long)t - (long long)t0) / 1000.0; };
    std::vector<double> in, out, loop, end;
    for (int b = 0; b < nb; b++) {
        in.push_back(rel(ks[b][0])), out.push_back(rel(ks[b][6]));
        loop.push_back((double)(ks[b][4] - ks[b][0]) / 1000.0), end.push_back((double)(ks[b][6] - ks[b][4]) / 1000.0);
    }
    for (auto* v : {&in, &out, &loop, &end}) std::sort(v->begin(), v->end());
    auto q = [&](const std::vector<double>& v, double f) { return v[std::min(v.size() - 1, (size_t)(f * v.size()))]; };
    const double span = rel(t1);
    // Blocks alive at t: entered by t less exited by t (from the sorted entries and exits).
    auto alive = [&](double t) {
        return (int)((std::upper_bound(in.begin(), in.end(), t) - in.begin()) -
                     (std::upper_bound(out.begin(), out.end(), t) - out.begin()));
    };
    // The alive count on a 0.1 µs grid: its peak, the ramp and the tail.
    std::vector<int> a;
    for (double t = 0; t < span; t += 0.1) a.push_back(alive(t));
    const int peak = a.empty() ? 0 : *std::max_element(a.begin(), a.end());
    size_t ramp = 0, tail = a.size();
    while (ramp < a.size() && a[ramp] < 0.9 * peak) ramp++;
    while (tail > 0 && a[tail - 1] < 0.9 * peak) tail--;
    printf("    timeline, %d blocks: span %.2f us; entries 0/50/90/100%%: %.2f %.2f %.2f %.2f; exits 0/10/50/90/100%%: "
           "%.2f %.2f %.2f %.2f %.2f\n", nb, span, q(in, 0), q(in, 0.5), q(in, 0.9), in.back(), out.front(), q(out, 0.1),
           q(out, 0.5), q(out, 0.9), out.back());
    printf("    a block (median): entry to loop done %.2f us, loop done to exit %.2f; peak %d alive, ramp %.1f us, tail %.1f "
           "us; alive at tenths:", q(loop, 0.5), q(end, 0.5), peak, ramp * 0.1, (a.size() - tail) * 0.1);
    for (int i = 1; i < 10; i++) printf(" %d", alive(span * i / 10));
    printf("\n");
    // The phases between consecutive stamps (entry 0, early tiles asked 1, the wait for the
    // kernel before 2, q packed 3, loop done 4, parts merged 5, exit 6), over the blocks
    // that wrote both ends in this launch (a stamp outside the block's entry..exit is an
    // earlier launch's, or one this kernel never writes): median and 90%, µs. So a block's
    // start splits into its setup, its wait and q's round trip.
    printf("    phases (median/90%%, us):");
    for (int i = 0; i < 6; i++) {
        std::vector<double> d;
        for (int b = 0; b < nb; b++) {
            const unsigned long long* r = ks[b];
            if (r[i] >= r[0] && r[i + 1] >= r[i] && r[i + 1] <= r[6]) d.push_back((double)(r[i + 1] - r[i]) / 1000.0);
        }
        std::sort(d.begin(), d.end());
        if (d.empty()) printf(" %d-%d -", i, i + 1);
        else printf(" %d-%d %.2f/%.2f", i, i + 1, q(d, 0.5), q(d, 0.9));
    }
    printf("\n");
    // By SM (column 7): its blocks and its last exit. The blocks are equal work here, so an
    // SM's blocks over its last exit is its rate; a spread of rates says the SMs are served
    // unequally, a spread of counts that the launch gave them unequal shares.
    std::map<unsigned long long, std::pair<int, double>> sm;
    for (int b = 0; b < nb; b++) {
        auto& e = sm[ks[b][7]];
        e.first++, e.second = std::max(e.second, rel(ks[b][6]));
    }
    std::vector<double> last, rate;
    int cmin = nb, cmax = 0;
    for (auto& [id, e] : sm) {
        last.push_back(e.second), rate.push_back(e.first / e.second);
        cmin = std::min(cmin, e.first), cmax = std::max(cmax, e.first);
    }
    std::sort(last.begin(), last.end());
    std::sort(rate.begin(), rate.end());
    printf("    by SM: %zu SMs, %d-%d blocks each; last exit 0/10/50/90/100%%: %.2f %.2f %.2f %.2f %.2f us; blocks a us "
           "0/50/100%%: %.3f %.3f %.3f\n", sm.size(), cmin, cmax, last.front(), q(last, 0.1), q(last, 0.5), q(last, 0.9),
           last.back(), rate.front(), q(rate, 0.5), rate.back());
#else
    (void)nb;
#endif
}

typedef void (*AttnFn)(const float*, const unsigned short*, long long, const int*, const unsigned int*, int, int, int,
                       float, const int*, float*, float*, int);

int main(int argc, char** argv) {
    const int B = argc > 1 ? atoi(argv[1]) : 64, CTX = argc > 2 ? atoi(argv[2]) : 1024;
    // KM_ONLY="stages bulk splits": that keys-on-M run alone (for Nsight Compute).
    int only[3] = {0, 0, 0};
    const bool one = getenv("KM_ONLY") && sscanf(getenv("KM_ONLY"), "%d %d %d", &only[0], &only[1], &only[2]) == 3;
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
    // Tiles and block tables: each sequence's blocks a shuffled slice of the cache (with
    // DL_SEQ_TABLES=1 in order, as a fresh engine's allocator hands them out).
    std::vector<int> tiles(4 * B);
    std::vector<unsigned> tables(blocks);
    for (int i = 0; i < blocks; i++) tables[i] = i;
    if (!getenv("DL_SEQ_TABLES")) { unsigned s = 9; for (int i = blocks - 1; i > 0; i--) { s = s * 1664525u + 1013904223u; std::swap(tables[i], tables[(s >> 8) % (i + 1)]); } }
    for (int b = 0; b < B; b++) tiles[4 * b] = b, tiles[4 * b + 1] = 1, tiles[4 * b + 2] = CTX - 1, tiles[4 * b + 3] = b * nb;
    int *dtiles, *dmax; unsigned* dtables;
    CK(cudaMalloc(&dtiles, tiles.size() * 4)); CK(cudaMalloc(&dtables, tables.size() * 4)); CK(cudaMalloc(&dmax, 4));
    CK(cudaMemcpy(dtiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dtables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dmax, &CTX, 4, cudaMemcpyHostToDevice));
    if (getenv("DL_ROPE")) {
        std::vector<float> f(HD / 2);
        for (int j = 0; j < HD / 2; j++) f[j] = (float)pow(500000.0, -2.0 * j / HD);
        std::vector<long long> sl(B);
        for (int b = 0; b < B; b++) sl[b] = (long long)tables[b * nb + (CTX - 1) / BS] * BS + (CTX - 1) % BS;
        float* df; long long* ds;
        CK(cudaMalloc(&df, f.size() * 4)); CK(cudaMalloc(&ds, sl.size() * 8));
        CK(cudaMemcpy(df, f.data(), f.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ds, sl.data(), sl.size() * 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpyToSymbol(lab_inv_freq, &df, sizeof df)); CK(cudaMemcpyToSymbol(lab_slots, &ds, sizeof ds));
    }
    const size_t on = (size_t)B * NH * HD;
    // DL_SPLITS="1 4 33": the split counts to time (at most 64; default 1 2 3 4 8 16).
    const std::vector<int> SPLITS = env_list("DL_SPLITS", {1, 2, 3, 4, 8, 16}, 1, 64);
    float *out, *ref, *part; CK(cudaMalloc(&out, on * 4)); CK(cudaMalloc(&ref, on * 4)); CK(cudaMalloc(&part, on / HD * 64 * (HD + 2) * 4));
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
    // KM_LOADS=1: the keys-on-M kernel's loads alone (km_loads), the engine's kernel
    // beside them, then exit.
    if (getenv("KM_LOADS")) {
        unsigned* sink; CK(cudaMalloc(&sink, 4));
        const int smem = KM_SMEM_BYTES(128, 3);
        CK(cudaFuncSetAttribute(km_loads<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CK(cudaFuncSetAttribute(decode_km_f16_d128<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        // km_loads_taken's resident grid, its counter (reset by each launch's last block) and
        // the units each block took.
        int per_sm = 0, sms = 0;
        CK(cudaFuncSetAttribute(km_loads_taken<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, km_loads_taken<3>, 128, smem));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const int grid = per_sm * sms;
        unsigned *counter, *taken;
        CK(cudaMalloc(&counter, 8)); CK(cudaMemset(counter, 0, 8));
        CK(cudaMalloc(&taken, grid * 4));
        for (int round = 0; round < 2; round++) {
            auto g = [&]() { decode_km_f16_d128<3><<<dim3(B, NKV, 1), 128, smem, st>>>(qkv, cache, half, dtiles, dtables, NH, NKV, BS, scale, dmax, out, part, 0); };
            g(); CK(cudaStreamSynchronize(st));
            report("keys-on-M 3 st (engine)", 1, time(g), err());
            timeline(B * NKV);
            for (int spin : {0, 250, 500, 1000, 2000}) {
                auto f = [&]() { km_loads<3><<<dim3(B, NKV), 128, smem, st>>>(cache, half, dtiles, dtables, NKV, BS, spin, sink); };
                f(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
                char name[64]; snprintf(name, sizeof name, "loads alone, spin %d", spin);
                report(name, 1, time(f), 0.0);
                timeline(B * NKV);
            }
            // The loads taken as work (km_loads_taken): a resident grid, units of 1/cuts of
            // an item (DL_TAKEN_CUTS, default 1 2 4), with no spin and with 2,000 cycles.
            for (int spin : {0, 2000})
                for (int cuts : env_list("DL_TAKEN_CUTS", {1, 2, 4}, 1, 64)) {
                    const int chunk = std::max(2, (CTX + cuts * KM_KEYS - 1) / (cuts * KM_KEYS)) * KM_KEYS;
                    const int ncut = (CTX + chunk - 1) / chunk;
                    auto f = [&]() {
                        km_loads_taken<3><<<grid, 128, smem, st>>>(cache, half, dtiles, dtables, NKV, BS, spin, sink,
                                                                   counter, B * NKV, ncut, chunk, taken);
                    };
                    f(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
                    char name[64]; snprintf(name, sizeof name, "taken, %d cuts, spin %d", ncut, spin);
                    report(name, 1, time(f), 0.0);
                    std::vector<unsigned> t(grid);
                    CK(cudaMemcpy(t.data(), taken, grid * 4, cudaMemcpyDeviceToHost));
                    unsigned sum = 0; for (unsigned x : t) sum += x;
                    std::sort(t.begin(), t.end());
                    printf("    %d blocks (%d a SM) took %u units of %d keys (of %d): fewest %u, median %u, most %u%s\n", grid,
                           per_sm, sum, chunk, B * NKV * ncut, t.front(), t[grid / 2], t.back(),
                           sum == (unsigned)(B * NKV * ncut) ? "" : " BAD");
                    timeline(grid);
                }
        }
        return 0;
    }
    // A keys-on-M kernel `k` (with `smem` bytes, flags `kf`) in `sp` splits (+ the merge):
    // checked against the reference, then timed.
    auto run_km = [&](AttnFn k, int smem, int kf, int sp, const char* name) {
        auto f = [&]() {
            k<<<dim3(B, NKV, sp), 128, smem, st>>>(qkv, cache, half, dtiles, dtables, NH, NKV, BS, scale, dmax, out, part, kf);
            if (sp > 1) attention_merge<<<dim3(B, NH), 128, 0, st>>>(part, sp, NH, HD, out, 0);
        };
        CK(cudaMemset(out, 0, on * 4));
        f(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
        const double e = err();
        report(name, sp, time(f), e);
        timeline(B * NKV * sp);
    };
    // DL_KM_LAB="0 1 2 4 5": the keys-on-M kernel at 3 stages in those lab forms (bits of
    // KM_LAB_* in ops.cu; 0 the engine's), with DL_KM_FLAGS, at each of DL_SPLITS; then exit.
    const int kmf = getenv("DL_KM_FLAGS") ? atoi(getenv("DL_KM_FLAGS")) : 0;  // DL_KM_FLAGS (default none)
    if (getenv("DL_KM_LAB")) {
        AttnFn labk[8] = {decode_km_f16_d128<3, 0>, decode_km_f16_d128<3, 1>, decode_km_f16_d128<3, 2>,
                          decode_km_f16_d128<3, 3>, decode_km_f16_d128<3, 4>, decode_km_f16_d128<3, 5>,
                          decode_km_f16_d128<3, 6>, decode_km_f16_d128<3, 7>};
        const int smem = KM_SMEM_BYTES(128, 3);
        std::map<int, std::vector<unsigned>> firsts;
        for (int lab : env_list("DL_KM_LAB", {0}, 0, 7)) {
            CK(cudaFuncSetAttribute(labk[lab], cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            char name[64]; snprintf(name, sizeof name, "keys-on-M 3 st lab %d", lab);
            for (int sp : SPLITS) {
                run_km(labk[lab], smem, kmf, sp, name);
                // Each split count's outputs against the first form's, bit for bit (with
                // FLASH_ROPE or FLASH_OUT_BF16 the f32 reference does not apply).
                std::vector<unsigned> cur(on);
                CK(cudaMemcpy(cur.data(), out, on * 4, cudaMemcpyDeviceToHost));
                auto& f = firsts[sp];
                if (f.empty()) { f = cur; continue; }
                size_t nd = 0; for (size_t i = 0; i < on; i++) nd += cur[i] != f[i];
                printf("    %zu of %zu outputs differ from the first form's\n", nd, on);
            }
        }
        return 0;
    }
    // DL_ENGINE_ONLY=1: the engine's keys-on-M form alone (3 stages, cp.async).
    const bool eng_only = getenv("DL_ENGINE_ONLY") != nullptr;
    // The engine's kernel.
    AttnFn eng = flash_decode_sa_f16_d128;
    CK(cudaFuncSetAttribute(eng, cudaFuncAttributeMaxDynamicSharedMemorySize, FA_SMEM_BYTES(128)));
    for (int sp : SPLITS) {
        if (one || eng_only || getenv("DL_NO_SA")) break;
        auto f = [&]() {
            eng<<<dim3(B, NKV, sp), 128, FA_SMEM_BYTES(128), st>>>(qkv, cache, half, dtiles, dtables, NH, NKV, BS, scale, dmax, out, part, flags);
            if (sp > 1) attention_merge<<<dim3(B, NH), 128, 0, st>>>(part, sp, NH, HD, out, 0);
        };
        CK(cudaMemset(out, 0, on * 4));
        f(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
        const double e = err();
        report("engine flash_decode_sa", sp, time(f), e);
    }
    // The bytes of K and V copied device to device: the card's copy rate on this run.
    if (!one) {
        unsigned short* dst; CK(cudaMalloc(&dst, 2 * half * 2));
        auto f = [&]() { CK(cudaMemcpyAsync(dst, cache, 2 * half * 2, cudaMemcpyDeviceToDevice, st)); };
        const float us = time(f);
        printf("  copy of the cache (read + write %.2f GB): %8.2f us  %6.0f GB/s (read %.0f)\n", 4.0 * half / 1e9, us,
               4.0 * half * 2 / us / 1e3, 4.0 * half / us / 1e3);
        CK(cudaFree(dst));
    }
    // Keys on M, 2–6 stages (default 2–4), tiles by cp.async and by bulk copies (FLASH_BULK).
    AttnFn km[5] = {decode_km_f16_d128<2>, decode_km_f16_d128<3>, decode_km_f16_d128<4>, decode_km_f16_d128<5>,
                    decode_km_f16_d128<6>};
    const std::vector<int> STAGES = env_list("DL_STAGES", {2, 3, 4}, 2, 6);
    for (int si = 0; si < 5; si++)
    for (int kf : {kmf, kmf | FLASH_BULK}) {
        if (std::find(STAGES.begin(), STAGES.end(), si + 2) == STAGES.end()) continue;
        if ((kf & FLASH_BULK) && (getenv("DL_NO_BULK") || (kmf & FLASH_BULK))) continue;
        if (eng_only && (si != 1 || kf != kmf)) continue;
        const int smem = KM_SMEM_BYTES(128, si + 2);
        CK(cudaFuncSetAttribute(km[si], cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int occ = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, km[si], 128, smem));
        char name[64]; snprintf(name, sizeof name, "keys-on-M %d st%s (%d/SM)", si + 2, (kf & FLASH_BULK) ? " bulk" : "", occ);
        for (int sp : SPLITS) {
            if (one && (only[0] != si + 2 || only[1] != ((kf & FLASH_BULK) != 0) || only[2] != sp)) continue;
            run_km(km[si], smem, kf, sp, name);
        }
    }
}
