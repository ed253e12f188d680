// Shared by the gpu-lab programs (define CK first): µs per call of f(i), i = 0 … iter − 1,
// the calls captured in one CUDA graph on `st` and replayed, as the engine replays its
// decode steps. An uncaptured f(0) first checks that the kernels launch; one replay warms up.
// Also `bf16_device`: n pseudo-random bf16 values in (−scale, scale) on the device, and
// `fill_bf16`, a kernel that fills n of them in place from a hash of (index, seed).
#pragma once
#include <cstring>
#include <vector>

static unsigned short* bf16_device(size_t n, unsigned s, float scale) {
    std::vector<unsigned short> h(n);
    for (auto& v : h) { s = s * 1664525u + 1013904223u; float f = (((s >> 8) / 16777216.f) * 2 - 1) * scale; unsigned u; memcpy(&u, &f, 4); v = u >> 16; }
    unsigned short* d;
    CK(cudaMalloc(&d, n * 2));
    CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}
template <class F>
static float graph_us(cudaStream_t st, int iter, F f) {
    f(0);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < iter; i++) f(i);
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ge, gr, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(gr);
    return ms * 1e3f / iter;
}
__global__ void fill_bf16(unsigned short* w, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
        const float f = ((h >> 8) / 16777216.f * 2 - 1) * scale;
        w[i] = (unsigned short)(__float_as_uint(f) >> 16);
    }
}
