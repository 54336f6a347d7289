// 2D max-pool forward and backward, channels-last (NHWC), any square kernel / stride / padding, floor mode.
// Variant 02 (nhwc): variant 01 (01_direct.cu, NCHW) with the data layout changed to (n, h, w, c) for the
// channels-last model (kernels.conv = "custom"); the algorithm, tie/NaN rules and summation order are the same,
// so it matches the CPU reference (crates/kernels/src/maxpool.rs, max_pool2d_nhwc) bit for bit.
//
// What changed vs 01: the channel is the fastest-varying index of both the input and the output, so the thread
// index decomposes as (image, oy, ox, ch) instead of (plane, oy, ox). Consecutive threads handle consecutive
// channels of the same window and their loads of x (stride c*w between rows, c between columns, 1 between
// threads) coalesce; in NCHW, neighbouring threads read neighbouring windows instead. Offsets within one image
// (h*w*c and oh*ow*c elements) are int, the image offset is 64-bit.
//
// Forward: one thread per output element (grid-stride loop). The window is scanned row by row and a value
// replaces the running best when `v > best || isnan(v)`: the first maximum wins ties (PyTorch's choice) and a
// NaN always wins, so NaNs propagate (the last NaN of a window is its argmax, as on the CPU).
//
// Backward: a gather, not a scatter, as in 01. One thread per INPUT element (image, iy, ix, ch) visits the
// output windows that contain (iy, ix) (at most ceil(k/s)^2 of them), recomputes each window's argmax for its
// channel from x as the forward did, and sums the output gradients of the windows whose argmax it is. No
// atomics (deterministic, no f32 scratch buffer, no memset: every dx element is written exactly once) and no
// stored indices. Accumulation is in FP32 for every dtype in the CPU reference's order (oy, then ox, ascending),
// rounded once to the output dtype (round-to-nearest-even).
//
// Exported: maxpool2d_nhwc_fwd_{f32,bf16,f16}, maxpool2d_nhwc_bwd_{f32,bf16,f16}.

#include "maxpool/nhwc.cuh"


// x: (n, h, w, c) T, y: (n, oh, ow, c) T. Every y element is written.
template <typename T>
__device__ void maxpool2d_nhwc_fwd(const T* __restrict__ x, T* __restrict__ y, int n, PoolGeomNhwc g) {
    const int64_t img_out = (int64_t)g.oh * g.ow * g.c;
    const int64_t img_in = (int64_t)g.h * g.w * g.c;
    const int64_t total = (int64_t)n * img_out;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t im = i / img_out;
        const int r = (int)(i - im * img_out);
        const int pix = r / g.c, ch = r - pix * g.c;
        const int oy = pix / g.ow, ox = pix - oy * g.ow;
        float best;
        const int arg = window_argmax_nhwc(x + im * img_in, g, oy, ox, ch, best);
        y[i] = arg < 0 ? from_f32<T>(-INFINITY) : from_f32<T>(best);
    }
}

// x: (n, h, w, c) T, dy: (n, oh, ow, c) T -> dx: (n, h, w, c) T. Every dx element is written.
template <typename T>
__device__ void maxpool2d_nhwc_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, int n,
                                   PoolGeomNhwc g) {
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
        const T* xi = x + im * img_in;
        const T* dyi = dy + im * img_out;
        float acc = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy) {
            for (int ox = ox0; ox <= ox1; ++ox) {
                float best;
                if (window_argmax_nhwc(xi, g, oy, ox, ch, best) == pix) {
                    acc += to_f32(dyi[(oy * g.ow + ox) * g.c + ch]);
                }
            }
        }
        dx[i] = from_f32<T>(acc);
    }
}

#define MAXPOOL_NHWC_EXPORT(T, NAME)                                                                              \
    extern "C" __global__ void maxpool2d_nhwc_fwd_##NAME(const T* x, T* y, int n, int h, int w, int c, int oh,   \
                                                         int ow, int k, int s, int p) {                          \
        maxpool2d_nhwc_fwd<T>(x, y, n, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                                  \
    }                                                                                                           \
    extern "C" __global__ void maxpool2d_nhwc_bwd_##NAME(const T* x, const T* dy, T* dx, int n, int h, int w,   \
                                                         int c, int oh, int ow, int k, int s, int p) {           \
        maxpool2d_nhwc_bwd<T>(x, dy, dx, n, PoolGeomNhwc{h, w, c, oh, ow, k, s, p});                             \
    }

MAXPOOL_NHWC_EXPORT(float, f32)
MAXPOOL_NHWC_EXPORT(__nv_bfloat16, bf16)
MAXPOOL_NHWC_EXPORT(__half, f16)
