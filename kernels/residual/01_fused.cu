// Element-wise work of a residual block that the explicit training step (crates/resnet/src/step.rs) fuses:
// the block output's BatchNorm + residual add + ReLU in the forward, and the ReLU gradient (joined with the
// residual gradient) in the backward. CPU reference: crates/kernels/src/ops/residual.rs.
//
// Layouts: activations (rows, c) channel fastest (NHWC); per-channel tensors FP32: stats (3, c) = [mean, var,
// invstd] from the BatchNorm statistics pass, weight and bias (c). Every value is computed in FP32 and rounded
// once to the storage dtype.
//
//   bn_add_relu_{raw,bn}_v{8,1}_{f32,bf16,f16}:
//       y = relu(bn(z) + r)                 (raw: r is the identity shortcut)
//       y = relu(bn(z) + bn_r(r))           (bn: r is the downsample conv's output, normalised here)
//       with bn(z) = (z - mean) * (invstd * weight) + bias, as kernels/batchnorm/01_nhwc.cu's bn_pre.
//   relu_grad_{1,2}_v{8,1}_{f32,bf16,f16}:
//       out = y > 0 ? a (+ b) : 0           (y: the saved ReLU output; the gradient is blocked at y == 0, as
//                                            PyTorch's threshold_backward does)
//
// Work split: one thread per group of V consecutive elements (V = 8: one 16-byte load per bf16/f16 operand, two
// for f32, and 16-byte loads of the per-channel constants), grid-stride. V = 8 needs c % 8 == 0 and 16-byte aligned
// operands and per-channel tensors (the launcher checks, else V = 1).
// Every output element is written.

#include "common.cuh"

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* __restrict__ p, int64_t i) {
    return *reinterpret_cast<const Pack<T, V>*>(p + i);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* __restrict__ p, int64_t i, const Pack<T, V>& v) {
    *reinterpret_cast<Pack<T, V>*>(p + i) = v;
}

// V consecutive per-channel FP32 constants from p (16-byte loads when V % 4 == 0: the launcher checks that the
// per-channel tensors start on a 16-byte boundary and c % 8 == 0 for V = 8).
template <int V>
__device__ __forceinline__ void load_consts(const float* __restrict__ p, float (&v)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            const float4 q = *reinterpret_cast<const float4*>(p + k);
            v[k] = q.x;
            v[k + 1] = q.y;
            v[k + 2] = q.z;
            v[k + 3] = q.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = p[k];
    }
}

// mean, scale = invstd * weight and shift = bias of channels ch0 .. ch0 + V - 1.
template <int V>
__device__ __forceinline__ void bn_consts(const float* __restrict__ s, const float* __restrict__ w,
                                          const float* __restrict__ b, int c, int ch0, float (&mean)[V],
                                          float (&scale)[V], float (&shift)[V]) {
    float inv[V], wt[V];
    load_consts<V>(s + ch0, mean);
    load_consts<V>(s + 2 * c + ch0, inv);
    load_consts<V>(w + ch0, wt);
    load_consts<V>(b + ch0, shift);
#pragma unroll
    for (int k = 0; k < V; ++k) scale[k] = inv[k] * wt[k];
}

template <typename T, int V, bool RES_BN>
__device__ void bn_add_relu(const T* __restrict__ z, const T* __restrict__ r, const float* __restrict__ sz,
                            const float* __restrict__ wz, const float* __restrict__ bz, const float* __restrict__ sr,
                            const float* __restrict__ wr, const float* __restrict__ br, T* __restrict__ y, int64_t n,
                            int c) {
    const int64_t groups = n / V;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = g * V;
        const int ch0 = (int)(i % c);
        const Pack<T, V> zv = load<T, V>(z, i);
        const Pack<T, V> rv = load<T, V>(r, i);
        float m[V], sc[V], sh[V];
        bn_consts<V>(sz, wz, bz, c, ch0, m, sc, sh);
        float rm[V], rsc[V], rsh[V];
        if (RES_BN) bn_consts<V>(sr, wr, br, c, ch0, rm, rsc, rsh);
        Pack<T, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float v = fmaf(to_f32(zv.v[k]) - m[k], sc[k], sh[k]);
            const float res = RES_BN ? fmaf(to_f32(rv.v[k]) - rm[k], rsc[k], rsh[k]) : to_f32(rv.v[k]);
            const float s = v + res;
            out.v[k] = from_f32<T>(s > 0.0f ? s : 0.0f);
        }
        store<T, V>(y, i, out);
    }
}

template <typename T, int V, bool TWO>
__device__ void relu_grad(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ y,
                          T* __restrict__ out, int64_t n) {
    const int64_t groups = n / V;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = g * V;
        const Pack<T, V> av = load<T, V>(a, i);
        const Pack<T, V> yv = load<T, V>(y, i);
        Pack<T, V> bv;
        if (TWO) bv = load<T, V>(b, i);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float s = TWO ? to_f32(av.v[k]) + to_f32(bv.v[k]) : to_f32(av.v[k]);
            o.v[k] = from_f32<T>(to_f32(yv.v[k]) > 0.0f ? s : 0.0f);
        }
        store<T, V>(out, i, o);
    }
}

#define BN_ADD_RELU(NAME, T, V, RES_BN)                                                                          \
    extern "C" __global__ void NAME(const T* z, const T* r, const float* sz, const float* wz, const float* bz,    \
                                    const float* sr, const float* wr, const float* br, T* y, int64_t n, int c) { \
        bn_add_relu<T, V, RES_BN>(z, r, sz, wz, bz, sr, wr, br, y, n, c);                                      \
    }

#define RELU_GRAD(NAME, T, V, TWO)                                                                \
    extern "C" __global__ void NAME(const T* a, const T* b, const T* y, T* out, int64_t n) {    \
        relu_grad<T, V, TWO>(a, b, y, out, n);                                                    \
    }

#define ALL_FOR(SFX, T)                                    \
    BN_ADD_RELU(bn_add_relu_raw_v8_##SFX, T, 8, false)     \
    BN_ADD_RELU(bn_add_relu_raw_v1_##SFX, T, 1, false)     \
    BN_ADD_RELU(bn_add_relu_bn_v8_##SFX, T, 8, true)       \
    BN_ADD_RELU(bn_add_relu_bn_v1_##SFX, T, 1, true)       \
    RELU_GRAD(relu_grad_1_v8_##SFX, T, 8, false)           \
    RELU_GRAD(relu_grad_1_v1_##SFX, T, 1, false)           \
    RELU_GRAD(relu_grad_2_v8_##SFX, T, 8, true)            \
    RELU_GRAD(relu_grad_2_v1_##SFX, T, 1, true)

ALL_FOR(f32, float)
ALL_FOR(bf16, __nv_bfloat16)
ALL_FOR(f16, __half)
