// Softmax cross-entropy with label smoothing, forward and backward in one pass over the logits (the end of the
// training step's forward, the start of its backward): one block per row.
//
// logits (n, k) in T (f32, bf16, f16), labels (n) u32, eps (label smoothing), scale (the gradient factor: loss
// scale x 1 / accumulation, already divided by n by the host). Target q_j = eps / k + (1 - eps) [j == label] (a
// label >= k gives the smoothing term alone, as a one-hot comparison would). With m = max_j x_j and
// logZ = m + log sum_j exp(x_j - m):
//   out[n k + i]   = loss_i = logZ - (1 - eps) x_label - (eps / k) sum_j x_j      (= -sum_j q_j log p_ij)
//   out[i k + j]   = (p_ij - q_j) * scale,  p_ij = exp(x_j - logZ)
// in FP32 (every reduction in a fixed order: deterministic). The mean loss is sum_i loss_i / n (one sum after).
#include "../common.cuh"

#define XENT_THREADS 256

// Sum (or max) over the block, returned to every thread; fixed order.
template <bool MAX> __device__ float block_reduce(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = red[0];
    for (int w = 1; w < XENT_THREADS / 32; ++w) t = MAX ? fmaxf(t, red[w]) : t + red[w];
    return t;
}

template <typename T>
__device__ void softmax_xent(const T* __restrict__ logits, const unsigned* __restrict__ labels,
                             float* __restrict__ out, int n, int k, float eps, float scale) {
    __shared__ float red[XENT_THREADS / 32];
    const int i = blockIdx.x;
    const T* x = logits + (long long)i * k;
    const unsigned label = labels[i];
    float m = -INFINITY, sx = 0.f;
    for (int j = threadIdx.x; j < k; j += XENT_THREADS) {
        const float v = to_f32(x[j]);
        m = fmaxf(m, v);
        sx += v;
    }
    m = block_reduce<true>(m, red);
    sx = block_reduce<false>(sx, red);
    float se = 0.f;
    for (int j = threadIdx.x; j < k; j += XENT_THREADS) se += expf(to_f32(x[j]) - m);
    se = block_reduce<false>(se, red);
    const float logz = m + logf(se);
    const float smooth = eps / (float)k;
    float* g = out + (long long)i * k;
    for (int j = threadIdx.x; j < k; j += XENT_THREADS) {
        const float p = expf(to_f32(x[j]) - logz);
        const float q = smooth + ((unsigned)j == label ? 1.f - eps : 0.f);
        g[j] = (p - q) * scale;
    }
    if (threadIdx.x == 0) {
        const float xl = label < (unsigned)k ? to_f32(x[label]) : 0.f;
        const float hit = label < (unsigned)k ? 1.f - eps : 0.f;
        out[(long long)n * k + i] = (hit + eps) * logz - hit * xl - smooth * sx;
    }
}

#define XENT_EXPORT(NAME, T)                                                                                         \
    extern "C" __global__ void __launch_bounds__(XENT_THREADS)                                                       \
        softmax_xent_##NAME(const T* logits, const unsigned* labels, float* out, int n, int k, float eps,            \
                            float scale) {                                                                           \
        softmax_xent<T>(logits, labels, out, n, k, eps, scale);                                                      \
    }

XENT_EXPORT(f32, float)
XENT_EXPORT(bf16, __nv_bfloat16)
XENT_EXPORT(f16, __half)
