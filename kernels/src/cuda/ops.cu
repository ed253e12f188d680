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
