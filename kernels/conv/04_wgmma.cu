// 04_wgmma: the three convolution passes of 01-03 on Hopper's warpgroup MMA (kernels/gemm/wgmma.cuh). sm_90a only.
//
// What changed vs 03_deep_k: the same loaders and 64-deep k-tiles, but the MMAs are wgmma.mma_async.m64n128k16
// reading both operands from shared memory (no ldmatrix, no register fragments of A/B): the warpgroup's tensor-core
// work is issued as one asynchronous group per k-tile while the threads issue the copies of later tiles. MN-major
// operands (grad-input's weights, grad-weight's dy and x) use the panelled layout wgmma expects.
//   w128:   128x128x64, 2 warpgroups of 64x128, 5 stages, 161 KiB shared memory (1 block per SM);
//   w128s3: the same tile, 3 stages, 97 KiB (2 blocks per SM: one block's barriers hide behind the other's MMAs);
//   w256:   128x256x64, 2 warpgroups of 64x256 (two n128 MMAs per k-step), 4 stages, 193 KiB.
// Vectorised loads only (channels multiples of 8); split-K slices are multiples of 64.
#include "conv/conv_kernels.cuh"
#include "gemm/wgmma.cuh"

#define WG_TH(BM) ((BM) / 64 * 128)

#define CONV_FWD_WG(NAME, T, BM, BN, ST, MINB)                                                                \
    extern "C" __global__ void __launch_bounds__(WG_TH(BM), MINB)                                             \
        NAME(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, ig::Shape sh) {             \
        extern __shared__ __align__(1024) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                    \
        ig::ConvFwdA<T, BM, WG_TH(BM), true, 64> la;                                                          \
        la.init(x, sh, blockIdx.x * BM, k0, threadIdx.x);                                                     \
        ig::PlainK<T, BN, WG_TH(BM), true, 64> lb;                                                            \
        lb.init(w, sh.K, sh.N, sh.K, blockIdx.y * BN, k0, threadIdx.x);                                       \
        ig::wgmma_body<T, BM, BN, ST, true, true, false, decltype(la), decltype(lb), false>(                  \
            la, lb, sh, k0, k1, y, nullptr, nullptr, ig::align1k<T>(ig_smem));                                \
    }

#define CONV_DGRAD_WG(NAME, T, BM, BN, ST, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(WG_TH(BM), MINB)                                             \
        NAME(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx, ig::Shape sh) {           \
        extern __shared__ __align__(1024) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                    \
        ig::DgradA<T, BM, WG_TH(BM), true, 64> la;                                                            \
        la.init(dy, sh, blockIdx.x * BM, k0, threadIdx.x);                                                    \
        ig::DgradB<T, BN, WG_TH(BM), true, 64, true> lb;                                                      \
        lb.init(w, sh, blockIdx.y * BN, k0, threadIdx.x);                                                     \
        ig::wgmma_body<T, BM, BN, ST, true, false, false, decltype(la), decltype(lb), true>(                  \
            la, lb, sh, k0, k1, dx, nullptr, nullptr, ig::align1k<T>(ig_smem));                               \
    }

#define CONV_WGRAD_WG(NAME, T, BM, BN, ST, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(WG_TH(BM), MINB)                                             \
        NAME(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ ws, ig::Shape sh) {       \
        extern __shared__ __align__(1024) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                    \
        ig::PlainMN<T, BM, WG_TH(BM), true, 64, true> la;                                                     \
        la.init(dy, sh.ko, sh.M, sh.K, blockIdx.x * BM, k0, threadIdx.x);                                     \
        ig::WgradB<T, BN, WG_TH(BM), true, 64, true> lb;                                                      \
        lb.init(x, sh, blockIdx.y * BN, k0, threadIdx.x);                                                     \
        ig::wgmma_body<T, BM, BN, ST, false, false, true, decltype(la), decltype(lb), false>(                 \
            la, lb, sh, k0, k1, (T*)nullptr, ws, nullptr, ig::align1k<T>(ig_smem));                           \
    }

#define CONV_WG_ALL(T, SUF)                                                  \
    CONV_FWD_WG(conv_fwd_w128_vec_##SUF, T, 128, 128, 5, 1)                  \
    CONV_FWD_WG(conv_fwd_w128s3_vec_##SUF, T, 128, 128, 3, 2)                \
    CONV_FWD_WG(conv_fwd_w256_vec_##SUF, T, 128, 256, 4, 1)                  \
    CONV_DGRAD_WG(conv_dgrad_w128_vec_##SUF, T, 128, 128, 5, 1)              \
    CONV_DGRAD_WG(conv_dgrad_w128s3_vec_##SUF, T, 128, 128, 3, 2)            \
    CONV_DGRAD_WG(conv_dgrad_w256_vec_##SUF, T, 128, 256, 4, 1)              \
    CONV_WGRAD_WG(conv_wgrad_w128_vec_##SUF, T, 128, 128, 5, 1)              \
    CONV_WGRAD_WG(conv_wgrad_w128s3_vec_##SUF, T, 128, 128, 3, 2)            \
    CONV_WGRAD_WG(conv_wgrad_w256_vec_##SUF, T, 128, 256, 4, 1)

CONV_WG_ALL(__nv_bfloat16, bf16)
CONV_WG_ALL(__half, f16)
