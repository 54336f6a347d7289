// Channels-last (NHWC) max-pool backward in two passes at memory speed.
// Variant 03 (nhwc_argmax): 02_nhwc.cu's backward, which recomputed every window's argmax for each input element
// that window contains (up to ceil(k/s)^2 windows x k*k reads of x per input element: 36 for ResNet's 3x3/s2),
// ran at ~110 GB/s (4.4 ms for 128x112x112x64 bf16 on the H200, kernels-bench `pool`). Here:
//   pass 1, one thread per OUTPUT element: the window's argmax (the same function as the forward, so the same
//     tie and NaN rules), stored as its offset in the window, ky * k + kx, one byte per output element;
//   pass 2, one thread per INPUT element: the same gather as 02 (windows in (oy, ox) ascending order, FP32 sum of
//     the output gradients of the windows whose argmax it is, rounded once), reading the stored offsets instead
//     of recomputing them.
// The result is bit-identical to 02 and to the CPU reference; no atomics, every dx element written once. x is
// read about once (neighbouring windows share it through L1/L2), dy and the offsets once per window an input
// belongs to, again mostly from cache.
// Needs k * k <= 255 (offset 255 = "no input cell", which MaxPool2d::check_nhwc rules out); the launcher falls back
// to 02 otherwise.
//
// Exported: maxpool2d_nhwc_argmax_{f32,bf16,f16}, maxpool2d_nhwc_bwd_argmax_{f32,bf16,f16}.

#include "maxpool/nhwc.cuh"

// x: (n, h, w, c) T -> arg: (n, oh, ow, c) u8, the argmax's offset ky * k + kx in its window.
template <typename T>
__device__ void maxpool2d_nhwc_argmax(const T* __restrict__ x, uint8_t* __restrict__ arg, int n, PoolGeomNhwc g) {
    const int64_t img_out = (int64_t)g.oh * g.ow * g.c;
    const int64_t img_in = (int64_t)g.h * g.w * g.c;
    const int64_t total = (int64_t)n * img_out;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t im = i / img_out;
        const int r = (int)(i - im * img_out);
        const int pix = r / g.c, ch = r - pix * g.c;
        const int oy = pix / g.ow, ox = pix - oy * g.ow;
        float best;
        const int a = window_argmax_nhwc(x + im * img_in, g, oy, ox, ch, best);
        if (a < 0) {
            arg[i] = 255;
        } else {
            const int y = a / g.w, xx = a - y * g.w;
            arg[i] = (uint8_t)((y - (oy * g.s - g.p)) * g.k + (xx - (ox * g.s - g.p)));
        }
    }
}

// arg: (n, oh, ow, c) u8 from pass 1, dy: (n, oh, ow, c) T -> dx: (n, h, w, c) T. Every dx element is written.
template <typename T>
__device__ void maxpool2d_nhwc_bwd_argmax(const uint8_t* __restrict__ arg, const T* __restrict__ dy,
                                          T* __restrict__ dx, int n, PoolGeomNhwc g) {
    const int64_t img_in = (int64_t)g.h * g.w * g.c;
    const int64_t img_out = (int64_t)g.oh * g.ow * g.c;
    const int64_t total = (int64_t)n * img_in;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t im = i / img_in;
        const int r = (int)(i - im * img_in);
        const int pix = r / g.c, ch = r - pix * g.c;
        const int iy = pix / g.w, ix = pix - iy * g.w;
        int oy0, oy1, ox0, ox1;
        covering_windows(iy, ix, g, oy0, oy1, ox0, ox1);
        const uint8_t* ai = arg + im * img_out;
        const T* dyi = dy + im * img_out;
        float acc = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy) {
            const int ky = iy - (oy * g.s - g.p);
            for (int ox = ox0; ox <= ox1; ++ox) {
                const int o = (oy * g.ow + ox) * g.c + ch;
                if (ai[o] == ky * g.k + (ix - (ox * g.s - g.p))) {
                    acc += to_f32(dyi[o]);
                }
            }
        }
        dx[i] = from_f32<T>(acc);
    }
}

#define MAXPOOL_NHWC_ARGMAX_EXPORT(T, NAME)                                                                       \
    extern "C" __global__ void maxpool2d_nhwc_argmax_##NAME(const T* x, uint8_t* arg, int n, int h, int w, int c, \
                                                            int oh, int ow, int k, int s, int p) {                \
        maxpool2d_nhwc_argmax<T>(x, arg, n, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                             \
    }                                                                                                           \
    extern "C" __global__ void maxpool2d_nhwc_bwd_argmax_##NAME(const uint8_t* arg, const T* dy, T* dx, int n,   \
                                                                int h, int w, int c, int oh, int ow, int k, int s, \
                                                                int p) {                                          \
        maxpool2d_nhwc_bwd_argmax<T>(arg, dy, dx, n, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                    \
    }

MAXPOOL_NHWC_ARGMAX_EXPORT(float, f32)
MAXPOOL_NHWC_ARGMAX_EXPORT(__nv_bfloat16, bf16)
MAXPOOL_NHWC_ARGMAX_EXPORT(__half, f16)
