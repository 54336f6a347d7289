// 05_tma_wgmma: the convolution passes on the warp-specialised persistent TMA + wgmma kernel of
// kernels/gemm/05_tma_wgmma.cu (kernels/gemm/tma.cuh). sm_90a only.
//
// What changed vs 04_wgmma: no per-thread im2col address arithmetic at all. The activations are read through TMA
// im2col tensor maps (cuTensorMapEncodeIm2col over the NHWC tensor, made by the launcher in cuda_gemm.rs): one
// copy brings a column of 128 (or 64) output pixels x 64 channels for one filter tap, walking the pixels in NHW
// order across rows and images, with the padding as the hardware's out-of-bounds zero fill and the stride as the
// map's traversal stride. The filter tap is the copy's im2col offset. Weights and dy come as tiled TMA boxes.
//   forward:     y[npq][ko]  = im2col(x)[npq][(r,s,c)] . w[ko][(r,s,c)]^T          (any stride; C % 64 == 0)
//   grad-input:  dx[nhw][c]  = im2col(dy, pad R-1-pad)[nhw][(r',s',k)] . w[k][flip(r',s')][c]  (stride 1;
//                Ko % 64 == 0)
//   grad-weight: dw[ko][(r,s,c)] = dy[npq][ko]^T . im2col(x)[npq][(r,s,c)]             (any stride; C % 64 == 0;
//                split-K over the pixels through the FP32 workspace)
//   strided grad-input: one launch per phase class (dx pixels h = hh * stride + ph, w = ww * stride + pw), each a
//                stride-1 correlation of dy with the class's taps r = r0 + stride i (conv_dgrads_*; the class's
//                im2col corners come with its tensor map; rows stored to their dx pixels; Ko % 64 == 0)
//   grad-weight transposed (conv_wgradt_*, Ko <= 64): dw^T[(r,s,c)][ko] = im2col(x)^T . dy, so that the 128-row
//                tile runs over R*S*C instead of a half-empty Ko = 64; the launcher transposes the result.
// conv_fwd_stats_*: the forward with the per-channel BatchNorm moments of y written to the workspace argument
// (ig::tma_epilogue_stats; no split-K). conv_dgrad_gsums_*: the stride-1 grad-input with the BatchNorm backward
// sums of dx (ig::tma_epilogue_grad_sums; no split-K; at x128 5 stages and the unit's z tile loaded through map Z).
// Tiles x256 (128x256x64, 4 stages), x128 (128x128x64, 6 stages) and x64 (128x64x64, 8 stages). Kernel arguments
// as the GEMM's (IG_TMA_KERNEL): (maps A, B, out and Z, out, split-K workspace, bias (unused; GSUMS: z), shape).
#include "gemm/tma.cuh"

#define CONV_TMA_ALL(T, SUF, BN)                                                                \
    IG_TMA_KERNEL(conv_fwd_x##BN##_tma_##SUF, T, ig::TMA_CONV_FWD, true, true, BN)              \
    IG_TMA_KERNEL_STATS(conv_fwd_stats_x##BN##_tma_##SUF, T, ig::TMA_CONV_FWD, true, true, BN)  \
    IG_TMA_KERNEL(conv_dgrad_x##BN##_tma_##SUF, T, ig::TMA_CONV_DGRAD, true, false, BN)         \
    IG_TMA_KERNEL_GSUMS(conv_dgrad_gsums_x##BN##_tma_##SUF, T, ig::TMA_CONV_DGRAD, true, false, BN) \
    IG_TMA_KERNEL(conv_wgrad_x##BN##_tma_##SUF, T, ig::TMA_CONV_WGRAD, false, false, BN)        \
    IG_TMA_KERNEL(conv_dgrads_x##BN##_tma_##SUF, T, ig::TMA_CONV_DGRAD_S, true, false, BN)      \
    IG_TMA_KERNEL(conv_wgradt_x##BN##_tma_##SUF, T, ig::TMA_CONV_WGRAD_T, false, false, BN)

CONV_TMA_ALL(__nv_bfloat16, bf16, 256)
CONV_TMA_ALL(__half, f16, 256)
CONV_TMA_ALL(__nv_bfloat16, bf16, 128)
CONV_TMA_ALL(__half, f16, 128)
CONV_TMA_ALL(__nv_bfloat16, bf16, 64)
CONV_TMA_ALL(__half, f16, 64)

// conv_dgrad_gsumsw_*: conv_dgrad_gsums_* with the sums taken by statistics warps of the producer warpgroup from
// the staged tile (ig::tma_gsums_warps; x128 and x64 only): what the launcher runs wherever dx goes through map C.
#define CONV_TMA_GSUMS_W(T, SUF, BN) \
    IG_TMA_KERNEL_GSUMS_W(conv_dgrad_gsumsw_x##BN##_tma_##SUF, T, ig::TMA_CONV_DGRAD, true, false, BN)
CONV_TMA_GSUMS_W(__nv_bfloat16, bf16, 128)
CONV_TMA_GSUMS_W(__half, f16, 128)
CONV_TMA_GSUMS_W(__nv_bfloat16, bf16, 64)
CONV_TMA_GSUMS_W(__half, f16, 64)
