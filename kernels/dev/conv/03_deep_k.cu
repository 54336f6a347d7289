// 03_deep_k: the passes of 01/02 with 64-deep k-tiles.
//
// What changed vs 01/02: each pipeline stage holds 64 instead of 32 values of the reduction dimension, so a block
// runs 4 instead of 2 mma k-steps per __syncthreads / cp.async group and keeps twice the bytes in flight per
// stage; K-major shared rows are 128 bytes, swizzled chunk c ^ (row & 7) (igemm.cuh, off_kmajor<64>).
//   t128k64: 128x128x64, 8 warps (2x4, 64x32 each), 3 stages, 96 KiB shared memory (2 blocks per SM);
//   t256k64: 256x128x64, 8 warps (4x2, 64x64 each), 3 stages, 144 KiB (1 block per SM).
// Vectorised loads only; split-K slices are multiples of 64.
#include "conv/conv_kernels.cuh"

#define CONV_DEEP(T, SUF)                                                                 \
    CONV_FWD_KD(conv_fwd_t128k64_vec_##SUF, T, 128, 128, 2, 4, 3, true, 64)              \
    CONV_FWD_KD(conv_fwd_t256k64_vec_##SUF, T, 256, 128, 4, 2, 3, true, 64)              \
    CONV_DGRAD_KD(conv_dgrad_t128k64_vec_##SUF, T, 128, 128, 2, 4, 3, true, 64)          \
    CONV_DGRAD_KD(conv_dgrad_t256k64_vec_##SUF, T, 256, 128, 4, 2, 3, true, 64)          \
    CONV_WGRAD_KD(conv_wgrad_t128k64_vec_##SUF, T, 128, 128, 2, 4, 3, true, 64)          \
    CONV_WGRAD_KD(conv_wgrad_t256k64_vec_##SUF, T, 256, 128, 4, 2, 3, true, 64)

CONV_DEEP(__nv_bfloat16, bf16)
CONV_DEEP(__half, f16)
