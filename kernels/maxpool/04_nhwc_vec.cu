// Channels-last max-pool, 8 channels per thread (16-byte loads and stores), forward and backward.
// Variant 04 (nhwc_vec) of 02_nhwc.cu / 03_nhwc_argmax.cu: same results bit for bit (the same window argmax with
// the CPU reference's tie and NaN rules, the same gather of the gradient), but one thread per (pixel, 8 channels)
// and one image per blockIdx.y, so the index arithmetic is 32-bit and done once per 8 elements. 02/03 give each
// thread one element and divide 64-bit indices for each: the ResNet-152 step's max-pool passes (128x112x112x64 ->
// 56x56, batch 256) took 5 ms on the H200 (ktrace, 2026-12-04), about a tenth of memory speed.
//
// Needs c % 8 == 0 and 16-byte aligned tensors (the launcher, cuda/pool.rs, falls back to 02/03 otherwise) and a
// window of at most 255 cells (offsets as bytes).
//
// maxpool2d_nhwc_fwd_v8: x (n, h, w, c) -> y (n, oh, ow, c).
// maxpool2d_nhwc_argmax_v8: x -> arg (n, oh, ow, c) u8, the winner's offset ky * k + kx in its window.
// maxpool2d_nhwc_bwd_argmax_v8: (arg, dy (n, oh, ow, c)) -> dx (n, h, w, c): each input cell sums dy over the
//   windows that chose it (at most ceil(k / s)^2 windows). Every dx element is written.
// maxpool2d_nhwc_bwd_argmax_k3s2p1_v8: the same for kernel 3, stride 2, padding 1, a 2 x 2 block of cells a thread
//   (grid over one image's blocks' 8-channel groups); maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8 takes the gradient as
//   the sum of two (dy + dy2, rounded once per element as badd rounds it).
// Launch: block 256, grid (blocks over one image's pixel groups, n); each block strides over its image.

#include "maxpool/nhwc.cuh"

// MODE 0: y; MODE 1: arg.
template <typename T, int MODE>
__device__ void maxpool_fwd_v8(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ arg,
                               PoolGeomNhwc g) {
    const int G = g.c >> 3;
    const int groups = g.oh * g.ow * G;
    const T* img = x + (int64_t)blockIdx.y * g.h * g.w * g.c;
    const int64_t base = (int64_t)blockIdx.y * g.oh * g.ow * g.c;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += gridDim.x * blockDim.x) {
        const int pix = i / G, ch0 = (i - pix * G) * 8;
        const int oy = pix / g.ow, ox = pix - oy * g.ow;
        int a[8];
        float b[8];
        window8(img, g, oy, ox, ch0, a, b);
        const int64_t o = base + (int64_t)pix * g.c + ch0;
        if (MODE == 0) {
            Vec8<T> out;
#pragma unroll
            for (int j = 0; j < 8; ++j) out.v[j] = from_f32<T>(b[j]);
            *reinterpret_cast<Vec8<T>*>(y + o) = out;
        } else {
            *reinterpret_cast<uint2*>(arg + o) = pack_offsets8(a);
        }
    }
}

template <typename T>
__device__ void maxpool_bwd_v8(const uint8_t* __restrict__ arg, const T* __restrict__ dy, T* __restrict__ dx,
                               PoolGeomNhwc g) {
    const int G = g.c >> 3;
    const int groups = g.h * g.w * G;
    const int64_t out_base = (int64_t)blockIdx.y * g.oh * g.ow * g.c;
    const int64_t in_base = (int64_t)blockIdx.y * g.h * g.w * g.c;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += gridDim.x * blockDim.x) {
        const int pix = i / G, ch0 = (i - pix * G) * 8;
        const int iy = pix / g.w, ix = pix - iy * g.w;
        int oy0, oy1, ox0, ox1;
        covering_windows(iy, ix, g, oy0, oy1, ox0, ox1);
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int oy = oy0; oy <= oy1; ++oy) {
            const int ky = iy - (oy * g.s - g.p);
            for (int ox = ox0; ox <= ox1; ++ox) {
                const int want = ky * g.k + (ix - (ox * g.s - g.p));
                const int64_t o = out_base + (int64_t)(oy * g.ow + ox) * g.c + ch0;
                const uint2 a = *reinterpret_cast<const uint2*>(arg + o);
                const Vec8<T> d = *reinterpret_cast<const Vec8<T>*>(dy + o);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const uint32_t word = j < 4 ? a.x : a.y;
                    if ((int)((word >> (8 * (j & 3))) & 255u) == want) acc[j] += to_f32(d.v[j]);
                }
            }
        }
        Vec8<T> out;
#pragma unroll
        for (int j = 0; j < 8; ++j) out.v[j] = from_f32<T>(acc[j]);
        *reinterpret_cast<Vec8<T>*>(dx + in_base + (int64_t)pix * g.c + ch0) = out;
    }
}

// The ResNet stem's pool (kernel 3, stride 2, padding 1) backward: one thread per 8-channel group of a 2 x 2 block
// of input cells (2m .. 2m + 1, 2q .. 2q + 1). Those four cells are covered by the windows (m .. m + 1, q .. q + 1)
// only, so the thread loads each of the four windows' offsets and gradients once (maxpool_bwd_v8 loads 2.25 a
// cell and divides by the runtime stride for each: ~0.6 ms, about 0.9 TB/s, for ResNet-152's batch-256 stem on
// the H200, ktrace 2026-12-05) and sums, per cell, the windows that chose it in maxpool_bwd_v8's order (window
// row, then column), from 0: the same sums bit for bit.
// The sum of two gradients of 8 elements rounded once to T, as candle's badd computes it (__hadd).
template <typename T>
__device__ __forceinline__ Vec8<T> add8(const Vec8<T>& a, const Vec8<T>& b) {
    Vec8<T> s;
#pragma unroll
    for (int j = 0; j < 8; ++j) s.v[j] = a.v[j] + b.v[j];
    return s;
}

// With dy2 non-null (maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8) the gradient is dy + dy2, each window's sum rounded to T
// first (the ResNet stem: the first block's main and shortcut gradients, which the step had added in a separate
// pass of 3 x 103 MB), so dx equals the one-gradient kernel's on badd(dy, dy2) bit for bit.
template <typename T>
__device__ void maxpool_bwd_k3s2p1_v8(const uint8_t* __restrict__ arg, const T* __restrict__ dy,
                                      const T* __restrict__ dy2, T* __restrict__ dx, PoolGeomNhwc g) {
    const int G = g.c >> 3;
    const int bw = (g.w + 1) >> 1, bh = (g.h + 1) >> 1;
    const int groups = bh * bw * G;
    const int64_t out_base = (int64_t)blockIdx.y * g.oh * g.ow * g.c;
    const int64_t in_base = (int64_t)blockIdx.y * g.h * g.w * g.c;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += gridDim.x * blockDim.x) {
        const int blk = i / G, ch0 = (i - blk * G) * 8;
        const int m = blk / bw, q = blk - m * bw;
        // Windows (m + dy_, q + dx_), dy_, dx_ in {0, 1}: their offsets and gradients (absent past the output).
        uint2 a[2][2];
        Vec8<T> d[2][2];
        bool has[2][2];
#pragma unroll
        for (int wy = 0; wy < 2; ++wy) {
#pragma unroll
            for (int wx = 0; wx < 2; ++wx) {
                const int oy = m + wy, ox = q + wx;
                has[wy][wx] = oy < g.oh && ox < g.ow;
                if (has[wy][wx]) {
                    const int64_t o = out_base + (int64_t)(oy * g.ow + ox) * g.c + ch0;
                    a[wy][wx] = *reinterpret_cast<const uint2*>(arg + o);
                    d[wy][wx] = *reinterpret_cast<const Vec8<T>*>(dy + o);
                    if (dy2 != nullptr) d[wy][wx] = add8(d[wy][wx], *reinterpret_cast<const Vec8<T>*>(dy2 + o));
                }
            }
        }
        // Cell (2m + cy, 2q + cx) lies in window (m + wy, q + wx) at offset ky * 3 + kx, ky = cy + 1 - 2 wy,
        // kx = cx + 1 - 2 wx; the windows covering it: wy <= cy, wx <= cx.
#pragma unroll
        for (int cy = 0; cy < 2; ++cy) {
#pragma unroll
            for (int cx = 0; cx < 2; ++cx) {
                const int iy = 2 * m + cy, ix = 2 * q + cx;
                if (iy >= g.h || ix >= g.w) continue;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                for (int wy = 0; wy <= cy; ++wy) {
#pragma unroll
                    for (int wx = 0; wx <= cx; ++wx) {
                        if (!has[wy][wx]) continue;
                        const int want = (cy + 1 - 2 * wy) * 3 + (cx + 1 - 2 * wx);
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const uint32_t word = j < 4 ? a[wy][wx].x : a[wy][wx].y;
                            if ((int)((word >> (8 * (j & 3))) & 255u) == want) acc[j] += to_f32(d[wy][wx].v[j]);
                        }
                    }
                }
                Vec8<T> out;
#pragma unroll
                for (int j = 0; j < 8; ++j) out.v[j] = from_f32<T>(acc[j]);
                *reinterpret_cast<Vec8<T>*>(dx + in_base + (int64_t)(iy * g.w + ix) * g.c + ch0) = out;
            }
        }
    }
}

#define MAXPOOL_NHWC_VEC_EXPORT(T, NAME)                                                                          \
    extern "C" __global__ void maxpool2d_nhwc_fwd_v8_##NAME(const T* x, T* y, int n, int h, int w, int c, int oh, \
                                                            int ow, int k, int s, int p) {                        \
        maxpool_fwd_v8<T, 0>(x, y, nullptr, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                             \
    }                                                                                                             \
    extern "C" __global__ void maxpool2d_nhwc_argmax_v8_##NAME(const T* x, uint8_t* arg, int n, int h, int w,     \
                                                               int c, int oh, int ow, int k, int s, int p) {      \
        maxpool_fwd_v8<T, 1>(x, nullptr, arg, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                           \
    }                                                                                                             \
    extern "C" __global__ void maxpool2d_nhwc_bwd_argmax_v8_##NAME(const uint8_t* arg, const T* dy, T* dx, int n, \
                                                                   int h, int w, int c, int oh, int ow, int k,    \
                                                                   int s, int p) {                                \
        maxpool_bwd_v8<T>(arg, dy, dx, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                                   \
    }                                                                                                             \
    extern "C" __global__ void maxpool2d_nhwc_bwd_argmax_k3s2p1_v8_##NAME(                                        \
        const uint8_t* arg, const T* dy, T* dx, int n, int h, int w, int c, int oh, int ow, int k, int s, int p) { \
        maxpool_bwd_k3s2p1_v8<T>(arg, dy, nullptr, dx, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                   \
    }                                                                                                             \
    extern "C" __global__ void maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8_##NAME(                                       \
        const uint8_t* arg, const T* dy, const T* dy2, T* dx, int n, int h, int w, int c, int oh, int ow, int k,    \
        int s, int p) {                                                                                           \
        maxpool_bwd_k3s2p1_v8<T>(arg, dy, dy2, dx, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                       \
    }

MAXPOOL_NHWC_VEC_EXPORT(float, f32)
MAXPOOL_NHWC_VEC_EXPORT(__nv_bfloat16, bf16)
MAXPOOL_NHWC_VEC_EXPORT(__half, f16)
