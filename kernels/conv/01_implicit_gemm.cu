// 01_implicit_gemm: channels-last convolution as implicit GEMM on the tensor cores (core: gemm/igemm.cuh).
//
//   forward      y[npq][ko]   = sum_(r,s,c)   x[n][p*st-pad+r][q*st-pad+s][c] * w[ko][r][s][c]
//                GEMM M = N*P*Q, N = Ko, K = R*S*C; A = im2col(x) gathered on the fly (K-major), B = w (K-major).
//   grad-input   dx[nhw][c]   = sum_(r,s,ko)  dy[n][(h+pad-r)/st][(w+pad-s)/st][ko] * w[ko][r][s][c]
//                GEMM M = N*H*W, N = C, K = R*S*Ko; taps whose (h+pad-r) is not a multiple of the stride are
//                zero-filled (for stride 2 three quarters of the loaded A rows are zeros: a known cost).
//   grad-weight  dw[ko][rsc]  = sum_(n,p,q)   dy[npq][ko] * x[n][p*st-pad+r][q*st-pad+s][c]
//                GEMM M = Ko, N = R*S*C, K = N*P*Q; both operands MN-major (ldmatrix.trans); always split-K
//                into an FP32 workspace, reduced in order by conv_splitk_reduce_* (deterministic).
//
// Variants (the host picks one per shape, crates/kernels/src/cuda_gemm.rs):
//   t128: 128x128x32 block tile, 8 warps (2x4, 64x32 each), 4 stages, 64 KiB shared memory.
//   t64:  64x64x32 block tile, 4 warps (2x2, 32x32 each), 4 stages, 32 KiB: small problems, more blocks.
//   vec:  16-byte cp.async loads (channels multiple of 8); scalar: element loads (the 3-channel stem).
#include "gemm/igemm.cuh"

#define IG_TH(WM, WN) ((WM) * (WN) * 32)

#define CONV_FWD(NAME, T, BM, BN, WM, WN, ST, VEC)                                                           \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, ig::Shape sh) {            \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::ConvFwdA<T, BM, IG_TH(WM, WN), VEC> la;                                                          \
        la.init(x, sh, blockIdx.x * BM, k0, threadIdx.x);                                                    \
        ig::PlainK<T, BN, IG_TH(WM, WN), VEC> lb;                                                            \
        lb.init(w, sh.K, sh.N, sh.K, blockIdx.y * BN, k0, threadIdx.x);                                      \
        ig::gemm_body<T, BM, BN, WM, WN, ST, true, true, false>(la, lb, sh, k0, k1, y, nullptr, nullptr,     \
                                                                reinterpret_cast<T*>(ig_smem));              \
    }

#define CONV_DGRAD(NAME, T, BM, BN, WM, WN, ST, VEC)                                                         \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx, ig::Shape sh) {          \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::DgradA<T, BM, IG_TH(WM, WN), VEC> la;                                                            \
        la.init(dy, sh, blockIdx.x * BM, k0, threadIdx.x);                                                   \
        ig::DgradB<T, BN, IG_TH(WM, WN), VEC> lb;                                                            \
        lb.init(w, sh, blockIdx.y * BN, k0, threadIdx.x);                                                    \
        ig::gemm_body<T, BM, BN, WM, WN, ST, true, false, false>(la, lb, sh, k0, k1, dx, nullptr, nullptr,   \
                                                                 reinterpret_cast<T*>(ig_smem));             \
    }

#define CONV_WGRAD(NAME, T, BM, BN, WM, WN, ST, VEC)                                                         \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ ws, ig::Shape sh) {      \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::PlainMN<T, BM, IG_TH(WM, WN), VEC> la;                                                           \
        la.init(dy, sh.ko, sh.M, sh.K, blockIdx.x * BM, k0, threadIdx.x);                                    \
        ig::WgradB<T, BN, IG_TH(WM, WN), VEC> lb;                                                            \
        lb.init(x, sh, blockIdx.y * BN, k0, threadIdx.x);                                                    \
        ig::gemm_body<T, BM, BN, WM, WN, ST, false, false, true>(la, lb, sh, k0, k1, nullptr, ws, nullptr,   \
                                                                 reinterpret_cast<T*>(ig_smem));             \
    }

#define CONV_ALL(T, SUF)                                                                 \
    CONV_FWD(conv_fwd_t128_vec_##SUF, T, 128, 128, 2, 4, 4, true)                       \
    CONV_FWD(conv_fwd_t64_vec_##SUF, T, 64, 64, 2, 2, 4, true)                          \
    CONV_FWD(conv_fwd_t64_scalar_##SUF, T, 64, 64, 2, 2, 4, false)                      \
    CONV_DGRAD(conv_dgrad_t128_vec_##SUF, T, 128, 128, 2, 4, 4, true)                   \
    CONV_DGRAD(conv_dgrad_t64_vec_##SUF, T, 64, 64, 2, 2, 4, true)                      \
    CONV_WGRAD(conv_wgrad_t128_vec_##SUF, T, 128, 128, 2, 4, 4, true)                   \
    CONV_WGRAD(conv_wgrad_t64_vec_##SUF, T, 64, 64, 2, 2, 4, true)                      \
    CONV_WGRAD(conv_wgrad_t64_scalar_##SUF, T, 64, 64, 2, 2, 4, false)                  \
    IG_SPLITK_REDUCE(conv_splitk_reduce_##SUF, T)

CONV_ALL(__nv_bfloat16, bf16)
CONV_ALL(__half, f16)
