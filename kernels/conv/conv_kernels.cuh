// Kernel-definition macros of the implicit-GEMM convolution (one extern "C" kernel per pass, tile and load
// mode); the numbered files under kernels/conv/ instantiate them. Passes and layouts: 01_implicit_gemm.cu.
#pragma once
#include "gemm/igemm.cuh"

#define IG_TH(WM, WN) ((WM) * (WN) * 32)

#define CONV_FWD(NAME, T, BM, BN, WM, WN, ST, VEC) CONV_FWD_KD(NAME, T, BM, BN, WM, WN, ST, VEC, 32)
#define CONV_FWD_KD(NAME, T, BM, BN, WM, WN, ST, VEC, KD)                                                           \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, ig::Shape sh) {            \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::ConvFwdA<T, BM, IG_TH(WM, WN), VEC, KD> la;                                                          \
        la.init(x, sh, blockIdx.x * BM, k0, threadIdx.x);                                                    \
        ig::PlainK<T, BN, IG_TH(WM, WN), VEC, KD> lb;                                                            \
        lb.init(w, sh.K, sh.N, sh.K, blockIdx.y * BN, k0, threadIdx.x);                                      \
        ig::gemm_body<T, BM, BN, WM, WN, ST, true, true, false, decltype(la), decltype(lb), false, KD>(la, lb, sh, k0, k1, y, nullptr, nullptr,     \
                                                                reinterpret_cast<T*>(ig_smem));              \
    }

#define CONV_DGRAD(NAME, T, BM, BN, WM, WN, ST, VEC) CONV_DGRAD_KD(NAME, T, BM, BN, WM, WN, ST, VEC, 32)
#define CONV_DGRAD_KD(NAME, T, BM, BN, WM, WN, ST, VEC, KD)                                                         \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx, ig::Shape sh) {          \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::DgradA<T, BM, IG_TH(WM, WN), VEC, KD> la;                                                            \
        la.init(dy, sh, blockIdx.x * BM, k0, threadIdx.x);                                                   \
        ig::DgradB<T, BN, IG_TH(WM, WN), VEC, KD> lb;                                                            \
        lb.init(w, sh, blockIdx.y * BN, k0, threadIdx.x);                                                    \
        ig::gemm_body<T, BM, BN, WM, WN, ST, true, false, false, decltype(la), decltype(lb), true, KD>(           \
            la, lb, sh, k0, k1, dx, nullptr, nullptr, reinterpret_cast<T*>(ig_smem));                        \
    }

#define CONV_WGRAD(NAME, T, BM, BN, WM, WN, ST, VEC) CONV_WGRAD_KD(NAME, T, BM, BN, WM, WN, ST, VEC, 32)
#define CONV_WGRAD_KD(NAME, T, BM, BN, WM, WN, ST, VEC, KD)                                                         \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ ws, ig::Shape sh) {      \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::PlainMN<T, BM, IG_TH(WM, WN), VEC, KD> la;                                                           \
        la.init(dy, sh.ko, sh.M, sh.K, blockIdx.x * BM, k0, threadIdx.x);                                    \
        ig::WgradB<T, BN, IG_TH(WM, WN), VEC, KD> lb;                                                            \
        lb.init(x, sh, blockIdx.y * BN, k0, threadIdx.x);                                                    \
        ig::gemm_body<T, BM, BN, WM, WN, ST, false, false, true, decltype(la), decltype(lb), false, KD>(la, lb, sh, k0, k1, nullptr, ws, nullptr,   \
                                                                 reinterpret_cast<T*>(ig_smem));             \
    }

