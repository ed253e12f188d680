// Does a cuBLAS GEMM wait for the kernel before it when its graph edge is programmatic, and
// does that save time? (docs/PERF.md, seventy-first to seventy-third sessions.) The answer on
// an H100 with cuBLAS 13.1.0.3 (seventy-third session): no. The control read zeros, and each
// of the 39 GEMMs the probe could edge (all it tries at 9-128 tokens but the output head at
// 128, whose first node is a memset) ran an `nvjet_sm90_*` kernel whose output changed under
// the programmatic edge (an edge into a node that is not a kernel stays default and the probe
// says so); so the engine's opt-in switch (DISAGG_CUDA_GEMM_PDL) was removed.
//
// The engine's own kernels are launched with programmatic dependent launch (PDL) and wait
// for their inputs in their code (griddepcontrol.wait); cuBLAS launches its GEMMs with no
// such attribute, so in a captured step every GEMM starts only after the kernel before it
// has ended and flushed. This lab:
// 1. says how cuBLAS's kernel came into the graph: the captured edge from the kernel before
//    it, default or programmatic;
// 2. probe: a one-block kernel that lets its dependents launch at once
//    (griddepcontrol.launch_dependents), then spins ~50 µs, then writes the GEMM's input;
//    with the edge made programmatic, the GEMM's output is right only if the GEMM waits
//    (griddepcontrol.wait) before its loads, or did not start until the writer ended. The
//    control: the same with a kernel that does not wait in the GEMM's place, which must
//    read zeros (else the edge did not let it start early, and the probe shows nothing);
//    both report when they started against the writer's end (%globaltimer);
// 3. times L layers of [prep → QKV GEMM → prep → o → prep → gate/up → prep → down] at M
//    tokens (Llama-3-8B shapes, every layer its own weights), the prep kernels launched with
//    PDL as the engine's are, with the edges into the GEMMs default or programmatic (the
//    programmatic side is unsound wherever the probe's GEMMs differ: its times are not a gain).
//
//   bash tools/gpu-lab/nvcc.sh -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/gemmpdl.cu \
//     -I$CUBLAS/include -I$CCCL/include -L$CUBLAS/lib -l:libcublas.so.13 -o .gpu3/gemmpdl
// (CUBLAS, CCCL: nvidia/cu13 of the PyPI wheels nvidia-cublas 13.0.* and nvidia-cuda-cccl,
// unpacked; on the device, LD_LIBRARY_PATH to its CUDA's libcublas.so.13.)
//   ./gemmpdl probe                                  (the control, then each GEMM the engine
//                                                     captures at 9-128 tokens)
//   ./gemmpdl [M=64] [LAYERS=32] [REPLAYS=20] [ROUNDS=3]  (the timed chain)
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e_ = (x);                                                                 \
        if (e_ != cudaSuccess) {                                                              \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));         \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)
#define CB(x)                                                                                 \
    do {                                                                                      \
        cublasStatus_t s_ = (x);                                                              \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            printf("%s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, (int)s_);          \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * scale);
    }
}

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// Lets its dependents launch at once, spins, then writes x; stamps its end.
__global__ void writer(__nv_bfloat16* x, int n, float v, long long spin, unsigned long long* stamp) {
    asm volatile("griddepcontrol.launch_dependents;");
    long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = __float2bfloat16(v);
    __syncthreads();
    if (threadIdx.x == 0) stamp[0] = now_ns();
}

// The control: reads x with no wait; counts the zeros it saw and stamps its start.
__global__ void reader(const __nv_bfloat16* x, int n, unsigned* zeros, unsigned long long* stamp) {
    if (blockIdx.x == 0 && threadIdx.x == 0) stamp[1] = now_ns();
    unsigned z = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        z += __bfloat162float(x[i]) == 0.f;
    atomicAdd(zeros, z);
}

// Between two GEMMs, as the engine's norm and SiLU kernels: waits for the GEMM before it,
// then makes the next GEMM's bf16 input from its f32 output.
__global__ void prep(const float* y, int ny, __nv_bfloat16* x, int nx) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nx; i += gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(y[i % ny] * 0.01f);
}

static cublasHandle_t blas;
static cudaStream_t st;

// y (M × rows, f32, or bf16 in y's first bytes) (+)= x (M × cols, bf16) · Wᵀ, W rows × cols
// bf16 row-major: the engine's call (gemm_bf16_scratch_to).
static void gemm(const __nv_bfloat16* w, int rows, int cols, const __nv_bfloat16* x, int m, float* y,
                 float beta = 0.f, bool bf16_out = false) {
    const float alpha = 1.f;
    CB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, m, cols, &alpha, w, CUDA_R_16BF, cols, x, CUDA_R_16BF, cols,
                    &beta, y, bf16_out ? CUDA_R_16BF : CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The engine's split-K form (residual_gemm): `splits` slices of K into f32 partials, slice s
// at s · m · rows.
static void gemm_split(const __nv_bfloat16* w, int rows, int cols, const __nv_bfloat16* x, int m, float* y,
                       int splits) {
    const float alpha = 1.f, beta = 0.f;
    const int kc = cols / splits;
    CB(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, m, kc, &alpha, w, CUDA_R_16BF, cols, kc, x,
                                  CUDA_R_16BF, cols, kc, &beta, y, CUDA_R_32F, rows, (long long)m * rows, splits,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

__global__ void fill_f32(float* p, size_t n, float v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = v + (float)(i % 7);
}

static void launch_pdl(void (*k)(const float*, int, __nv_bfloat16*, int), const float* y, int ny, __nv_bfloat16* x,
                       int nx) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(132);
    cfg.blockDim = dim3(256);
    cfg.stream = st;
    cudaLaunchAttribute a[1];
    a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = a;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, k, y, ny, x, nx));
}

// The capture's current leaf node (the last launch's).
static cudaGraphNode_t leaf() {
    cudaStreamCaptureStatus s;
    const cudaGraphNode_t* deps = nullptr;
    size_t n = 0;
    CK(cudaStreamGetCaptureInfo(st, &s, nullptr, nullptr, &deps, nullptr, &n));
    if (n != 1) {
        printf("capture has %zu leaves\n", n);
        exit(1);
    }
    return deps[0];
}

// Every edge of g: from f[i] to t[i], with data d[i]; returns how many.
static size_t graph_edges(cudaGraph_t g, std::vector<cudaGraphNode_t>& f, std::vector<cudaGraphNode_t>& t,
                          std::vector<cudaGraphEdgeData>& d) {
    size_t n = 0;
    CK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
    f.resize(n), t.resize(n), d.resize(n);
    CK(cudaGraphGetEdges(g, f.data(), t.data(), d.data(), &n));
    return n;
}

// Every edge out of the nodes in `from`: how many are programmatic; with `make`, makes the
// default ones into kernels programmatic (how many: `made`). Returns the number of edges out
// of them.
static int edges_from(cudaGraph_t g, const std::vector<cudaGraphNode_t>& from, bool make, int* programmatic,
                      int* made) {
    std::vector<cudaGraphNode_t> f, t;
    std::vector<cudaGraphEdgeData> d;
    const size_t n = graph_edges(g, f, t, d);
    int out = 0;
    *programmatic = 0;
    *made = 0;
    for (size_t i = 0; i < n; i++) {
        bool ours = false;
        for (auto p : from) ours |= p == f[i];
        if (!ours) continue;
        out++;
        if (d[i].type == cudaGraphDependencyTypeProgrammatic) {
            (*programmatic)++;
            continue;
        }
        if (!make) continue;
        cudaGraphNodeType ty;
        CK(cudaGraphNodeGetType(t[i], &ty));
        if (ty != cudaGraphNodeTypeKernel) continue;  // a programmatic edge may only lead to a kernel
        CK(cudaGraphRemoveDependencies(g, &f[i], &t[i], &d[i], 1));
        cudaGraphEdgeData e = {};
        e.from_port = cudaGraphKernelNodePortProgrammatic;
        e.type = cudaGraphDependencyTypeProgrammatic;
        CK(cudaGraphAddDependencies(g, &f[i], &t[i], &e, 1));
        (*made)++;
    }
    return out;
}

// The kernels the writer's edges go to, by name (driver entry points, so that the program does
// not link libcuda): which cuBLAS kernel family each probe tried.
static std::string names_after(cudaGraph_t g, cudaGraphNode_t from) {
    typedef CUresult (*GetParams)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
    typedef CUresult (*FuncName)(const char**, CUfunction);
    typedef CUresult (*KernName)(const char**, CUkernel);
    static GetParams get = nullptr;
    static FuncName fname = nullptr;
    static KernName kname = nullptr;
    if (!get) {
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuGraphKernelNodeGetParams", (void**)&get, 12000, cudaEnableDefault, &q));
        CK(cudaGetDriverEntryPointByVersion("cuFuncGetName", (void**)&fname, 12030, cudaEnableDefault, &q));
        CK(cudaGetDriverEntryPointByVersion("cuKernelGetName", (void**)&kname, 12030, cudaEnableDefault, &q));
    }
    std::vector<cudaGraphNode_t> f, t;
    std::vector<cudaGraphEdgeData> d;
    const size_t n = graph_edges(g, f, t, d);
    std::string out;
    for (size_t i = 0; i < n; i++) {
        if (f[i] != from) continue;
        cudaGraphNodeType ty;
        CK(cudaGraphNodeGetType(t[i], &ty));
        const char* name = "(not a kernel)";
        CUDA_KERNEL_NODE_PARAMS kp = {};
        if (ty == cudaGraphNodeTypeKernel && get && get((CUgraphNode)t[i], &kp) == CUDA_SUCCESS) {
            name = "(no name)";
            if (kp.func && fname) fname(&name, kp.func);
            else if (kp.kern && kname) kname(&name, kp.kern);
        }
        out += out.empty() ? "" : ", ";
        out += std::string(name).substr(0, 90);
    }
    return out;
}

// One probe: a one-block writer that lets its dependents launch at once, spins ~50 µs, then
// writes x := 1; after it a GEMM (splits 0: gemm() with beta and bf16_out; 2 or 4:
// gemm_split()) or, with splits -1, the control (a reader that does not wait), the edge into
// it made programmatic. The GEMM's output bytes are compared with the same GEMM's run in
// order on the stream (x := 1 first), y starting from the same values.
static void probe(const __nv_bfloat16* w, __nv_bfloat16* x, float* y, int rows, int cols, int m, int splits,
                  float beta, bool bf16_out) {
    static unsigned* zeros = nullptr;
    static unsigned long long* stamp = nullptr;
    if (!zeros) {
        CK(cudaMalloc(&zeros, 4));
        CK(cudaMalloc(&stamp, 16));
    }
    const size_t ny = (size_t)m * rows * (splits > 0 ? splits : 1);
    const size_t bytes = splits > 0 ? ny * 4 : bf16_out ? ny * 2 : ny * 4;
    std::vector<unsigned char> ref(bytes), got(bytes);
    auto consume = [&]() {
        if (splits < 0)
            reader<<<132, 256, 0, st>>>(x, m * cols, zeros, stamp);
        else if (splits > 0)
            gemm_split(w, rows, cols, x, m, y, splits);
        else
            gemm(w, rows, cols, x, m, y, beta, bf16_out);
    };
    fill_f32<<<256, 256, 0, st>>>(y, ny, 0.5f);
    fill<<<256, 256, 0, st>>>(x, (size_t)m * cols, 1, 0.f);
    writer<<<1, 256, 0, st>>>(x, m * cols, 1.f, 0, stamp);
    if (splits >= 0) consume();
    CK(cudaMemcpyAsync(ref.data(), y, bytes, cudaMemcpyDeviceToHost, st));
    fill_f32<<<256, 256, 0, st>>>(y, ny, 0.5f);
    fill<<<256, 256, 0, st>>>(x, (size_t)m * cols, 1, 0.f);
    CK(cudaMemsetAsync(zeros, 0, 4, st));
    CK(cudaMemsetAsync(stamp, 0, 16, st));
    CK(cudaStreamSynchronize(st));
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    writer<<<1, 256, 0, st>>>(x, m * cols, 1.f, 100000, stamp);
    std::vector<cudaGraphNode_t> wn = {leaf()};
    consume();
    CK(cudaStreamEndCapture(st, &g));
    const std::string first = names_after(g, wn[0]);
    size_t nodes = 0;
    CK(cudaGraphGetNodes(g, nullptr, &nodes));
    int prog = 0, made = 0;
    if (edges_from(g, wn, true, &prog, &made) < 1 || prog != 0) {
        printf("probe: no default edge out of the writer to make programmatic\n");
        exit(1);
    }
    if (made == 0) {  // its first node not a kernel: nothing to probe
        printf("probe %5d x %5d, M %3d: no edge made programmatic (first: %s)\n", rows, cols, m, first.c_str());
        CK(cudaGraphDestroy(g));
        return;
    }
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaMemcpyAsync(got.data(), y, bytes, cudaMemcpyDeviceToHost, st));
    unsigned z = 0;
    unsigned long long t[2];
    CK(cudaMemcpyAsync(&z, zeros, 4, cudaMemcpyDeviceToHost, st));
    CK(cudaMemcpyAsync(t, stamp, 16, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    if (splits < 0) {
        printf("control (a reader that does not wait, programmatic edge): read %u of %d values zero, started %.1f us "
               "before the writer's end\n",
               z, m * cols, ((double)t[0] - (double)t[1]) / 1000.0);
        return;
    }
    size_t diff = 0;
    for (size_t i = 0; i < bytes; i++) diff += ref[i] != got[i];
    printf("probe %5d x %5d, M %3d, %s: %zu nodes, %zu of %zu output bytes differ from the in-order run%s\n    first: %s\n",
           rows, cols, m,
           splits > 0    ? (splits == 4 ? "split-K 4, f32 partials" : "split-K 2, f32 partials")
           : bf16_out    ? "bf16 out              "
           : beta != 0.f ? "f32 out, accumulating "
                         : "f32 out               ",
           nodes, diff, bytes, diff ? "  <-- DIFFERS" : "", first.c_str());
}

int main(int argc, char** argv) {
    const bool probing = argc > 1 && std::string(argv[1]) == "probe";
    const int m = probing ? 128 : argc > 1 ? atoi(argv[1]) : 64;
    const int layers = probing ? 1 : argc > 2 ? atoi(argv[2]) : 32;
    const int replays = argc > 3 ? atoi(argv[3]) : 20;
    const int rounds = argc > 4 ? atoi(argv[4]) : 3;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CB(cublasCreate(&blas));
    CB(cublasSetStream(blas, st));
    void* ws;
    CK(cudaMalloc(&ws, 64 << 20));
    CB(cublasSetWorkspace(blas, ws, 64 << 20));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, M %d, %d layers\n", prop.name, m, layers);

    // Shapes of a Llama-3-8B layer: (rows, cols) of QKV, o, gate/up, down.
    const int shapes[4][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
    size_t per_layer = 0;
    for (auto& s : shapes) per_layer += (size_t)s[0] * s[1];
    __nv_bfloat16* w;
    CK(cudaMalloc(&w, per_layer * layers * 2));
    fill<<<1024, 256, 0, st>>>(w, per_layer * layers, 7, 0.05f);
    __nv_bfloat16* x;
    float* y;
    CK(cudaMalloc(&x, (size_t)m * 14336 * 2));
    CK(cudaMalloc(&y, (size_t)m * 28672 * 4));
    CK(cudaMemsetAsync(y, 0, (size_t)m * 28672 * 4, st));
    CK(cudaStreamSynchronize(st));

    if (probing) {
        // 1 and 2: the control, then every GEMM the engine captures at these token counts.
        probe(w, x, y, 4096, 4096, 64, -1, 0, false);
        // The output head (128,256 × 4,096), its own weights and output.
        const int vocab = 128256;
        __nv_bfloat16* wh;
        float* yh;
        CK(cudaMalloc(&wh, (size_t)vocab * 4096 * 2));
        CK(cudaMalloc(&yh, (size_t)m * vocab * 4));
        fill<<<1024, 256, 0, st>>>(wh, (size_t)vocab * 4096, 11, 0.05f);
        const int ms[] = {9, 16, 32, 64, 128};
        for (int mm : ms) probe(wh, x, yh, vocab, 4096, mm, 0, 0.f, false);
        for (int mm : ms) {
            const __nv_bfloat16* wl = w;
            for (int i = 0; i < 4; i++) {
                const int rows = shapes[i][0], cols = shapes[i][1];
                probe(wl, x, y, rows, cols, mm, 0, 0.f, i == 2);  // gate/up: bf16 out (GU_BF16)
                if (i == 1 || i == 3) probe(wl, x, y, rows, cols, mm, 0, 1.f, false);  // o, down: into x
                if (i == 3 && mm <= 128) probe(wl, x, y, rows, cols, mm, mm <= 64 ? 4 : 2, 0.f, false);
                wl += (size_t)rows * cols;
            }
        }
        return 0;
    }

    // 3: the chain, timed.
    cudaGraphExec_t ge[2];
    for (int make = 0; make < 2; make++) {
        cudaGraph_t g;
        std::vector<cudaGraphNode_t> preps;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        const __nv_bfloat16* wl = w;
        for (int l = 0; l < layers; l++) {
            for (auto& s : shapes) {
                launch_pdl(prep, y, m * 4096, x, m * s[1]);
                preps.push_back(leaf());
                gemm(wl, s[0], s[1], x, m, y);
                wl += (size_t)s[0] * s[1];
            }
        }
        CK(cudaStreamEndCapture(st, &g));
        int prog = 0, made = 0;  // (edges into nodes that are not kernels stay default)
        const int out = edges_from(g, preps, make, &prog, &made);
        printf("chain %d: %zu preps, %d edges out of them, %d programmatic as captured, %d after\n", make, preps.size(),
               out, prog, prog + made);
        CK(cudaGraphInstantiate(&ge[make], g, 0));
        CK(cudaGraphDestroy(g));
    }
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const double bytes = 2.0 * per_layer * layers;
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 2; k++) {
            const int make = (r + k) % 2;
            CK(cudaGraphLaunch(ge[make], st));
            CK(cudaEventRecord(a, st));
            for (int i = 0; i < replays; i++) CK(cudaGraphLaunch(ge[make], st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            const double us = 1000.0 * ms / replays;
            printf("round %d, edges into the GEMMs %s: %.1f us per replay, %.2f us per layer, %.3f TB/s\n", r,
                   make ? "programmatic" : "default   ", us, us / layers, bytes / (us * 1e-6) / 1e12);
        }
    }
    return 0;
}
