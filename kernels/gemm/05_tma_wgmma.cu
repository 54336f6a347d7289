// 05_tma_wgmma: the matmuls on a warp-specialised, persistent Hopper kernel (kernels/gemm/tma.cuh). sm_90a only.
//
// What changed vs 04_wgmma: operands arrive by TMA (one thread issues each stage's copies; no per-thread address
// arithmetic, zero-fill out of bounds by the hardware) into a 4-stage mbarrier ring; a producer warpgroup and two
// consumer warpgroups (setmaxnreg 40 / 232) instead of every thread loading and computing; one m64n256k16 per
// consumer and k-step; a persistent grid of at most one block per SM that walks the tiles (and k-splits) so
// that the loads of the next tile overlap the stores of the last. Tile x256: 128x256x64, 4 stages; tile x128:
// 128x128x64, 6 stages (more tiles for the shapes where 128x256 leaves SMs idle in the last wave); tile x64:
// 128x64x64, 8 stages (GEMMs 64 wide, e.g. ResNet's 64-channel layers, where wider tiles multiply zeros).
// Kernel arguments (IG_TMA_KERNEL, gemm/tma.cuh): (tensor maps of A, B, C and Z, C, split-K workspace, bias, shape);
// the same names and layouts as 01-04 (nt: A[M][K] B[N][K]; nn: A[M][K] B[K][N]; tn: A[K][M] B[K][N]).
// gemm_nt_stats_*: nt with the per-column BatchNorm moments of C written to the workspace argument (the 1x1
// convolutions of the training step; ig::tma_epilogue_stats). gemm_nn_gsums_*: nn with the BatchNorm backward
// sums of C (the 1x1 grad-input passes; ig::tma_epilogue_grad_sums; at x128 5 stages and the unit's z tile loaded
// through map Z). gemm_nn_join_*: nn with C joined with a residual gradient b under a ReLU mask, as the
// block-output join would (the grad-input of a bottleneck's conv1 with an identity shortcut; ig::join_pair; b
// through map Z into the same ring). gemm_nt_bnin_* / gemm_tn_bnin_*: nt with A,
// tn with B taken as relu(bn(z)) of what the map reads (the BatchNorm in the shape; ig::XF_A / XF_B): a 1x1
// convolution's forward and grad-weight over the previous BatchNorm + ReLU's input, which is never materialised.
// gemm_nt_bnin_stats_*: both, nt_bnin's normalised A and nt_stats's moments of C (a bottleneck conv3's forward under
// kernels.bn_apply_in_conv = "both": bn2's output never written, bn3's moments from the epilogue).
#include "gemm/tma.cuh"

#define GEMM_TMA_ALL(T, SUF, BN)                                                                \
    IG_TMA_KERNEL(gemm_nt_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, true, BN)                   \
    IG_TMA_KERNEL_STATS(gemm_nt_stats_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, true, BN)       \
    IG_TMA_KERNEL(gemm_nn_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, false, BN)                  \
    IG_TMA_KERNEL_GSUMS(gemm_nn_gsums_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, false, BN)      \
    IG_TMA_KERNEL_JOIN(gemm_nn_join_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, false, BN)        \
    IG_TMA_KERNEL(gemm_tn_x##BN##_vec_##SUF, T, ig::TMA_GEMM, false, false, BN)                 \
    IG_TMA_KERNEL_XF(gemm_nt_bnin_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, true, BN, ig::XF_A)  \
    IG_TMA_KERNEL_XF(gemm_tn_bnin_x##BN##_vec_##SUF, T, ig::TMA_GEMM, false, false, BN, ig::XF_B)  \
    IG_TMA_KERNEL_SX(gemm_nt_bnin_stats_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, true, BN, ig::EPI_MOMENTS, ig::XF_A)

GEMM_TMA_ALL(__nv_bfloat16, bf16, 256)
GEMM_TMA_ALL(__half, f16, 256)
GEMM_TMA_ALL(__nv_bfloat16, bf16, 128)
GEMM_TMA_ALL(__half, f16, 128)
GEMM_TMA_ALL(__nv_bfloat16, bf16, 64)
GEMM_TMA_ALL(__half, f16, 64)

// gemm_nn_gsumsw_*: gemm_nn_gsums_* with the sums taken by statistics warps of the producer warpgroup from the
// staged tile (ig::tma_gsums_warps; x128 and x64 only): what the launcher runs wherever C goes through map C.
#define GEMM_TMA_GSUMS_W(T, SUF, BN) \
    IG_TMA_KERNEL_GSUMS_W(gemm_nn_gsumsw_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, false, BN)
GEMM_TMA_GSUMS_W(__nv_bfloat16, bf16, 128)
GEMM_TMA_GSUMS_W(__half, f16, 128)
GEMM_TMA_GSUMS_W(__nv_bfloat16, bf16, 64)
GEMM_TMA_GSUMS_W(__half, f16, 64)

// gemm_nn_joinsw_*: gemm_nn_join_* with the backward sums of the BatchNorm whose output gradient the joined value
// is (the block before's last BatchNorm, input z3 through map Z3) taken by statistics warps from the joined chunks
// (ig::tma_join_sums_warps; arguments: IG_TMA_KERNEL_JOIN_SUMS).
#define GEMM_TMA_JOIN_SUMS(T, SUF, BN) \
    IG_TMA_KERNEL_JOIN_SUMS(gemm_nn_joinsw_x##BN##_vec_##SUF, T, ig::TMA_GEMM, true, false, BN)
GEMM_TMA_JOIN_SUMS(__nv_bfloat16, bf16, 256)
GEMM_TMA_JOIN_SUMS(__half, f16, 256)
GEMM_TMA_JOIN_SUMS(__nv_bfloat16, bf16, 128)
GEMM_TMA_JOIN_SUMS(__half, f16, 128)
GEMM_TMA_JOIN_SUMS(__nv_bfloat16, bf16, 64)
GEMM_TMA_JOIN_SUMS(__half, f16, 64)
