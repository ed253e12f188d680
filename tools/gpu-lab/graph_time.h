// Shared by the gpu-lab programs (define CK first): µs per call of f(i), i = 0 … iter − 1,
// the calls captured in one CUDA graph on `st` and replayed, as the engine replays its
// decode steps. An uncaptured f(0) first checks that the kernels launch; one replay warms up.
#pragma once
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
