// 2D max-pool forward and backward, NCHW, any square kernel / stride / padding, floor mode.
// Variant 01 (direct): the first CUDA version, written to match the CPU reference in
// crates/kernels/src/maxpool.rs bit for bit.
//
// Forward: one thread per output element (grid-stride loop). The window is scanned row by row and a value
// replaces the running best when `v > best || isnan(v)`: the first maximum wins ties (PyTorch's choice) and a
// NaN always wins, so NaNs propagate (the last NaN of a window is its argmax, as on the CPU).
//
// Backward: a gather, not a scatter. One thread per INPUT element visits the output windows that contain it
// (at most ceil(k/s)^2 of them), recomputes each window's argmax from x as the forward did, and sums the output
// gradients of the windows whose argmax it is. Why gather: no atomics, so the result is deterministic and needs
// no f32 scratch buffer for the low-precision dtypes; every input element is written exactly once (zero when it
// wins no window), so no memset either; and no argmax indices are stored by the forward (no extra activation
// memory). The cost is re-reading each window up to ceil(k/s)^2 times (about 20 reads of x per input element
// for ResNet's 3x3/s2), which caches well (the windows of neighbouring threads overlap).
// Accumulation is in FP32 for every dtype, in the same order as the CPU reference (oy, then ox, ascending),
// and rounded once to the output dtype (round-to-nearest-even), so results match the CPU exactly.
//
// Exported: maxpool2d_fwd_{f32,bf16,f16}, maxpool2d_bwd_{f32,bf16,f16}. Sizes are passed as int (each
// dimension and oh*ow, h*w below 2^31); flat offsets are computed in 64 bits.

#include "common.cuh"


struct PoolGeom {
    int h, w;     // input plane
    int oh, ow;   // output plane
    int k, s, p;  // kernel, stride, padding
};

// Argmax of window (oy, ox) in one input plane: flat index within the plane (-1 if the window holds no input
// cell, which MaxPool2d::check rules out) and its value in `best`.
template <typename T>
__device__ __forceinline__ int window_argmax(const T* __restrict__ plane, const PoolGeom& g, int oy, int ox, float& best) {
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
            const float v = to_f32(plane[idx]);
            if (arg < 0 || v > best || isnan(v)) {
                best = v;
                arg = idx;
            }
        }
    }
    return arg;
}

// x: (nc, h, w) T, y: (nc, oh, ow) T; nc = n * c. Every y element is written.
template <typename T>
__device__ void maxpool2d_fwd(const T* __restrict__ x, T* __restrict__ y, int nc, PoolGeom g) {
    const int64_t plane_out = (int64_t)g.oh * g.ow;
    const int64_t total = (int64_t)nc * plane_out;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t pl = i / plane_out;
        const int r = (int)(i - pl * plane_out);
        const int oy = r / g.ow, ox = r - oy * g.ow;
        float best;
        const int arg = window_argmax(x + pl * g.h * g.w, g, oy, ox, best);
        y[i] = arg < 0 ? from_f32<T>(-INFINITY) : from_f32<T>(best);
    }
}

// x: (nc, h, w) T, dy: (nc, oh, ow) T -> dx: (nc, h, w) T. Every dx element is written.
template <typename T>
__device__ void maxpool2d_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, int nc, PoolGeom g) {
    const int64_t plane_in = (int64_t)g.h * g.w;
    const int64_t total = (int64_t)nc * plane_in;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t pl = i / plane_in;
        const int r = (int)(i - pl * plane_in);
        const int iy = r / g.w, ix = r - iy * g.w;
        // Windows containing iy: oy * s - p <= iy <= oy * s - p + k - 1.
        const int ly = iy + g.p - g.k + 1, lx = ix + g.p - g.k + 1;
        const int oy0 = ly <= 0 ? 0 : (ly + g.s - 1) / g.s;
        const int ox0 = lx <= 0 ? 0 : (lx + g.s - 1) / g.s;
        const int oy1 = min((iy + g.p) / g.s, g.oh - 1);
        const int ox1 = min((ix + g.p) / g.s, g.ow - 1);
        const T* xp = x + pl * plane_in;
        const T* dyp = dy + pl * (int64_t)g.oh * g.ow;
        float acc = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy) {
            for (int ox = ox0; ox <= ox1; ++ox) {
                float best;
                if (window_argmax(xp, g, oy, ox, best) == r) {
                    acc += to_f32(dyp[oy * g.ow + ox]);
                }
            }
        }
        dx[i] = from_f32<T>(acc);
    }
}

#define MAXPOOL_EXPORT(T, NAME)                                                                                   \
    extern "C" __global__ void maxpool2d_fwd_##NAME(const T* x, T* y, int nc, int h, int w, int oh, int ow,       \
                                                    int k, int s, int p) {                                      \
        maxpool2d_fwd<T>(x, y, nc, PoolGeom{h, w, oh, ow, k, s, p});                                            \
    }                                                                                                           \
    extern "C" __global__ void maxpool2d_bwd_##NAME(const T* x, const T* dy, T* dx, int nc, int h, int w,        \
                                                    int oh, int ow, int k, int s, int p) {                      \
        maxpool2d_bwd<T>(x, dy, dx, nc, PoolGeom{h, w, oh, ow, k, s, p});                                       \
    }

MAXPOOL_EXPORT(float, f32)
MAXPOOL_EXPORT(__nv_bfloat16, bf16)
MAXPOOL_EXPORT(__half, f16)
