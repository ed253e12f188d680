// Batch-1 GEMV lab (issue 5, b1 ≤ 4.2 ms): where the engine's one-token GEMVs lose to a read of
// their weights. Each shape of a Llama-3-8B layer is timed alone (32 matrices of it, as the 32
// layers, replayed from one CUDA graph, L2 cold), with the engine's kernels (ops.cu) and with a
// bare kernel of the same per-warp arithmetic and no norm (`bare`):
//   plain   gemv_bf16_m1 (o and down add to the residual);
//   block   RMSNorm scale computed by the block before its first weight load (the engine's);
//   part    x already multiplied by the norm weight and the sums of x² per 16 elements given
//           (what the kernel that wrote x could leave): the loop of `plain`, the scale at the end.
// (A fifth way, each warp summing x² over the x it reads and scaling at the end, was
// measured between block and part — docs/PERF.md — and removed with its kernels.)
// Outputs of part are compared with block's (largest difference). Then the whole
// chain (QKV → o → gate/up → down, o reading QKV's first 4,096 outputs) with each norm.
// Not part of the build; on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/normlab.cu -o normlab && ./normlab
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#include "graph_time.h"
#include "../../kernels/src/cuda/ops.cu"

typedef void (*GemvFn)(const unsigned short*, const float*, const float*, float, int, int, float*, int);

// The bare kernel: a warp per two rows (kind 2: gate row p and up row p + pairs, SiLU·gate),
// 16-byte loads two steps deep, k a multiple of 512.
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) bare(const unsigned short* w, const float* in, float* out, int pairs, int k, int kind) {
    const int lane = threadIdx.x & 31, p = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (p >= pairs) return;
    const unsigned short* w0 = w + (size_t)(kind == 2 ? p : 2 * p) * k;
    const unsigned short* w1 = w + (size_t)(kind == 2 ? p + pairs : 2 * p + 1) * k;
    uint4 a[2], b[2];
    int k0 = lane * 8;
    a[0] = ld_stream_u4(w0 + k0), b[0] = ld_stream_u4(w1 + k0);
    a[1] = ld_stream_u4(w0 + k0 + 256), b[1] = ld_stream_u4(w1 + k0 + 256);
    float s0 = 0.f, s1 = 0.f;
    for (;; k0 += 512) {
        const bool more = k0 + 512 < k;
        uint4 an[2], bn[2];
        if (more) {
            an[0] = ld_stream_u4(w0 + k0 + 512), bn[0] = ld_stream_u4(w1 + k0 + 512);
            an[1] = ld_stream_u4(w0 + k0 + 768), bn[1] = ld_stream_u4(w1 + k0 + 768);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float v[8];
            const float4 x0 = *reinterpret_cast<const float4*>(in + k0 + 256 * u);
            const float4 x1 = *reinterpret_cast<const float4*>(in + k0 + 256 * u + 4);
            v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
            s0 += dot8_bf16(a[u], v);
            s1 += dot8_bf16(b[u], v);
        }
        if (!more) break;
        a[0] = an[0], a[1] = an[1], b[0] = bn[0], b[1] = bn[1];
    }
    for (int o = 16; o > 0; o >>= 1) s0 += __shfl_xor_sync(0xffffffffu, s0, o), s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    if (lane != 0) return;
    if (kind == 2) out[p] = silu_gate(s0, s1);
    else if (kind == 1) out[2 * p] += s0, out[2 * p + 1] += s1;
    else out[2 * p] = s0, out[2 * p + 1] = s1;
}

enum Way { BARE, PLAIN, BLOCK, PART };
const char* way_name[] = {"bare", "plain", "block", "part"};

int main() {
    const int L = 32, H = 4096, QKV = 6144, FF = 14336;
    int nsm;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    // Inputs: x (residual), nw (norm weight), xg = x · nw, the sums of x² per 16, an FF-wide input.
    std::vector<float> hx(FF), hg(H), hxg(H), hp(H / 16, 0.f);
    for (int i = 0; i < FF; i++) hx[i] = ((i * 37) % 101) / 50.f - 1;
    for (int i = 0; i < H; i++) hg[i] = 0.5f + ((i * 13) % 29) / 29.f, hxg[i] = hx[i] * hg[i], hp[i / 16] += hx[i] * hx[i];
    auto up = [](const std::vector<float>& h) { float* d; CK(cudaMalloc(&d, h.size() * 4)); CK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice)); return d; };
    float *x = up(hx), *nw = up(hg), *xg = up(hxg), *parts = up(hp), *qkv, *act, *res;
    CK(cudaMalloc(&qkv, QKV * 4));
    CK(cudaMalloc(&act, FF * 4));
    CK(cudaMalloc(&res, H * 4));
    struct Shape { const char* name; int rows, k, kind; };  // kind: 0 write, 1 add, 2 SiLU·gate
    const Shape shapes[4] = {{"QKV 6144x4096", QKV, H, 0}, {"o 4096x4096 +", H, H, 1}, {"gate/up 28672x4096", 2 * FF, H, 2}, {"down 4096x14336 +", H, FF, 1}};
    std::vector<unsigned short*> w[4];
    size_t sbytes[4];
    for (int s = 0; s < 4; s++) {
        sbytes[s] = (size_t)shapes[s].rows * shapes[s].k * 2;
        for (int l = 0; l < L; l++) {
            unsigned short* p;
            CK(cudaMalloc(&p, sbytes[s]));
            fill_bf16<<<4 * nsm, 256>>>(p, sbytes[s] / 2, 1000u * l + s, 1.f / sqrtf((float)shapes[s].k));
            w[s].push_back(p);
        }
    }
    CK(cudaDeviceSynchronize());
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    unsigned* sink;
    CK(cudaMalloc(&sink, 4));
    // One launch of shape s, layer l, the given way; `in` the input of the no-norm ways.
    auto launch = [&](int s, int l, Way way, const float* in, float* out) {
        const Shape& sh = shapes[s];
        const int pairs = sh.kind == 2 ? FF : sh.rows / 2, n_out = sh.kind == 2 ? FF : sh.rows;
        const dim3 grid((pairs + GEMV_WARPS - 1) / GEMV_WARPS), block(GEMV_WARPS * 32);
        if (way == BARE) { bare<<<grid, block, 0, st>>>(w[s][l], in, out, pairs, sh.k, sh.kind); return; }
        GemvFn f = nullptr;
        const float *xi = in, *ni = nw;
        const bool silu = sh.kind == 2;
        switch (way) {
            case PLAIN: f = gemv_bf16_m1; break;
            case BLOCK: f = silu ? gemv_norm_silu_bf16_m1 : gemv_norm_bf16_m1; xi = x; break;
            case PART: f = silu ? gemv_pnorm_silu_bf16_m1 : gemv_pnorm_bf16_m1; xi = xg; ni = parts; break;
            default: break;
        }
        f<<<grid, block, 0, st>>>(w[s][l], xi, ni, 1e-5f, n_out, sh.k, out, sh.kind == 1);
    };
    // Per shape: the ways that apply (norm ways only where the engine normalises: QKV, gate/up).
    std::vector<Way> ways[4] = {{BARE, PLAIN, BLOCK, PART}, {BARE, PLAIN}, {BARE, BLOCK, PART}, {BARE, PLAIN}};
    for (int s = 0; s < 4; s++) {
        const Shape& sh = shapes[s];
        const int n_out = sh.kind == 2 ? FF : sh.rows;
        float* out = sh.kind == 0 ? qkv : sh.kind == 2 ? act : res;
        const float* in = x;  // (down reads FF values of hx)
        // Exactness: part against block (norm shapes), on layer 0.
        if (s == 0 || s == 2) {
            std::vector<float> ref(n_out), got(n_out);
            launch(s, 0, BLOCK, in, out);
            CK(cudaMemcpy(ref.data(), out, n_out * 4, cudaMemcpyDeviceToHost));
            for (Way v : {PART}) {
                launch(s, 0, v, in, out);
                CK(cudaMemcpy(got.data(), out, n_out * 4, cudaMemcpyDeviceToHost));
                double md = 0, mx = 0;
                for (int i = 0; i < n_out; i++) md = std::max(md, (double)fabsf(ref[i] - got[i])), mx = std::max(mx, (double)fabsf(ref[i]));
                printf("%s %s vs block: largest difference %.3e (largest |value| %.3e)\n", sh.name, way_name[v], md, mx);
            }
        }
        float us[4] = {1e30f, 1e30f, 1e30f, 1e30f};
        for (int r = 0; r < 4; r++)
            for (Way v : ways[s]) us[v] = std::min(us[v], graph_us(st, 1, [&](int) { for (int l = 0; l < L; l++) launch(s, l, v, in, out); }));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0, st));
        for (int l = 0; l < L; l++) stream_read<<<4 * nsm, 256, 0, st>>>(w[s][l], (long long)(sbytes[s] / 16), sink);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float rms;
        CK(cudaEventElapsedTime(&rms, e0, e1));
        const double gb = sbytes[s] * (double)L / 1e9;
        printf("%-20s %.2f GB:", sh.name, gb);
        for (Way v : ways[s]) printf("  %s %.1f us (%.0f GB/s)", way_name[v], us[v], gb / (us[v] * 1e-6));
        printf("  stream_read %.1f us (%.0f GB/s)\n", rms * 1e3f, gb / (rms * 1e-3));
    }
    // The whole chain, each norm way for QKV and gate/up (o, down plain).
    double total = 0;
    for (int s = 0; s < 4; s++) total += sbytes[s] * (double)L / 1e9;
    float cu[4] = {1e30f, 1e30f, 1e30f, 1e30f};
    for (int r = 0; r < 4; r++)
        for (Way v : {BARE, BLOCK, PART})
            cu[v] = std::min(cu[v], graph_us(st, 1, [&](int) {
                for (int l = 0; l < L; l++) {
                    launch(0, l, v, x, qkv);
                    launch(1, l, v == BARE ? BARE : PLAIN, qkv, res);
                    launch(2, l, v, x, act);
                    launch(3, l, v == BARE ? BARE : PLAIN, act, res);
                }
            }));
    printf("chain %.2f GB:", total);
    for (Way v : {BARE, BLOCK, PART}) printf("  %s %.1f us (%.0f GB/s)", way_name[v], cu[v], total / (cu[v] * 1e-6));
    printf("\n");
    return 0;
}
