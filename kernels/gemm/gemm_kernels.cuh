// Kernel-definition macros of the tensor-core matmul; the numbered files under kernels/gemm/ instantiate them.
#pragma once
#include "gemm/igemm.cuh"

#define IG_TH(WM, WN) ((WM) * (WN) * 32)

// LA/LB: loader templates; AK/BK_: K-major flags; SPLIT: FP32 workspace output.
#define GEMM_KERNEL(NAME, T, BM, BN, WM, WN, ST, VEC, LA, AK, LB, BKM, SPLIT) GEMM_KERNEL_KD(NAME, T, BM, BN, WM, WN, ST, VEC, LA, AK, LB, BKM, SPLIT, 32)
#define GEMM_KERNEL_KD(NAME, T, BM, BN, WM, WN, ST, VEC, LA, AK, LB, BKM, SPLIT, KD)                                \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, float* __restrict__ ws,    \
             const T* __restrict__ bias, ig::Shape sh) {                                                     \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::LA<T, BM, IG_TH(WM, WN), VEC, KD> la;                                                                \
        la.init(a, sh.lda, sh.M, sh.K, blockIdx.x * BM, k0, threadIdx.x);                                    \
        ig::LB<T, BN, IG_TH(WM, WN), VEC, KD> lb;                                                                \
        lb.init(b, sh.ldb, sh.N, sh.K, blockIdx.y * BN, k0, threadIdx.x);                                    \
        ig::gemm_body<T, BM, BN, WM, WN, ST, AK, BKM, SPLIT, decltype(la), decltype(lb), false, KD>(la, lb, sh, k0, k1, c, ws, bias,                \
                                                             reinterpret_cast<T*>(ig_smem));                 \
    }

// Split-K reduction with the bias of gemm_nt: C[i] = sum_z ws[z][i] + bias[i % n].
#define GEMM_REDUCE(NAME, T)                                                                                 \
    extern "C" __global__ void NAME(const float* __restrict__ ws, T* __restrict__ C, const T* __restrict__ bias, \
                                    int has_bias, int mn, int n, int splits) {                                \
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < mn; i += gridDim.x * blockDim.x) {            \
            float v = has_bias ? ig::to_f(bias[i % n]) : 0.f;                                                 \
            for (int z = 0; z < splits; ++z) v += ws[(int64_t)z * mn + i];                                    \
            C[i] = ig::from_f<T>(v);                                                                          \
        }                                                                                                     \
    }

