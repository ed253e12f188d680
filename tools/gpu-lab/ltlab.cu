// cuBLASLt algorithm lab: does timing cuBLASLt's candidate algorithms for each GEMM shape
// beat cublasGemmEx's default choice (what the engine calls today)? y[M][N] (+)= x[M][K] · W[N][K]ᵀ,
// bf16 in, f32 out and accumulate, the Llama-3-8B shapes (o and down accumulate into the
// residual, as in the engine), W cycled over 4 GiB so L2 is cold, each timed loop one CUDA
// graph (as the engine replays its steps). For each M: the default, then every algorithm
// cublasLtMatmulAlgoGetHeuristic returns (up to 32), each checked against the default.
// Fifteenth session (PERF.md): up to 5% over a 64-token step's GEMMs here, but the engine
// with the fastest candidate per shape (branch wip/gemm-tune) gained nothing inside its
// CUDA graphs. Not part of the build; on a CUDA machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a tools/gpu-lab/ltlab.cu -lcublasLt -lcublas -o ltlab && ./ltlab [x] [M ...]
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define LK(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS %d at %d\n", (int)s, __LINE__); exit(1); } } while (0)
#include "graph_time.h"

int main(int argc, char** argv) {
    const size_t pool_bytes = 4ull << 30;
    unsigned short* pool = bf16_device(pool_bytes / 2, 1, 0.05f);
    std::vector<int> ms = {16, 32, 64, 128, 256};
    // "x" before the token counts: also every configuration cuBLASLt accepts, not only its heuristic's list
    const bool exhaustive = argc > 1 && !strcmp(argv[1], "x");
    if (argc > 1 + exhaustive) { ms.clear(); for (int i = 1 + exhaustive; i < argc; i++) ms.push_back(atoi(argv[i])); }
    const int mmax = *std::max_element(ms.begin(), ms.end());
    unsigned short* x = bf16_device((size_t)mmax * 14336, 7, 1.f);
    const size_t ymax = (size_t)mmax * (mmax > 256 ? 28672 : 128256);
    float *y, *yref; CK(cudaMalloc(&y, ymax * 4)); CK(cudaMalloc(&yref, ymax * 4));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    cublasHandle_t blas; LK(cublasCreate(&blas)); LK(cublasSetStream(blas, st));
    const size_t ws_bytes = 32 << 20;
    void* ws; CK(cudaMalloc(&ws, ws_bytes)); LK(cublasSetWorkspace(blas, ws, ws_bytes));
    cublasLtHandle_t lt; LK(cublasLtCreate(&lt));
    struct Shape { const char* name; int n, k; bool acc; };
    std::vector<Shape> shapes = {{"qkv", 6144, 4096, false}, {"o", 4096, 4096, true}, {"gateup", 28672, 4096, false}, {"down", 4096, 14336, true}, {"lm_head", 128256, 4096, false}};
    for (int m : ms) {
        const int iter = m > 256 ? 6 : 40;
        printf("M = %d\n", m);
        double tot_def = 0, tot_best = 0;
        for (auto& sh : shapes) {
            if (m > 256 && sh.n == 128256) continue;  // prefill runs lm_head on the last token only
            const size_t wbytes = (size_t)sh.n * sh.k * 2;
            const int copies = std::max<size_t>(1, pool_bytes / wbytes);
            const int n = sh.n, k = sh.k;
            const float alpha = 1.f, beta = sh.acc ? 1.f : 0.f;
            auto time = [&](auto f) { return graph_us(st, iter, [&](int i) { f(pool + (size_t)(i % copies) * (wbytes / 2)); }); };
            auto def_run = [&](const unsigned short* w, float* out) {
                LK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, out, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            };
            const float td = time([&](const unsigned short* w) { def_run(w, y); });
            cublasLtMatmulDesc_t desc; LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
            cublasLtMatrixLayout_t la, lb, lc;
            LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
            LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
            LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, n, m, n));
            cublasLtMatmulPreference_t pref; LK(cublasLtMatmulPreferenceCreate(&pref));
            LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
            std::vector<cublasLtMatmulHeuristicResult_t> res(32); int nres = 0;
            LK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, res.data(), &nres));
            res.resize(nres);
            if (exhaustive) {
                // every algorithm id, tile, stage count and split-K count cuBLASLt accepts for the problem
                int ids[64]; int nids = 0;
                LK(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, CUDA_R_32F, 64, ids, &nids));
                for (int a = 0; a < nids; a++) {
                    cublasLtMatmulAlgo_t algo;
                    if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, CUDA_R_32F, ids[a], &algo) != CUBLAS_STATUS_SUCCESS) continue;
                    size_t sz = 0;
                    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &sz);
                    std::vector<int> tiles(std::max<size_t>(1, sz / sizeof(int)), 0);
                    if (sz) cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), sz, &sz);
                    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_STAGES_IDS, nullptr, 0, &sz);
                    std::vector<int> stages(std::max<size_t>(1, sz / sizeof(int)), 0);
                    if (sz) cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_STAGES_IDS, stages.data(), sz, &sz);
                    int splitk_ok = 0; cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk_ok, sizeof splitk_ok, &sz);
                    printf("    algo id %d: %zu tiles, %zu stage ids, split-K %d\n", ids[a], tiles.size(), stages.size(), splitk_ok);
                    for (int tile : tiles) for (int stg : stages) for (int sk : {1, 2, 3, 4, 6, 8}) {
                        if (sk > 1 && !splitk_ok) continue;
                        cublasLtMatmulAlgo_t c = algo;
                        cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile);
                        cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stg, sizeof stg);
                        cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk);
                        cublasLtMatmulHeuristicResult_t r{};
                        if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, lc, lc, &c, &r) != CUBLAS_STATUS_SUCCESS) continue;
                        if (r.workspaceSize > ws_bytes) continue;
                        r.algo = c; r.state = CUBLAS_STATUS_SUCCESS;
                        res.push_back(r);
                        if (res.size() >= 400) break;
                    }
                }
                nres = (int)res.size();
            }
            printf("  %-8s %7.1f MB default %8.2f us %5.0f GB/s | %d candidates\n", sh.name, wbytes / 1e6, td, wbytes / td / 1e3, nres);
            float best = td; int bi = -1;
            for (int i = 0; i < nres; i++) {
                if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
                auto lt_run = [&](const unsigned short* w, float* out) {
                    LK(cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, out, lc, out, lc, &res[i].algo, ws, ws_bytes, st));
                };
                // check: zero both, then (accumulating shapes) run twice so beta matters
                CK(cudaMemsetAsync(y, 0, (size_t)m * n * 4, st)); CK(cudaMemsetAsync(yref, 0, (size_t)m * n * 4, st));
                for (int r = 0; r < (sh.acc ? 2 : 1); r++) { def_run(pool, yref); lt_run(pool, y); }
                CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
                std::vector<float> a(std::min<size_t>((size_t)m * n, 1 << 24)), b(a.size());  // the first 16M outputs
                CK(cudaMemcpy(a.data(), y, a.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), yref, b.size() * 4, cudaMemcpyDeviceToHost));
                double md = 0, mr = 0; for (size_t j = 0; j < a.size(); j++) { md = std::max(md, (double)fabsf(a[j] - b[j])); mr = std::max(mr, (double)fabsf(b[j])); }
                const float t = time([&](const unsigned short* w) { lt_run(w, y); });
                int id = 0, tile = 0, splitk = 0, stages = 0, cluster = 0; size_t sz;
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &sz);
                if (!exhaustive || t < best * 1.02f || i < 8) printf("    #%-2d id %3d tile %3d splitk %2d stages %3d cluster %2d ws %8zu: %8.2f us %5.0f GB/s %.2fx%s\n", i, id, tile, splitk, stages, cluster,
                       res[i].workspaceSize, t, wbytes / t / 1e3, td / t, md / mr > 1e-4 ? " DIFFERS" : "");
                if (md / mr > 1e-4) printf("      max diff %.3e of the range\n", md / mr);
                if (md / mr <= 1e-4 && t < best) best = t, bi = i;
            }
            printf("    best: %s %.2f us (%.3fx the default)\n", bi < 0 ? "default" : "candidate", best, td / best);
            const int reps = sh.n == 128256 ? 1 : 32;
            tot_def += td * reps; tot_best += best * reps;
            cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(lc); cublasLtMatmulDescDestroy(desc);
        }
        printf("  per step (32 layers%s): default %.0f us, best candidates %.0f us (%.3fx)\n", m > 256 ? "" : " + lm_head", tot_def, tot_best, tot_def / tot_best);
    }
}
