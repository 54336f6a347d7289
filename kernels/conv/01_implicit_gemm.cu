// 01_implicit_gemm: channels-last convolution as implicit GEMM on the tensor cores (core: gemm/igemm.cuh).
//
//   forward      y[npq][ko]   = sum_(r,s,c)   x[n][p*st-pad+r][q*st-pad+s][c] * w[ko][r][s][c]
//                GEMM M = N*P*Q, N = Ko, K = R*S*C; A = im2col(x) gathered on the fly (K-major), B = w (K-major).
//   grad-input   dx[nhw][c]   = sum_(r,s,ko)  dy[n][(h+pad-r)/st][(w+pad-s)/st][ko] * w[ko][r][s][c]
//                one launch per phase class (h % st, w % st): GEMM M = N*H*W/st^2, N = C, K = (taps of the
//                class)*Ko, so a strided conv's grad-input does no multiply with a structural zero; rows are
//                scattered to their pixel in the epilogue. (First version: one launch over all pixels and all
//                taps, zero-filling the taps that miss an output: 4x the work at stride 2, 37 vs 190 TFLOP/s.)
//   grad-weight  dw[ko][rsc]  = sum_(n,p,q)   dy[npq][ko] * x[n][p*st-pad+r][q*st-pad+s][c]
//                GEMM M = Ko, N = R*S*C, K = N*P*Q; both operands MN-major (ldmatrix.trans); always split-K
//                into an FP32 workspace, reduced in order by conv_splitk_reduce_* (deterministic).
//
// Variants (the host picks one per shape, crates/kernels/src/cuda_gemm.rs):
//   t128: 128x128x32 block tile, 8 warps (2x4, 64x32 each), 4 stages, 64 KiB shared memory.
//   t64:  64x64x32 block tile, 4 warps (2x2, 32x32 each), 4 stages, 32 KiB: small problems, more blocks.
//   vec:  16-byte cp.async loads (channels multiple of 8); scalar: element loads (the 3-channel stem).
#include "conv/conv_kernels.cuh"

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
