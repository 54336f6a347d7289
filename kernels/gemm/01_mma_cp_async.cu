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
#include "gemm/igemm.cuh"

#define IG_TH(WM, WN) ((WM) * (WN) * 32)

// LA/LB: loader templates; AK/BK_: K-major flags; SPLIT: FP32 workspace output.
#define GEMM_KERNEL(NAME, T, BM, BN, WM, WN, ST, VEC, LA, AK, LB, BKM, SPLIT)                                \
    extern "C" __global__ void __launch_bounds__(IG_TH(WM, WN))                                              \
        NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, float* __restrict__ ws,    \
             const T* __restrict__ bias, ig::Shape sh) {                                                     \
        extern __shared__ __align__(128) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                   \
        ig::LA<T, BM, IG_TH(WM, WN), VEC> la;                                                                \
        la.init(a, sh.lda, sh.M, sh.K, blockIdx.x * BM, k0, threadIdx.x);                                    \
        ig::LB<T, BN, IG_TH(WM, WN), VEC> lb;                                                                \
        lb.init(b, sh.ldb, sh.N, sh.K, blockIdx.y * BN, k0, threadIdx.x);                                    \
        ig::gemm_body<T, BM, BN, WM, WN, ST, AK, BKM, SPLIT>(la, lb, sh, k0, k1, c, ws, bias,                \
                                                             reinterpret_cast<T*>(ig_smem));                 \
    }

#define GEMM_LAYOUT(OP, T, SUF, LA, AK, LB, BKM)                                                             \
    GEMM_KERNEL(gemm_##OP##_t128_vec_##SUF, T, 128, 128, 2, 4, 4, true, LA, AK, LB, BKM, false)              \
    GEMM_KERNEL(gemm_##OP##_t64_vec_##SUF, T, 64, 64, 2, 2, 4, true, LA, AK, LB, BKM, false)                 \
    GEMM_KERNEL(gemm_##OP##_t64_scalar_##SUF, T, 64, 64, 2, 2, 4, false, LA, AK, LB, BKM, false)             \
    GEMM_KERNEL(gemm_##OP##_t64_vec_split_##SUF, T, 64, 64, 2, 2, 4, true, LA, AK, LB, BKM, true)            \
    GEMM_KERNEL(gemm_##OP##_t64_scalar_split_##SUF, T, 64, 64, 2, 2, 4, false, LA, AK, LB, BKM, true)

// Split-K reduction with the bias of gemm_nt: C[i] = sum_z ws[z][i] + bias[i % n].
#define GEMM_REDUCE(NAME, T)                                                                                 \
    extern "C" __global__ void NAME(const float* __restrict__ ws, T* __restrict__ C, const T* __restrict__ bias, \
                                    int has_bias, int mn, int n, int splits) {                                \
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < mn; i += gridDim.x * blockDim.x) {            \
            float v = has_bias ? ig::to_f(bias[i % n]) : 0.f;                                                 \
            for (int z = 0; z < splits; ++z) v += ws[(int64_t)z * mn + i];                                    \
            C[i] = ig::from_f<T>(v);                                                                          \
        }                                                                                                     \
    }

#define GEMM_ALL(T, SUF)                                           \
    GEMM_LAYOUT(nt, T, SUF, PlainK, true, PlainK, true)            \
    GEMM_LAYOUT(nn, T, SUF, PlainK, true, PlainMN, false)          \
    GEMM_LAYOUT(tn, T, SUF, PlainMN, false, PlainMN, false)        \
    GEMM_REDUCE(gemm_splitk_reduce_##SUF, T)

GEMM_ALL(__nv_bfloat16, bf16)
GEMM_ALL(__half, f16)
