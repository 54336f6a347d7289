// 03_deep_k: the matmuls of 01/02 with 64-deep k-tiles.
//
// What changed vs 01/02: 64 values of K per pipeline stage (4 mma k-steps per __syncthreads), 128-byte K-major
// shared rows swizzled c ^ (row & 7).
//   t128k64: 128x128x64, 8 warps of 64x32, 3 stages, 96 KiB;  t256k64: 256x128x64, 8 warps of 64x64, 3 stages, 144 KiB.
#include "gemm/gemm_kernels.cuh"

#define GEMM_DEEP(OP, T, SUF, LA, AK, LB, BKM)                                                                    \
    GEMM_KERNEL_KD(gemm_##OP##_t128k64_vec_##SUF, T, 128, 128, 2, 4, 3, true, LA, AK, LB, BKM, false, 64)        \
    GEMM_KERNEL_KD(gemm_##OP##_t256k64_vec_##SUF, T, 256, 128, 4, 2, 3, true, LA, AK, LB, BKM, false, 64)

#define GEMM_DEEP_ALL(T, SUF)                                      \
    GEMM_DEEP(nt, T, SUF, PlainK, true, PlainK, true)              \
    GEMM_DEEP(nn, T, SUF, PlainK, true, PlainMN, false)            \
    GEMM_DEEP(tn, T, SUF, PlainMN, false, PlainMN, false)

GEMM_DEEP_ALL(__nv_bfloat16, bf16)
GEMM_DEEP_ALL(__half, f16)
