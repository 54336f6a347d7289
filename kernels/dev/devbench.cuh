// What the standalone kernel harnesses under kernels/dev share (batchnorm/bnbench.cu, gemm/tmabench.cu): the error
// check, the stream they launch on, a CUDA-graph timer, an FNV-1a hash of device memory (to compare two builds'
// outputs bit for bit), and deterministic pseudo-random inputs. Define DEV_HARNESS (the harness's name, for its
// error lines) before including it.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#ifndef DEV_HARNESS
#define DEV_HARNESS "harness"
#endif

#define CK(x)                                                                                                   \
    do {                                                                                                        \
        cudaError_t e_ = (x);                                                                                   \
        if (e_ != cudaSuccess) {                                                                                \
            std::fprintf(stderr, DEV_HARNESS ": %s failed: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
            std::exit(1);                                                                                       \
        }                                                                                                       \
    } while (0)

// The stream every launch of a harness goes on (created non-blocking by its main).
static cudaStream_t g_stream;

// FNV-1a over `bytes` bytes of device memory.
static unsigned long long fnv(const void* d, size_t bytes) {
    std::vector<unsigned char> h(bytes);
    CK(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost));
    unsigned long long x = 1469598103934665603ull;
    for (unsigned char b : h) x = (x ^ b) * 1099511628211ull;
    return x;
}

// Mean microseconds of one launch: a graph of `reps` launches, replayed `iters` times after 2 warm-up replays.
static double time_us(const std::function<void()>& launch, int reps = 20, int iters = 10) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaStreamEndCapture(g_stream, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 2; ++i) CK(cudaGraphLaunch(ge, g_stream));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, g_stream));
    for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(ge, g_stream));
    CK(cudaEventRecord(b, g_stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ms * 1e3 / (reps * iters);
}

// A deterministic pseudo-random value in [-2, 2): a hash of the index i and the seed.
__device__ __forceinline__ float hash_unit(long long i, unsigned seed) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return (float)(h & 0xffff) / 16384.0f - 2.0f;
}
