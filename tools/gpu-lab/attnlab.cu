// Where a batch-1 decode attention's microseconds go (docs/PERF.md, fifty-first session).
// The CUPTI trace of the engine's replayed b1 step (tools/gpu-lab/kernel_trace.c) has the
// keys-on-M kernel adding ~11 µs per layer after the QKV GEMV ends, for 4.2 MB of KV;
// ~9 µs of it stay even when its older keys' tiles were loaded while the GEMV ran. This lab
// replays the engine's own kernels (ops.cu, compiled with KM_STAMPS so each block's
// thread 0 notes the GPU clock at points of the kernel) in the b1 step's order for 32
// layers of Llama-3-8B shapes: QKV GEMV with RoPE and the KV write
// (`gemv_pnorm_rope_u3_bf16_m1`) → attention (`flash_decode_km_f16_d128`, 9 splits of 128
// keys, one cluster per KV head, as the engine launches it at 1k context) → o GEMV with
// the residual and the next norm's inputs (`gemv_stats_u4_bf16_m1`), all programmatic
// launches in one CUDA graph. It prints µs per replay, then the last layer's stamps
// relative to the QKV GEMV's last block end.
// Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/attnlab.cu -o attnlab && ./attnlab [trigger [carveout [u2 [ilp [early [twice [batch [relaxed]]]]]]]]
//   trigger: the QKV GEMV's RopeKv::trigger (0 none, 1 at entry, 2 after its loop);
//   carveout: the QKV GEMV's preferred shared-memory carveout in percent (-1: the driver's);
//   u2: 1 for the QKV GEMV at two loads per row (`gemv_pnorm_rope_bf16_m1`, four blocks per
//   SM: room for an attention block beside three); ilp: 1 for FLASH_MERGE_ILP; early: 0 to
//   clear FLASH_EARLY (no tile asked for before the wait: do q's loads still take 3–4 µs?);
//   twice: 1 to launch the attention a second time in each layer (stamped apart), with its
//   code and metadata fresh in the caches; batch: 1 for FLASH_BATCH_LOADS (q's values and
//   the tiles' block-table entries loaded before their first use); relaxed: 1 for
//   FLASH_RELAXED_EXIT (the barrier after the cluster merge arrives without release).
// It also checks that the run's flags give the bits of the kernel without FLASH_MERGE_ILP,
// FLASH_BATCH_LOADS and FLASH_RELAXED_EXIT, with every split holding keys and with the
// last splits empty (max_ctx past the row's position).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define KM_STAMPS 1
#include "../../kernels/src/cuda/ops.cu"
#include "graph_time.h"

template <typename... K, typename... A>
static void launch(void (*kernel)(K...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, int cluster_z, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    int n = 1;
    if (cluster_z > 1) {
        at[1].id = cudaLaunchAttributeClusterDimension;
        at[1].val.clusterDim.x = 1;
        at[1].val.clusterDim.y = 1;
        at[1].val.clusterDim.z = cluster_z;
        n = 2;
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

int main(int argc, char** argv) {
    const int trigger = argc > 1 ? atoi(argv[1]) : 0;
    const int carveout = argc > 2 ? atoi(argv[2]) : -1;
    const bool u2 = argc > 3 && atoi(argv[3]) != 0, ilp = argc > 4 && atoi(argv[4]) != 0;
    const bool early = argc <= 5 || atoi(argv[5]) != 0;
    const bool twice = argc > 6 && atoi(argv[6]) != 0;
    const bool batch = argc > 7 && atoi(argv[7]) != 0, relaxed = argc > 8 && atoi(argv[8]) != 0;
    auto qkv_gemv = u2 ? gemv_pnorm_rope_bf16_m1 : gemv_pnorm_rope_u3_bf16_m1;
    const int L = 32, H = 4096, NH = 32, NKV = 8, HD = 128, QKV = (NH + 2 * NKV) * HD, BS = 16;
    const int POS = 1024, NBLK = POS / BS + 1, SPLITS = 9;
    const long long HALF = (long long)NBLK * NKV * BS * HD;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // Weights and caches per layer (L2 cold as in a step); one activation set.
    std::vector<unsigned short*> wqkv(L), wo(L), cache(L);
    for (int l = 0; l < L; l++) {
        CK(cudaMalloc(&wqkv[l], (size_t)QKV * H * 2));
        CK(cudaMalloc(&wo[l], (size_t)H * H * 2));
        CK(cudaMalloc(&cache[l], (size_t)2 * HALF * 2));
        fill_bf16<<<1024, 256, 0, st>>>(wqkv[l], (size_t)QKV * H, 11u + l, 0.02f);
        fill_bf16<<<1024, 256, 0, st>>>(wo[l], (size_t)H * H, 101u + l, 0.02f);
        // Small finite f16 keys and values: bf16 bits of values under 0.5 read as f16 (up to ~±1.75).
        fill_bf16<<<1024, 256, 0, st>>>(cache[l], (size_t)2 * HALF, 1001u + l, 0.5f);
    }
    float *xg, *parts, *g, *qkv, *attn, *resid, *part, *inv_freq;
    CK(cudaMalloc(&xg, H * 4));
    CK(cudaMalloc(&parts, H / NORM_SPAN * 4));
    CK(cudaMalloc(&g, H * 4));
    CK(cudaMalloc(&qkv, QKV * 4));
    CK(cudaMalloc(&attn, NH * HD * 4));
    CK(cudaMalloc(&resid, H * 4));
    CK(cudaMalloc(&part, 1 << 20));
    CK(cudaMalloc(&inv_freq, HD / 2 * 4));
    {
        std::vector<float> hx(H), hp(H / NORM_SPAN, (float)NORM_SPAN), hg(H, 1.f), hf(HD / 2);
        for (int i = 0; i < H; i++) hx[i] = 0.01f * ((i * 37) % 101 - 50);
        for (int j = 0; j < HD / 2; j++) hf[j] = powf(500000.f, -2.f * j / HD);
        CK(cudaMemcpy(xg, hx.data(), H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(resid, hx.data(), H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(parts, hp.data(), hp.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(g, hg.data(), H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(inv_freq, hf.data(), hf.size() * 4, cudaMemcpyHostToDevice));
    }
    int *pos, *tiles, *max_ctx;
    unsigned* tables;
    long long* slots;
    CK(cudaMalloc(&pos, 4));
    CK(cudaMalloc(&tiles, 16));
    CK(cudaMalloc(&max_ctx, 4));
    CK(cudaMalloc(&tables, NBLK * 4));
    CK(cudaMalloc(&slots, 8));
    {
        const int hpos = POS, hmax = POS + 1, ht[4] = {0, 1, POS, 0};
        const long long hs = POS;
        std::vector<unsigned> tb(NBLK);
        for (int i = 0; i < NBLK; i++) tb[i] = (unsigned)((i * 29) % NBLK);  // a shuffled pool
        // the row's own block where its slot says (slot POS → block POS / BS)
        std::swap(tb[POS / BS], *std::find(tb.begin(), tb.end(), (unsigned)(POS / BS)));
        CK(cudaMemcpy(pos, &hpos, 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(max_ctx, &hmax, 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(tiles, ht, 16, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(slots, &hs, 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(tables, tb.data(), NBLK * 4, cudaMemcpyHostToDevice));
    }
    const int km_smem = KM_SMEM_BYTES(128, KM_STAGES);
    CK(cudaFuncSetAttribute(flash_decode_km_f16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, km_smem));
    CK(cudaFuncSetAttribute(flash_decode_km_f16_d128, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    if (carveout >= 0)
        CK(cudaFuncSetAttribute(qkv_gemv, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
    const int flags = FLASH_LEAN_LOADS | FLASH_WIDE_MERGE | FLASH_MASK_EDGE | FLASH_PAIR_LOADS | FLASH_CLUSTER |
                      (early ? FLASH_EARLY : 0) | FLASH_LAZY_RESCALE | (ilp ? FLASH_MERGE_ILP : 0) |
                      (batch ? FLASH_BATCH_LOADS : 0) | (relaxed ? FLASH_RELAXED_EXIT : 0);
    const float eps = 1e-5f, scale = 1.f / sqrtf((float)HD);
    const int nq = QKV, nh = H, k = H, zero = 0, one = 1;
    // The attention over layer l's cache with flags f.
    auto attention = [&](int l, int f) {
        launch(flash_decode_km_f16_d128, dim3(1, NKV, SPLITS), dim3(128), km_smem, st, SPLITS, (const float*)qkv,
               (const unsigned short*)cache[l], HALF, (const int*)tiles, (const unsigned*)tables, NH, NKV, BS, scale,
               (const int*)max_ctx, attn, part, f, (const float*)inv_freq, (const long long*)slots, zero);
    };
    auto layer = [&](int l) {
        launch(qkv_gemv, dim3(QKV / 2 / GEMV_WARPS), dim3(GEMV_WARPS * 32), 0, st, 1,
               (const unsigned short*)wqkv[l], (const float*)xg, (const float*)parts, eps, nq, k, qkv, zero,
               (const int*)pos, (const float*)inv_freq, (const long long*)slots, NH, NKV, HD, zero, BS, cache[l],
               HALF, trigger);
        attention(l, flags);
        if (twice) attention(l, flags | (1 << 30));  // the same attention again, stamped apart
        launch(gemv_stats_u4_bf16_m1, dim3(H / 2 / GEMV_WARPS), dim3(GEMV_WARPS * 32), 0, st, 1,
               (const unsigned short*)wo[l], (const float*)attn, (const float*)nullptr, eps, nh, k, resid, one,
               (const float*)g, xg, parts);
    };
    CK(cudaStreamSynchronize(st));
    std::vector<float> us;
    for (int r = 0; r < 5; r++) us.push_back(graph_us(st, 1, [&](int) {
        for (int l = 0; l < L; l++) layer(l);
    }));
    CK(cudaStreamSynchronize(st));
    std::sort(us.begin(), us.end());
    printf("QKV %s, trigger %d, carveout %d, merge%s%s%s%s%s: %d layers of QKV -> attention -> o, us per replay: best %.1f, median %.1f "
           "(%.2f per layer)\n",
           u2 ? "u2" : "u3", trigger, carveout, ilp ? " ILP" : "", early ? "" : ", no early tiles",
           twice ? ", attention twice" : "", batch ? ", loads first" : "", relaxed ? ", relaxed exit" : "", L, us[0], us[2], us[2] / L);
    // The last replay's last layer.
    static unsigned long long ks[KM_STAMP_ROWS][8], gs[3][1024][2];
    CK(cudaMemcpyFromSymbol(ks, km_stamps, sizeof(ks)));
    CK(cudaMemcpyFromSymbol(gs, gemv_stamps, sizeof(gs)));
    const int qb = QKV / 2 / GEMV_WARPS, ob = H / 2 / GEMV_WARPS;
    unsigned long long q0 = ~0ull, q1 = 0, o0 = ~0ull, o1 = 0;
    for (int b = 0; b < qb; b++) q0 = std::min(q0, gs[EPI_ROPE][b][0]), q1 = std::max(q1, gs[EPI_ROPE][b][1]);
    for (int b = 0; b < ob; b++) o0 = std::min(o0, gs[EPI_STATS][b][0]), o1 = std::max(o1, gs[EPI_STATS][b][1]);
    auto rel = [&](unsigned long long t) { return ((long long)t - (long long)q1) / 1000.0; };
    printf("QKV GEMV: first block in %.2f us, last block out 0.00 (the reference); o GEMV: first block in %.2f, "
           "last out %.2f us\n", rel(q0), rel(o0), rel(o1));
    const char* what[7] = {"entry", "early tiles asked", "after pdl_wait", "q in registers", "tile loop done",
                           "warps merged", "cluster merged (exit)"};
    const int nb = NKV * SPLITS;
    printf("attention, %d blocks (us from the QKV GEMV's last block out): min / median / max; last split's median\n", nb);
    for (int set = 0; set < (twice ? 2 : 1); set++) {
        if (set) {
            // The second launch from the first's last block out.
            unsigned long long e = 0;
            for (int b = 0; b < nb; b++) e = std::max(e, ks[b][6]);
            q1 = e;
            printf("attention again (us from the first launch's last block out):\n");
        }
        for (int i = 0; i < 7; i++) {
            std::vector<double> v, last;
            for (int b = 0; b < nb; b++) {
                v.push_back(rel(ks[KM_STAMP_ROWS / 2 * set + b][i]));
                if (b / NKV == SPLITS - 1) last.push_back(rel(ks[KM_STAMP_ROWS / 2 * set + b][i]));
            }
            std::sort(v.begin(), v.end());
            std::sort(last.begin(), last.end());
            printf("  %-22s %8.2f %8.2f %8.2f   %8.2f\n", what[i], v.front(), v[v.size() / 2], v.back(),
                   last[last.size() / 2]);
        }
    }
    // The kernel with none of the merge's one round, the loads first and the relaxed exit,
    // and with this run's flags, on the last layer's inputs: the same bits, with the row's
    // own max_ctx (every split has keys) and with a longer one (the last splits have none).
    for (const int mc : {POS + 1, POS + 600}) {
        CK(cudaMemcpy(max_ctx, &mc, 4, cudaMemcpyHostToDevice));
        std::vector<unsigned> o[2];
        for (int v = 0; v < 2; v++) {
            attention(L - 1, v ? flags : flags & ~(FLASH_MERGE_ILP | FLASH_BATCH_LOADS | FLASH_RELAXED_EXIT));
            o[v].resize(NH * HD);
            CK(cudaMemcpyAsync(o[v].data(), attn, NH * HD * 4, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
        }
        int diff = 0, finite = 0;
        for (int i = 0; i < NH * HD; i++) {
            diff += o[0][i] != o[1][i];
            float f;
            memcpy(&f, &o[0][i], 4);
            finite += std::isfinite(f);
        }
        printf("attention without the merge's one round, loads first, relaxed exit against this run's flags, max_ctx %d: "
               "%d of %d outputs differ in bits (%d finite)\n", mc, diff, NH * HD, finite);
    }
    return 0;
}
