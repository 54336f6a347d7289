// 01_mma_cp_async: tensor-core matmul, C = A B (+ bias), BF16/FP16 in, FP32 accumulation (core: igemm.cuh).
//
// Three operand layouts, so no transpose is ever materialised (row-major storage throughout):
//   gemm_nt: C[M][N] = A[M][K] B[N][K]^T (+ bias[N])   Linear forward (x w^T + b), the bias fused in the epilogue
//   gemm_nn: C[M][N] = A[M][K] B[K][N]                 Linear grad-input (dy w)
//   gemm_tn: C[M][N] = A[K][M]^T B[K][N]               Linear grad-weight (dy^T x)
// Any M, N, K: tiles past the edges are zero-filled by cp.async and the epilogue stores are bounds-checked.
// Variants: t128 (128x128x32, 8 warps, 4 stages), t64 (64x64x32, 4 warps, 4 stages); vec needs the contiguous
// extents (K for K-major operands, M or N for MN-major ones) to be multiples of 8, scalar takes any shape.
// All three support split-K through blockIdx.z into an FP32 workspace (gemm_splitk_reduce_*), used when a
// problem has too few output tiles to fill the GPU.
#include "gemm/gemm_kernels.cuh"

#define GEMM_LAYOUT(OP, T, SUF, LA, AK, LB, BKM)                                                             \
    GEMM_KERNEL(gemm_##OP##_t128_vec_##SUF, T, 128, 128, 2, 4, 4, true, LA, AK, LB, BKM, false)              \
    GEMM_KERNEL(gemm_##OP##_t64_vec_##SUF, T, 64, 64, 2, 2, 4, true, LA, AK, LB, BKM, false)                 \
    GEMM_KERNEL(gemm_##OP##_t64_scalar_##SUF, T, 64, 64, 2, 2, 4, false, LA, AK, LB, BKM, false)             \
    GEMM_KERNEL(gemm_##OP##_t64_vec_split_##SUF, T, 64, 64, 2, 2, 4, true, LA, AK, LB, BKM, true)            \
    GEMM_KERNEL(gemm_##OP##_t64_scalar_split_##SUF, T, 64, 64, 2, 2, 4, false, LA, AK, LB, BKM, true)

#define GEMM_ALL(T, SUF)                                           \
    GEMM_LAYOUT(nt, T, SUF, PlainK, true, PlainK, true)            \
    GEMM_LAYOUT(nn, T, SUF, PlainK, true, PlainMN, false)          \
    GEMM_LAYOUT(tn, T, SUF, PlainMN, false, PlainMN, false)        \
    GEMM_REDUCE(gemm_splitk_reduce_##SUF, T)

GEMM_ALL(__nv_bfloat16, bf16)
GEMM_ALL(__half, f16)
