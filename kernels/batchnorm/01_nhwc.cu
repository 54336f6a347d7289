// Training-mode BatchNorm (+ optional fused ReLU) over channels-last activations, forward and backward.
// Variant 01 (nhwc): the first CUDA version (previously the model ran BatchNorm as a chain of candle FP32 ops),
// written against the CPU reference in crates/kernels/src/batchnorm.rs (batch_norm_nhwc_train).
//
// x is viewed as (rows, c) with rows = n * h * w, channel fastest. Statistics are per channel, in FP32 for every
// input dtype; y, dx are in x's dtype; weight, bias, the statistics and the weight/bias gradients are FP32.
//
// Work split (all kernels but the finalisers): block (32, 8), grid (ceil(c / 32), chunks). threadIdx.x picks one
// of 32 consecutive channels (a warp reads one contiguous row segment: coalesced), blockIdx.y one chunk of
// `rows_per_chunk` consecutive rows, threadIdx.y strides over the chunk's rows by 8. A thread keeps its channel's
// per-channel constants in registers, so no per-element index division is needed.
//
// Forward, three passes over x:
//   1. bn_nhwc_sum_*:    per (chunk, channel) FP32 partial sums of x          -> workspace (chunks, c)
//      bn_nhwc_mean:     per channel, fixed-order sum of the partials / rows  -> stats[0] = mean
//   2. bn_nhwc_sqdev_*:  partial sums of (x - mean)^2 (two-pass variance: no cancellation)
//      bn_nhwc_var:      stats[1] = biased var = sum / rows, stats[2] = invstd = 1 / sqrt(var + eps)
//   3. bn_nhwc_apply_*:  y = bn_pre(x) = (x - mean) * (invstd * weight) + bias (one fma), then max(y, 0) when relu
//                        (NaN -> 0)
// Backward, two passes over (x, dy) (xhat = (x - mean) * invstd; g = dy, zeroed when relu where the pre-activation,
// recomputed from x with the forward's exact expression bn_pre, is < 0 or NaN: candle's ReLU gradient, which
// passes at exactly 0; y is not read):
//   1. bn_nhwc_bwd_sum_*: partial sums of g and g * xhat -> workspace (2, chunks, c)
//      bn_nhwc_bwd_final:  sums[0] = dbias = sum g, sums[1] = dweight = sum g * xhat
//   2. bn_nhwc_bwd_dx_*:  dx = weight * invstd * (g - sums[0] / rows - xhat * sums[1] / rows)
// The partials are reduced over threadIdx.y in a fixed order, the finalisers (block (32, 8), grid ceil(c / 32))
// sum the chunks in a fixed order too: no atomics, results are deterministic run to run. Every output element
// (stats, y, sums, dx, workspace) is written. rows and offsets are 64-bit, c is int.
//
// Exported: bn_nhwc_{sum,sqdev,apply,bwd_sum,bwd_dx}_{f32,bf16,f16}, bn_nhwc_{mean,var,bwd_final}.

#include "common.cuh"

#define BN_TX 32
#define BN_TY 8


// Sums `acc` over threadIdx.y in a fixed order; thread (x, 0) gets the block total. All threads must call it.
__device__ __forceinline__ float block_sum_y(float acc) {
    __shared__ float sh[BN_TY][BN_TX];
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    float s = 0.0f;
    if (threadIdx.y == 0) {
#pragma unroll
        for (int i = 0; i < BN_TY; ++i) s += sh[i][threadIdx.x];
    }
    __syncthreads();
    return s;
}

// The pre-activation, evaluated identically by the forward and the backward (scale = invstd * weight).
__device__ __forceinline__ float bn_pre(float x, float mean, float scale, float bias) {
    return fmaf(x - mean, scale, bias);
}

// Partial sums of x (SQDEV = false) or of (x - mean)^2 (SQDEV = true) over one row chunk: part[chunk * c + ch].
template <typename T, bool SQDEV>
__device__ void bn_partial(const T* __restrict__ x, const float* __restrict__ stats, float* __restrict__ part,
                           int64_t rows, int c, int64_t rows_per_chunk) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
    const int64_t r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.0f;
    if (ch < c) {
        const float mean = SQDEV ? stats[ch] : 0.0f;
#pragma unroll 4
        for (int64_t r = r0 + threadIdx.y; r < r1; r += BN_TY) {
            const float v = to_f32(x[r * c + ch]);
            if (SQDEV) {
                const float d = v - mean;
                acc = fmaf(d, d, acc);
            } else {
                acc += v;
            }
        }
    }
    const float s = block_sum_y(acc);
    if (threadIdx.y == 0 && ch < c) part[(int64_t)blockIdx.y * c + ch] = s;
}

// Fixed-order sum over `chunks` partials of channel ch (strided by threadIdx.y, then block_sum_y).
__device__ __forceinline__ float sum_chunks(const float* __restrict__ part, int chunks, int c, int ch) {
    float acc = 0.0f;
    if (ch < c) {
        for (int k = threadIdx.y; k < chunks; k += BN_TY) acc += part[(int64_t)k * c + ch];
    }
    return block_sum_y(acc);
}

// stats: (3, c) = [mean, var, invstd]. Writes mean.
extern "C" __global__ void bn_nhwc_mean(const float* part, float* stats, int chunks, int c, float count) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    const float s = sum_chunks(part, chunks, c, ch);
    if (threadIdx.y == 0 && ch < c) stats[ch] = s / count;
}

// Writes var and invstd.
extern "C" __global__ void bn_nhwc_var(const float* part, float* stats, int chunks, int c, float count, float eps) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    const float s = sum_chunks(part, chunks, c, ch);
    if (threadIdx.y == 0 && ch < c) {
        const float var = s / count;
        stats[c + ch] = var;
        stats[2 * c + ch] = 1.0f / sqrtf(var + eps);
    }
}

// y = (x - mean) * (invstd * weight) + bias [then relu]. Every y element is written.
template <typename T>
__device__ void bn_apply(const T* __restrict__ x, const float* __restrict__ stats, const float* __restrict__ weight,
                         const float* __restrict__ bias, T* __restrict__ y, int64_t rows, int c, int64_t rows_per_chunk,
                         int relu) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    if (ch >= c) return;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
    const int64_t r1 = min(rows, r0 + rows_per_chunk);
    const float mean = stats[ch];
    const float scale = stats[2 * c + ch] * weight[ch];
    const float shift = bias[ch];
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += BN_TY) {
        const int64_t i = r * c + ch;
        float v = bn_pre(to_f32(x[i]), mean, scale, shift);
        if (relu) v = v > 0.0f ? v : 0.0f;
        y[i] = from_f32<T>(v);
    }
}

// g and xhat of one element (see the header).
__device__ __forceinline__ void bn_grad(float xv, float dyv, float mean, float invstd, float scale, float shift,
                                        int relu, float& g, float& xhat) {
    g = (relu && !(bn_pre(xv, mean, scale, shift) >= 0.0f)) ? 0.0f : dyv;
    xhat = (xv - mean) * invstd;
}

// Partial sums of g and g * xhat: part[chunk * c + ch] and part[(chunks + chunk) * c + ch].
template <typename T>
__device__ void bn_bwd_partial(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ stats,
                               const float* __restrict__ weight, const float* __restrict__ bias,
                               float* __restrict__ part, int64_t rows, int c, int64_t rows_per_chunk, int relu) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
    const int64_t r1 = min(rows, r0 + rows_per_chunk);
    float acc_g = 0.0f, acc_gx = 0.0f;
    if (ch < c) {
        const float mean = stats[ch];
        const float invstd = stats[2 * c + ch];
        const float scale = invstd * weight[ch];
        const float shift = bias[ch];
#pragma unroll 4
        for (int64_t r = r0 + threadIdx.y; r < r1; r += BN_TY) {
            const int64_t i = r * c + ch;
            float g, xhat;
            bn_grad(to_f32(x[i]), to_f32(dy[i]), mean, invstd, scale, shift, relu, g, xhat);
            acc_g += g;
            acc_gx = fmaf(g, xhat, acc_gx);
        }
    }
    const float sg = block_sum_y(acc_g);
    const float sgx = block_sum_y(acc_gx);
    if (threadIdx.y == 0 && ch < c) {
        part[(int64_t)blockIdx.y * c + ch] = sg;
        part[((int64_t)gridDim.y + blockIdx.y) * c + ch] = sgx;
    }
}

// sums: (2, c) = [sum g (dbias), sum g * xhat (dweight)].
extern "C" __global__ void bn_nhwc_bwd_final(const float* part, float* sums, int chunks, int c) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    const float sg = sum_chunks(part, chunks, c, ch);
    const float sgx = sum_chunks(part + (int64_t)chunks * c, chunks, c, ch);
    if (threadIdx.y == 0 && ch < c) {
        sums[ch] = sg;
        sums[c + ch] = sgx;
    }
}

// dx = weight * invstd * (g - sum_g / rows - xhat * sum_gxhat / rows). Every dx element is written.
template <typename T>
__device__ void bn_bwd_dx(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ stats,
                          const float* __restrict__ weight, const float* __restrict__ bias,
                          const float* __restrict__ sums, T* __restrict__ dx, int64_t rows, int c,
                          int64_t rows_per_chunk, float count, int relu) {
    const int ch = blockIdx.x * BN_TX + threadIdx.x;
    if (ch >= c) return;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
    const int64_t r1 = min(rows, r0 + rows_per_chunk);
    const float mean = stats[ch];
    const float invstd = stats[2 * c + ch];
    const float scale = invstd * weight[ch];
    const float shift = bias[ch];
    const float a = weight[ch] * invstd;
    const float k1 = sums[ch] / count;
    const float k2 = sums[c + ch] / count;
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += BN_TY) {
        const int64_t i = r * c + ch;
        float g, xhat;
        bn_grad(to_f32(x[i]), to_f32(dy[i]), mean, invstd, scale, shift, relu, g, xhat);
        dx[i] = from_f32<T>(a * (g - k1 - xhat * k2));
    }
}

#define BN_EXPORT(T, NAME)                                                                                        \
    extern "C" __global__ void bn_nhwc_sum_##NAME(const T* x, float* part, long long rows, int c, long long rpc) { \
        bn_partial<T, false>(x, nullptr, part, rows, c, rpc);                                                   \
    }                                                                                                           \
    extern "C" __global__ void bn_nhwc_sqdev_##NAME(const T* x, const float* stats, float* part, long long rows,  \
                                                    int c, long long rpc) {                                     \
        bn_partial<T, true>(x, stats, part, rows, c, rpc);                                                      \
    }                                                                                                           \
    extern "C" __global__ void bn_nhwc_apply_##NAME(const T* x, const float* stats, const float* weight,          \
                                                    const float* bias, T* y, long long rows, int c,              \
                                                    long long rpc, int relu) {                                  \
        bn_apply<T>(x, stats, weight, bias, y, rows, c, rpc, relu);                                             \
    }                                                                                                           \
    extern "C" __global__ void bn_nhwc_bwd_sum_##NAME(const T* x, const T* dy, const float* stats,               \
                                                      const float* weight, const float* bias, float* part,       \
                                                      long long rows, int c, long long rpc, int relu) {          \
        bn_bwd_partial<T>(x, dy, stats, weight, bias, part, rows, c, rpc, relu);                                 \
    }                                                                                                           \
    extern "C" __global__ void bn_nhwc_bwd_dx_##NAME(const T* x, const T* dy, const float* stats,                \
                                                     const float* weight, const float* bias, const float* sums, \
                                                     T* dx, long long rows, int c, long long rpc, float count,   \
                                                     int relu) {                                                \
        bn_bwd_dx<T>(x, dy, stats, weight, bias, sums, dx, rows, c, rpc, count, relu);                           \
    }

BN_EXPORT(float, f32)
BN_EXPORT(__nv_bfloat16, bf16)
BN_EXPORT(__half, f16)
