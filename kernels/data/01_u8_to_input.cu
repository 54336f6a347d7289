// The network input from the loader's uint8 images, in one pass: convert to the activation dtype, normalise with
// the ImageNet mean/std, mirror the samples whose flip flag is set, and write the model's input layout (NCHW, or
// NHWC when the model runs channels-last). The host sends 3 bytes per pixel instead of 12 (f32), and the CPU does
// none of this work. CPU reference and launcher: crates/kernels/src/input.rs (same formula, same rounding).
//
// First version: one thread per output pixel (3 channels), grid-stride. The op is memory-bound (3 bytes in,
// 6 or 12 out per pixel); reads of neighbouring threads are 3-byte strided, writes coalesced in x for NCHW.
// The f32 formula is exactly the reference's: (p / 255 - mean) / std, IEEE division (no fast-math in build.rs),
// then round-to-nearest-even to bf16/f16 (PTX cvt.rn), as candle's to_dtype and `half` do on the CPU.

#include <stdint.h>

// Local helpers (no cuda_bf16.h / cuda_fp16.h): f32 -> bf16/f16 bits, round to nearest even (sm_80+ PTX).
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
    uint16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ uint16_t f32_to_f16_bits(float f) {
    uint16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

struct StoreF32 {
    typedef float T;
    __device__ __forceinline__ static float cvt(float v) { return v; }
};
struct StoreBF16 {
    typedef uint16_t T;
    __device__ __forceinline__ static uint16_t cvt(float v) { return f32_to_bf16_bits(v); }
};
struct StoreF16 {
    typedef uint16_t T;
    __device__ __forceinline__ static uint16_t cvt(float v) { return f32_to_f16_bits(v); }
};

// src: (n, h, w, 3) u8, flips: (n) u8 (non-zero: mirror the sample horizontally),
// out: (n, 3, h, w) when nhwc == 0, else (n, h, w, 3), in the store's dtype.
template <typename S>
__device__ __forceinline__ void u8_to_input(const uint8_t* __restrict__ src, const uint8_t* __restrict__ flips,
                                            typename S::T* __restrict__ out, int n, int h, int w, int nhwc) {
    const float mean[3] = {0.485f, 0.456f, 0.406f};
    const float stdv[3] = {0.229f, 0.224f, 0.225f};
    const long long plane = (long long)h * w;
    const long long total = (long long)n * plane;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long b = i / plane;
        const long long r = i - b * plane;
        const int y = (int)(r / w);
        const int x = (int)(r - (long long)y * w);
        const int sx = flips[b] ? (w - 1 - x) : x;
        const uint8_t* p = src + ((b * h + y) * w + sx) * 3;
        for (int c = 0; c < 3; ++c) {
            const float v = ((float)p[c] / 255.0f - mean[c]) / stdv[c];
            const long long o = nhwc ? i * 3 + c : (b * 3 + c) * plane + r;
            out[o] = S::cvt(v);
        }
    }
}

extern "C" __global__ void u8_to_input_f32(const uint8_t* src, const uint8_t* flips, float* out, int n, int h,
                                           int w, int nhwc) {
    u8_to_input<StoreF32>(src, flips, out, n, h, w, nhwc);
}

extern "C" __global__ void u8_to_input_bf16(const uint8_t* src, const uint8_t* flips, uint16_t* out, int n, int h,
                                            int w, int nhwc) {
    u8_to_input<StoreBF16>(src, flips, out, n, h, w, nhwc);
}

extern "C" __global__ void u8_to_input_f16(const uint8_t* src, const uint8_t* flips, uint16_t* out, int n, int h,
                                           int w, int nhwc) {
    u8_to_input<StoreF16>(src, flips, out, n, h, w, nhwc);
}
