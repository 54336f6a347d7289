// 04_wgmma: the matmuls of 01-03 on Hopper's warpgroup MMA (kernels/gemm/wgmma.cuh). sm_90a only.
//
// What changed vs 03_deep_k: wgmma.mma_async.m64n128k16 from shared memory instead of ldmatrix + mma.sync; MN-major
// operands (NN's B, TN's A and B) use wgmma's panelled layout. Tiles as in conv/04_wgmma.cu:
//   w128 128x128x64 5 stages; w128s3 the same with 3 stages (2 blocks per SM); w256 128x256x64 4 stages.
#include "gemm/gemm_kernels.cuh"
#include "gemm/wgmma.cuh"

#define WG_TH(BM) ((BM) / 64 * 128)

// LA / LB: loader templates; AK / BKM: K-major flags; APN / BPN: panelled MN-major layout (false for K-major).
#define GEMM_WG(NAME, T, BM, BN, ST, MINB, LA, AK, APN, LB, BKM, BPN)                                         \
    extern "C" __global__ void __launch_bounds__(WG_TH(BM), MINB)                                             \
        NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, float* __restrict__ ws,     \
             const T* __restrict__ bias, ig::Shape sh) {                                                      \
        extern __shared__ __align__(1024) unsigned char ig_smem[];                                            \
        int k0 = blockIdx.z * sh.k_split, k1 = min(sh.K, k0 + sh.k_split);                                    \
        ig::LA<T, BM, WG_TH(BM), true, 64, APN> la;                                                            \
        la.init(a, sh.lda, sh.M, sh.K, blockIdx.x * BM, k0, threadIdx.x);                                     \
        ig::LB<T, BN, WG_TH(BM), true, 64, BPN> lb;                                                            \
        lb.init(b, sh.ldb, sh.N, sh.K, blockIdx.y * BN, k0, threadIdx.x);                                     \
        ig::wgmma_body<T, BM, BN, ST, AK, BKM, false, decltype(la), decltype(lb), false>(                     \
            la, lb, sh, k0, k1, c, ws, bias, ig::align1k<T>(ig_smem));                                        \
    }

#define GEMM_WG_TILES(OP, T, SUF, LA, AK, APN, LB, BKM, BPN)                                            \
    GEMM_WG(gemm_##OP##_w128_vec_##SUF, T, 128, 128, 5, 1, LA, AK, APN, LB, BKM, BPN)                   \
    GEMM_WG(gemm_##OP##_w128s3_vec_##SUF, T, 128, 128, 3, 2, LA, AK, APN, LB, BKM, BPN)                 \
    GEMM_WG(gemm_##OP##_w256_vec_##SUF, T, 128, 256, 4, 1, LA, AK, APN, LB, BKM, BPN)

#define GEMM_WG_ALL(T, SUF)                                                       \
    GEMM_WG_TILES(nt, T, SUF, PlainK, true, false, PlainK, true, false)           \
    GEMM_WG_TILES(nn, T, SUF, PlainK, true, false, PlainMN, false, true)          \
    GEMM_WG_TILES(tn, T, SUF, PlainMN, false, true, PlainMN, false, true)

GEMM_WG_ALL(__nv_bfloat16, bf16)
GEMM_WG_ALL(__half, f16)
