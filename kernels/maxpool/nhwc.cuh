// Shared by the channels-last max-pool kernels (02_nhwc.cu, 03_nhwc_argmax.cu, 04_nhwc_vec.cu) and the stem's
// fused BatchNorm + pool (batchnorm/02_nhwc_vec.cu): the geometry and the window
// argmax with the tie and NaN rules of the CPU reference (first maximum wins, a NaN always wins).
#pragma once

#include "common.cuh"

struct PoolGeomNhwc {
    int h, w, c;  // input image (h, w, c)
    int oh, ow;   // output plane
    int k, s, p;  // kernel, stride, padding
};

// Argmax of window (oy, ox) of channel ch in one input image (h, w, c): the spatial index y * w + x of the
// winner (-1 if the window holds no input cell, which MaxPool2d::check_nhwc rules out) and its value in `best`.
template <typename T>
__device__ __forceinline__ int window_argmax_nhwc(const T* __restrict__ img, const PoolGeomNhwc& g, int oy, int ox,
                                                  int ch, float& best) {
    const int y0 = oy * g.s - g.p;
    const int x0 = ox * g.s - g.p;
    const int ky0 = max(0, -y0), ky1 = min(g.k, g.h - y0);
    const int kx0 = max(0, -x0), kx1 = min(g.k, g.w - x0);
    int arg = -1;
    best = -INFINITY;
    for (int ky = ky0; ky < ky1; ++ky) {
        const int row = (y0 + ky) * g.w;
        for (int kx = kx0; kx < kx1; ++kx) {
            const int idx = row + x0 + kx;
            const float v = to_f32(img[idx * g.c + ch]);
            if (arg < 0 || v > best || isnan(v)) {
                best = v;
                arg = idx;
            }
        }
    }
    return arg;
}


// The output windows that contain input cell (iy, ix): oy in [oy0, oy1], ox in [ox0, ox1] (empty when oy0 > oy1
// or ox0 > ox1), from oy * s - p <= iy <= oy * s - p + k - 1 and the same for x.
__device__ __forceinline__ void covering_windows(int iy, int ix, const PoolGeomNhwc& g, int& oy0, int& oy1, int& ox0,
                                                 int& ox1) {
    const int ly = iy + g.p - g.k + 1, lx = ix + g.p - g.k + 1;
    oy0 = ly <= 0 ? 0 : (ly + g.s - 1) / g.s;
    ox0 = lx <= 0 ? 0 : (lx + g.s - 1) / g.s;
    oy1 = min((iy + g.p) / g.s, g.oh - 1);
    ox1 = min((ix + g.p) / g.s, g.ow - 1);
}

// ----- 8 channels a thread (04_nhwc_vec.cu, and the stem's fused BatchNorm + pool in batchnorm/02_nhwc_vec.cu) ----

template <typename T>
struct alignas(sizeof(T) * 8) Vec8 {
    T v[8];
};

// The identity value map of window8 (a plain max-pool).
struct PoolIdentity {
    __device__ __forceinline__ float operator()(float v, int) const { return v; }
};

// Window argmax of 8 channels ch0 .. ch0 + 7 of window (oy, ox) in one image: winners' offsets in the window and
// values, over f(value, j) of each cell's channel ch0 + j (the first maximum wins, a NaN always wins).
template <typename T, typename F = PoolIdentity>
__device__ __forceinline__ void window8(const T* __restrict__ img, const PoolGeomNhwc& g, int oy, int ox, int ch0,
                                        int (&arg)[8], float (&best)[8], F f = F()) {
    const int y0 = oy * g.s - g.p, x0 = ox * g.s - g.p;
    const int ky0 = max(0, -y0), ky1 = min(g.k, g.h - y0);
    const int kx0 = max(0, -x0), kx1 = min(g.k, g.w - x0);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        arg[j] = -1;
        best[j] = -INFINITY;
    }
    for (int ky = ky0; ky < ky1; ++ky) {
        for (int kx = kx0; kx < kx1; ++kx) {
            const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(img + ((y0 + ky) * g.w + x0 + kx) * g.c + ch0);
            const int off = ky * g.k + kx;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float x = f(to_f32(v.v[j]), j);
                if (arg[j] < 0 || x > best[j] || isnan(x)) {
                    best[j] = x;
                    arg[j] = off;
                }
            }
        }
    }
}

// Eight window offsets (each < 256) as 8 bytes, channel ch0 + j in byte j.
__device__ __forceinline__ uint2 pack_offsets8(const int (&a)[8]) {
    uint2 p;
    p.x = (uint32_t)(a[0] & 255) | ((uint32_t)(a[1] & 255) << 8) | ((uint32_t)(a[2] & 255) << 16) |
          ((uint32_t)(a[3] & 255) << 24);
    p.y = (uint32_t)(a[4] & 255) | ((uint32_t)(a[5] & 255) << 8) | ((uint32_t)(a[6] & 255) << 16) |
          ((uint32_t)(a[7] & 255) << 24);
    return p;
}
