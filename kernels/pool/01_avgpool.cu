// Global average pool forward and backward over channels-last (NHWC) activations: ResNet's pool before `fc`.
// Variant 01 (direct): the first CUDA version (previously the model pooled NCHW tensors with candle's mean over
// the flattened (h, w)), written to match the CPU reference in crates/kernels/src/avgpool.rs bit for bit.
//
// Forward: x (n, h, w, c) -> y (n, c). One thread per output element (image, ch), grid-stride loop; the thread
// sums its channel over the h*w pixels in ascending order in FP32, divides by h*w (IEEE division) and rounds
// once to the output dtype (round-to-nearest-even), exactly as the CPU reference does. Consecutive threads take
// consecutive channels, so each of the h*w loads of a warp is one coalesced row segment. With ResNet's 7x7 (or
// 4x4) final maps and thousands of (image, channel) pairs there is enough parallelism without a split reduction,
// and the sequential order keeps the result deterministic and equal to the CPU's.
//
// Backward: dy (n, c) -> dx (n, h, w, c) = dy / (h*w) broadcast. One thread per INPUT element; each writes its
// element once (no memset, no atomics), computed in FP32 and rounded once.
//
// Exported: avgpool_nhwc_fwd_{f32,bf16,f16}, avgpool_nhwc_bwd_{f32,bf16,f16}, avgpool_nhwc_bwd_v8_{bf16,f16}.
// hw = h * w and c are int; flat offsets are 64-bit.

#include "common.cuh"


// x: (n, hw, c) T -> y: (n, c) T. Every y element is written.
template <typename T>
__device__ void avgpool_nhwc_fwd(const T* __restrict__ x, T* __restrict__ y, int n, int hw, int c) {
    const int64_t total = (int64_t)n * c;
    const float count = (float)hw;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t im = i / c;
        const int ch = (int)(i - im * c);
        const T* p = x + im * hw * (int64_t)c + ch;
        float acc = 0.0f;
        for (int j = 0; j < hw; ++j) {
            acc += to_f32(p[(int64_t)j * c]);
        }
        y[i] = from_f32<T>(__fdiv_rn(acc, count));
    }
}

// dy: (n, c) T -> dx: (n, hw, c) T. Every dx element is written.
template <typename T>
__device__ void avgpool_nhwc_bwd(const T* __restrict__ dy, T* __restrict__ dx, int n, int hw, int c) {
    const int64_t img = (int64_t)hw * c;
    const int64_t total = (int64_t)n * img;
    const float count = (float)hw;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t im = i / img;
        const int ch = (int)((i - im * img) % c);
        dx[i] = from_f32<T>(__fdiv_rn(to_f32(dy[im * c + ch]), count));
    }
}

// avgpool_nhwc_bwd_v8 (bf16 / f16): the same dx, 8 channels a thread (c % 8 == 0, dy on a 16-byte boundary; the launcher
// checks and takes avgpool_nhwc_bwd otherwise): one thread per (pixel, 8-channel group) of image blockIdx.y, 32-bit
// index math, one 16-byte load of dy and one 16-byte store. avgpool_nhwc_bwd's two 64-bit divisions per element
// held the ResNet-152 step's 51 MB dx at 112 us on the H200 (ktrace 2026-12-05), about a tenth of write speed.
// Each element is avgpool_nhwc_bwd's expression, so the two agree bit for bit.
template <typename T>
__device__ void avgpool_nhwc_bwd_v8(const T* __restrict__ dy, T* __restrict__ dx, int hw, int c) {
    const int G = c >> 3, per = hw * G;
    const float count = (float)hw;
    const int img = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per; i += gridDim.x * blockDim.x) {
        const int g = i % G;
        union {
            uint4 u;
            T v[8];
        } in, out;
        in.u = *reinterpret_cast<const uint4*>(dy + (int64_t)img * c + 8 * g);
#pragma unroll
        for (int j = 0; j < 8; ++j) out.v[j] = from_f32<T>(__fdiv_rn(to_f32(in.v[j]), count));
        *reinterpret_cast<uint4*>(dx + (int64_t)img * hw * c + (int64_t)i * 8) = out.u;
    }
}

#define AVGPOOL_EXPORT(T, NAME)                                                                                   \
    extern "C" __global__ void avgpool_nhwc_fwd_##NAME(const T* x, T* y, int n, int hw, int c) {                  \
        avgpool_nhwc_fwd<T>(x, y, n, hw, c);                                                                    \
    }                                                                                                           \
    extern "C" __global__ void avgpool_nhwc_bwd_##NAME(const T* dy, T* dx, int n, int hw, int c) {                \
        avgpool_nhwc_bwd<T>(dy, dx, n, hw, c);                                                                  \
    }

AVGPOOL_EXPORT(float, f32)
AVGPOOL_EXPORT(__nv_bfloat16, bf16)
AVGPOOL_EXPORT(__half, f16)

// The 16-bit types only: 8 elements are one 16-byte access.
#define AVGPOOL_V8_EXPORT(T, NAME)                                                                                \
    extern "C" __global__ void avgpool_nhwc_bwd_v8_##NAME(const T* dy, T* dx, int n, int hw, int c) {             \
        avgpool_nhwc_bwd_v8<T>(dy, dx, hw, c);                                                                  \
    }

AVGPOOL_V8_EXPORT(__nv_bfloat16, bf16)
AVGPOOL_V8_EXPORT(__half, f16)
