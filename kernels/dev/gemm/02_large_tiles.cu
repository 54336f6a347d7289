// 02_large_tiles: the matmuls of 01_mma_cp_async.cu with larger block tiles.
//
// What changed vs 01: 64x64 warp tiles (twice the mma.sync per ldmatrix) in
//   t256:  256x128x32 block tile, 8 warps (4x2), 3 stages, 72 KiB shared memory, 1 block per SM;
//   t128w: 128x256x32 block tile, 8 warps (2x4), same budget.
// Vectorised loads only, no split-K (large problems).
#include "gemm/gemm_kernels.cuh"

#define GEMM_LARGE(OP, T, SUF, LA, AK, LB, BKM)                                                              \
    GEMM_KERNEL(gemm_##OP##_t256_vec_##SUF, T, 256, 128, 4, 2, 3, true, LA, AK, LB, BKM, false)              \
    GEMM_KERNEL(gemm_##OP##_t128w_vec_##SUF, T, 128, 256, 2, 4, 3, true, LA, AK, LB, BKM, false)

#define GEMM_LARGE_ALL(T, SUF)                                     \
    GEMM_LARGE(nt, T, SUF, PlainK, true, PlainK, true)             \
    GEMM_LARGE(nn, T, SUF, PlainK, true, PlainMN, false)           \
    GEMM_LARGE(tn, T, SUF, PlainMN, false, PlainMN, false)

GEMM_LARGE_ALL(__nv_bfloat16, bf16)
GEMM_LARGE_ALL(__half, f16)
