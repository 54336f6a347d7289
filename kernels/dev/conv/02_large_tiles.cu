// 02_large_tiles: the passes of 01_implicit_gemm.cu with larger block tiles.
//
// What changed vs 01: 64x64 warp tiles (4 x 8 mma.sync per k-step: twice the math per ldmatrix) in
//   t256:  256x128x32 block tile, 8 warps (4x2), 3 stages, 72 KiB shared memory, 1 block per SM;
//   t128w: 128x256x32 block tile, 8 warps (2x4), same budget (wide N: many output channels, few pixels).
// Vectorised loads only (channels multiple of 8). Same loaders, epilogues and split-K as 01.
#include "conv/conv_kernels.cuh"

#define CONV_LARGE(T, SUF)                                                             \
    CONV_FWD(conv_fwd_t256_vec_##SUF, T, 256, 128, 4, 2, 3, true)                     \
    CONV_FWD(conv_fwd_t128w_vec_##SUF, T, 128, 256, 2, 4, 3, true)                    \
    CONV_DGRAD(conv_dgrad_t256_vec_##SUF, T, 256, 128, 4, 2, 3, true)                 \
    CONV_DGRAD(conv_dgrad_t128w_vec_##SUF, T, 128, 256, 2, 4, 3, true)                \
    CONV_WGRAD(conv_wgrad_t256_vec_##SUF, T, 256, 128, 4, 2, 3, true)                 \
    CONV_WGRAD(conv_wgrad_t128w_vec_##SUF, T, 128, 256, 2, 4, 3, true)

CONV_LARGE(__nv_bfloat16, bf16)
CONV_LARGE(__half, f16)
