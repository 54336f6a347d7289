// Hopper (sm_90a) warp-specialised, persistent GEMM: TMA loads, an mbarrier ring, wgmma m64n256k16 / m64n128k16.
//
// C[M][N] = A B (+ bias[n]) with FP32 accumulation; or, split-K, FP32 partial sums into ws[z][M][N] that
// gemm_splitk_reduce adds up. A and B are read through TMA tensor maps made on the host
// (crates/kernels/src/cuda_gemm.rs, `tma_map`): K-major operands as one box of {64 k, rows} per stage, MN-major
// ones as 64 x 64 boxes, one per 64-row panel. TMA zero-fills whatever lies outside the matrix, so any M, N, K
// works (the row strides must be multiples of 16 bytes: K, or N / M for MN-major operands, multiples of 8). The
// convolution modes (TMA_CONV_*, below) read the activations through im2col tensor maps instead.
//
// - Block tile 128 x BN x 64 (BN = 256: 4 stages of 48 KiB; 128: 6 of 32 KiB; 64: 8 of 24 KiB), 384 threads:
//   warpgroup 0 is the producer (one thread issues the TMA copies; setmaxnreg gives its registers away),
//   warpgroups 1 and 2 the consumers, each owning 64 rows x BN columns of the tile (BN / 2 FP32 accumulators per
//   thread).
// - Ring: full[s] (1 arrival + the stage's transaction bytes) and empty[s] (one arrival per consumer warpgroup).
//   A consumer issues the 4 wgmmas of stage s, commits, waits until at most this group is in flight and then
//   frees the previous stage, so the tensor cores always have the next group queued.
// - Persistent: gridDim.x <= SMs blocks walk the work units (tile, k-split) with stride gridDim.x; tiles go in
//   groups of 8 row-tiles so that blocks running together share A and B in L2. The producer runs ahead into the
//   next unit while the consumers store the previous one.
// - Epilogue (no split-K, Shape::tma_c): each consumer converts its accumulators into a 128-byte-swizzled
//   64 x 128 staging buffer and one thread issues TMA stores of it (full 128-byte lines, clipped at the matrix
//   edge); the stores drain while the warpgroup runs the next unit, and the buffer is reused only after they
//   have read it (cp.async.bulk.wait_group.read). Split-K partial sums go straight from the registers.
//   The STATS kernels (BatchNorm moments of C) keep the whole staged tile until warps 1-3 of the producer
//   warpgroup have reduced it (tma_stats_warps), under the consumers' next MMAs.
// - Shared layouts are the TMA 128-byte swizzle, which is wgmma's 128B-swizzle canonical layout (as in
//   wgmma.cuh: K-major 128-byte rows, MN-major 64-element panels of 64 k-rows).
#pragma once
#include "gemm/igemm.cuh"
#include "gemm/wgmma.cuh"
#include "gemm/wgmma_n256.cuh"

namespace ig {

// A CUtensorMap (opaque 128 bytes, 64-byte aligned) passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TmaDesc {
    unsigned long long v[16];
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}
// 2-D TMA copy of the box at (c0 inner, c1 outer) into shared memory; completes `bytes` on the barrier.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaDesc* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// 2-D TMA store of the box at (c0 inner, c1 outer) from shared memory (bulk group of this thread); the
// hardware clips the part of the box outside the tensor.
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
// Prefetches the box at (c0 inner, c1 outer) into L2.
__device__ __forceinline__ void tma_prefetch_2d(const TmaDesc* map, int c0, int c1) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have finished reading shared memory (READ) or completely.
template <bool READ>
__device__ __forceinline__ void bulk_wait_all() {
    if (READ) {
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    } else {
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
}
// Waits until every bulk group of this thread but the newest has finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read_but_newest() {
    asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
}
// Barrier of the 128 threads of one warpgroup (named barrier id, 1 + the consumer index).
__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// 4-D im2col TMA copy (tensor {c, w, h, n}): pixelsPerColumn pixels of the map, starting at the window corner
// (w, h) of image n and walking the output pixels in NHW order, each channelsPerPixel channels from c; the tap
// offsets (ow, oh) shift every window. Outside the image the hardware writes zeros (the padding).
__device__ __forceinline__ void tma_load_im2col(uint32_t dst, const TmaDesc* map, int c, int w, int h, int n,
                                                unsigned short ow, unsigned short oh, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
        "%6}], [%2], {%7, %8};\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c), "r"(w), "r"(h), "r"(n), "h"(ow), "h"(oh)
        : "memory");
}

// What the producer loads: plain matrices (GEMM) or one pass of a channels-last convolution.
//  - TMA_CONV_FWD:   A = im2col(x) (M = N*P*Q pixels, 128 per box), B = w [Ko][R*S*C] K-major.
//  - TMA_CONV_DGRAD: stride 1 only. A = im2col(dy) with the flipped-kernel padding R-1-pad (M = N*H*W), B = w
//                    read MN-major at the flipped tap: B[(tap', k)][c] = w[k][R*S-1-tap'][c].
//  - TMA_CONV_WGRAD: A = dy^T (MN-major panels of dy [N*P*Q][Ko]), B = im2col(x) as MN-major panels of 64
//                    pixels x 64 channels, one tap per panel (M = Ko, N = R*S*C, K = N*P*Q).
// A 64-deep k-tile never straddles two taps: the convolution modes need the im2col channel count (C, or Ko for
// grad-input) to be a multiple of 64 (checked by the launcher).
//  - TMA_CONV_DGRAD_S: strided grad-input, one launch per phase class (Shape::ph, pw, mh, mw, r0, s0, tr, ts, as
//                    DgradA in igemm.cuh): the class's input pixels h = hh * stride + ph see only the taps
//                    r = r0 + stride * i (i < tr), and dy row hh + (ph + pad - r0) / stride - i: a stride-1
//                    correlation over dy, so A = im2col(dy) with the class's corners (made by the launcher), tap
//                    offset i' = tr - 1 - i; B = w read MN-major at tap (r0 + stride (tr-1-i'), s0 + ...). Rows
//                    (n, hh, ww) are stored straight to dx pixel (n, hh * stride + ph, ww * stride + pw).
//  - TMA_CONV_WGRAD_T: grad-weight transposed, for few output channels (Ko = 64 would leave half of a 128-row
//                    tile empty): dw^T[(r,s,c)][ko] = im2col(x)^T . dy, A = im2col(x) as MN-major panels of 64
//                    pixels x 64 channels (one tap per panel, M = R*S*C), B = dy as MN-major panels of dy
//                    [N*P*Q][Ko] (N = Ko, K = N*P*Q); the launcher transposes the small result.
constexpr int TMA_GEMM = 0, TMA_CONV_FWD = 1, TMA_CONV_DGRAD = 2, TMA_CONV_WGRAD = 3, TMA_CONV_DGRAD_S = 4,
              TMA_CONV_WGRAD_T = 5;

// The TMA kernels take map Z (after map C): lets a harness built against an older tree pass their arguments.
#define IG_TMA_HAS_MAP_Z 1

constexpr int TMA_BM = 128, TMA_KD = 64, TMA_THREADS = 384, TMA_GROUP = 8;
constexpr int TMA_A_BYTES = TMA_BM * TMA_KD * 2;
// Epilogue staging: per consumer warpgroup 64 rows x 128 columns of C (two 64 x 64 boxes, 128-byte swizzle).
constexpr int TMA_EPI_WG_BYTES = 64 * 128 * 2, TMA_EPI_BYTES = 2 * TMA_EPI_WG_BYTES;
// What a TMA kernel's epilogue adds (the EPI template argument).
// EPI_JOIN: the stored value joined with a residual gradient under a ReLU mask (ig::tma_gemm_body's store).
// EPI_GRAD_SUMS_W: the GRAD_SUMS sums taken by statistics warps from the staged tile (tma_gsums_warps; x128 and
// x64; needs map C: the launcher runs them wherever C goes through it, the GRAD_SUMS kernels elsewhere).
// EPI_JOIN_SUMS_W: EPI_JOIN, and the backward sums of the BatchNorm whose output gradient the joined value is (a
// bottleneck's last BatchNorm, no ReLU of its own: its input z3 through a fifth tensor map) taken by statistics
// warps from the joined chunks in the ring (tma_join_sums_warps).
constexpr int EPI_PLAIN = 0, EPI_MOMENTS = 1, EPI_GRAD_SUMS = 2, EPI_JOIN = 3, EPI_GRAD_SUMS_W = 4,
              EPI_JOIN_SUMS_W = 5;

// Per block-tile width BN (256: tile x256, 128: tile x128, 64: tile x64) and epilogue: stages and dynamic shared
// memory (alignment slack, the stages, the epilogue staging, the z buffers, 2 x STAGES barriers and 2 x Z_BUFS).
// The GRAD_SUMS kernels give up stages for a ring of Z_BUFS buffers of z, each one chunk of 128 rows x ZW columns
// (a unit has ZCH = BN / ZW chunks), loaded through TMA by a thread of the producer warpgroup, so that the
// epilogue reads z from shared memory instead of waiting on global loads, and the next chunk loads while the
// epilogue reads one (one buffer left the next unit's z latency exposed on the short-K shapes, whose units are
// shorter than a load): x64 six stages and two chunks of 64 columns, x128 four stages and two chunks of 128, x256
// three stages and three chunks of 64 (four a unit: three are in shared memory when the epilogue starts; with two,
// the third and fourth loaded while the epilogue waited).
// The JOIN kernels take the ring for the residual gradient b and store in place (Z_IN_PLACE): each thread writes
// its joined value over the b it read, and the chunk is TMA-stored from the ring, so they need no staging buffer;
// a buffer is free again once both consumer warpgroups' stores have read it (Z_ARRIVALS = 2: the storing thread
// of each). As the storing thread frees a buffer a chunk late, the ring holds a chunk more than the loads ahead:
// x256 three stages and five chunks of 64 (a unit's four and the next unit's first), x128 four stages and three
// chunks of 128, x64 seven stages and three chunks of 64 (with two, the x128 and x64 units, one chunk each, could
// load their b only once the unit before was stored: 11-19% slower than the staging build on an H100).
// Every kernel of a tile is launched with the largest of these sizes (TmaLaunch; crates/kernels/src/variants.rs
// repeats it), within the 227 KiB of a block.
// The JOIN_SUMS_W kernels keep the join's ring (in 64-column chunks on every tile, so that x128 holds 2.5 units of
// them) beside a ring of Z3_BUFS chunks of z3 that the statistics warps read with the joined chunk: x256 two
// stages, five chunks of b and two of z3; x128 three stages, five and two; x64 five stages, four and two. A b
// chunk is free again once both stores and the statistics warps have read it (Z_ARRIVALS = 3).
template <int BN, int EPI = EPI_PLAIN>
struct TmaCfg {
    static constexpr bool JOIN_SUMS = EPI == EPI_JOIN_SUMS_W;
    static constexpr bool IS_JOIN = EPI == EPI_JOIN || JOIN_SUMS;
    static constexpr bool Z_SMEM = EPI == EPI_GRAD_SUMS || IS_JOIN;
    static constexpr bool Z_IN_PLACE = IS_JOIN;
    // MOMENTS: the statistics are taken from the staged tile by three warps of the producer warpgroup
    // (tma_stats_warps) while the consumers go on to the next unit; the staging holds the whole tile (x256: both
    // 128-column halves, 64 KB) until those warps have read it: a stage fewer on every tile.
    // GRAD_SUMS_W: the same for the backward sums, which also read z: a whole z tile in shared memory (Z_TILE_BYTES,
    // loaded by a statistics thread once the previous unit's is read), so x256 does not fit.
    // JOIN_SUMS_W: warps 2-3 of the producer warpgroup (warp 1's first thread loads the b ring).
    static constexpr bool STATS_WARPS = EPI == EPI_MOMENTS || EPI == EPI_GRAD_SUMS_W || JOIN_SUMS;
    static_assert(EPI != EPI_GRAD_SUMS_W || BN <= 128, "GRAD_SUMS_W: x128 and x64 only");
    static constexpr int Z_TILE_BYTES = EPI == EPI_GRAD_SUMS_W ? TMA_BM * BN * 2 : 0;
    static constexpr int STAGES = JOIN_SUMS         ? (BN == 256 ? 2 : BN == 128 ? 3 : 5)
                                  : EPI == EPI_JOIN ? (BN == 256 ? 3 : BN == 128 ? 4 : 7)
                                  : Z_SMEM           ? (BN == 256 ? 3 : BN == 128 ? 4 : 6)
                                  : EPI == EPI_GRAD_SUMS_W ? (BN == 128 ? 4 : 7)
                                  : STATS_WARPS      ? (BN == 256 ? 3 : BN == 128 ? 5 : 7)
                                                     : (BN == 256 ? 4 : BN == 128 ? 6 : 8);
    static constexpr int B_BYTES = BN * TMA_KD * 2;
    static constexpr int STAGE_BYTES = TMA_A_BYTES + B_BYTES;
    static constexpr int ZW = BN == 256 || JOIN_SUMS ? 64 : BN;
    static constexpr int ZCH = BN / ZW;
    static constexpr int Z_BUFS = JOIN_SUMS         ? (BN == 64 ? 4 : 5)
                                  : EPI == EPI_JOIN ? (BN == 256 ? 5 : 3)
                                  : EPI == EPI_GRAD_SUMS ? (BN == 256 ? 3 : 2)
                                                         : 0;
    static constexpr int Z_CHUNK_BYTES = TMA_BM * ZW * 2;
    // JOIN_SUMS_W: the z3 ring (chunks as the b ring's), after it.
    static constexpr int Z3_BUFS = JOIN_SUMS ? 2 : 0;
    static constexpr int Z3_BYTES = Z3_BUFS * Z_CHUNK_BYTES;
    // Arrivals that free a z buffer: every consumer thread once it holds its values (GRAD_SUMS), or the storing
    // thread of each consumer warpgroup once its TMA store has read the chunk (JOIN).
    static constexpr int Z_ARRIVALS = JOIN_SUMS ? 3 : Z_IN_PLACE ? 2 : 256;
    static constexpr int EPI_BYTES = Z_IN_PLACE ? 0 : (STATS_WARPS && BN == 256) ? 2 * TMA_EPI_BYTES : TMA_EPI_BYTES;
    // STATS_WARPS: 4 KB after the staging where two statistics warps hand their sums to the third.
    static constexpr int HAND_BYTES = STATS_WARPS ? 4096 : 0;
    // STATS_WARPS: two more barriers, staged (the consumers' 256 threads) and read (the 96 statistics threads).
    // JOIN_SUMS_W: after those, the ztile slot, zjoined (per b buffer), z3 full (per z3 buffer).
    static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + EPI_BYTES + HAND_BYTES + Z_BUFS * Z_CHUNK_BYTES +
                                      Z_TILE_BYTES + Z3_BYTES + 2 * STAGES * 8 + 2 * Z_BUFS * 8 +
                                      (STATS_WARPS ? 16 : 0) + (Z_TILE_BYTES > 0 || JOIN_SUMS ? 8 : 0) +
                                      (JOIN_SUMS ? 8 * (Z_BUFS + Z3_BUFS) : 0);
    // Registers a thread (setmaxnreg) of the producer warpgroup and of the consumers: 128 x P + 256 x C <= 64,512.
    static constexpr int PRODUCER_REGS = STATS_WARPS ? 72 : 40, CONSUMER_REGS = STATS_WARPS ? 216 : 232;
};

// The dynamic shared memory every TMA kernel of tile width BN is launched with: the largest layout of its kernels.
template <int BN>
struct TmaLaunch {
    static constexpr int cmax(int a, int b) { return a > b ? a : b; }
    static constexpr int SMEM_BYTES = cmax(TmaCfg<BN>::SMEM_BYTES,
                                           cmax(TmaCfg<BN, EPI_GRAD_SUMS>::SMEM_BYTES, TmaCfg<BN, EPI_JOIN>::SMEM_BYTES));
    static_assert(SMEM_BYTES <= 227 * 1024, "a block has at most 227 KiB of dynamic shared memory");
};
static_assert(TmaLaunch<256>::SMEM_BYTES == 230528 && TmaLaunch<128>::SMEM_BYTES == 230512 &&
                  TmaLaunch<64>::SMEM_BYTES == 230528,
              "crates/kernels/src/variants.rs repeats these sizes");

// Work unit u -> (row tile, column tile, k-split).
__device__ __forceinline__ void tma_unit(int u, int mt, int nt, int splits, int& tm, int& tn, int& ks) {
    ks = u % splits;
    const int tile = u / splits;
    const int per_group = TMA_GROUP * nt;
    const int first = tile / per_group * TMA_GROUP;
    const int gs = min(mt - first, TMA_GROUP);
    const int r = tile % per_group;
    tm = first + r % gs;
    tn = r / gs;
}

// Work unit u -> (row tile, column tile, k-split, first k); returns its number of 64-deep k-tiles. The producer
// and the consumers walk the same units.
__device__ __forceinline__ int tma_unit_ktiles(int u, int mt, int nt, int splits, const Shape& sh, int& tm, int& tn,
                                               int& ks, int& k0) {
    tma_unit(u, mt, nt, splits, tm, tn, ks);
    k0 = ks * sh.k_split;
    const int k1 = min(sh.K, k0 + sh.k_split);
    return (k1 - k0 + TMA_KD - 1) / TMA_KD;
}

// Output pixel m of an im2col walk -> (image, top-left corner of its window in the source tensor).
template <int CONV>
__device__ __forceinline__ void tma_window(const Shape& sh, int m, int& n, int& hs, int& ws) {
    if (CONV == TMA_CONV_DGRAD_S) {
        n = m / (sh.mh * sh.mw);
        const int rem = m - n * sh.mh * sh.mw;
        const int hh = rem / sh.mw;
        hs = hh + (sh.ph + sh.pad - sh.r0) / sh.stride - (sh.tr - 1);
        ws = rem - hh * sh.mw + (sh.pw + sh.pad - sh.s0) / sh.stride - (sh.ts - 1);
        return;
    }
    const bool dg = CONV == TMA_CONV_DGRAD;
    const int oh_n = dg ? sh.h : sh.p, ow_n = dg ? sh.w : sh.q;
    const int st = dg ? 1 : sh.stride, pd = dg ? sh.r - 1 - sh.pad : sh.pad;
    n = m / (oh_n * ow_n);
    const int rem = m - n * oh_n * ow_n;
    const int oh = rem / ow_n;
    hs = oh * st - pd;
    ws = (rem - oh * ow_n) * st - pd;
}

// Where the producer stands in the reduction of a forward / grad-input unit: the window of the tile's first
// output pixel (fixed for the unit) and the (tap row, tap column, channel) of the next k-tile, advanced by
// counters instead of divisions per k-tile (a 64-deep k-tile never straddles two taps).
struct TmaPos {
    int n, hs, ws;  // image and window corner of the row tile's first pixel
    int tr, ts, c0; // tap (row, column) within the pass's taps, first channel of the k-tile
};

template <int CONV>
__device__ __forceinline__ int tma_pos_channels(const Shape& sh) {
    return CONV == TMA_CONV_FWD ? sh.c : sh.ko;  // channels of the im2col source
}
template <int CONV>
__device__ __forceinline__ int tma_pos_cols(const Shape& sh) {
    return CONV == TMA_CONV_DGRAD_S ? sh.ts : sh.s;  // taps per tap row
}

// The position at reduction index k0 of row tile tm (forward, grad-input, strided grad-input only).
template <int CONV>
__device__ __forceinline__ TmaPos tma_pos_init(const Shape& sh, int tm, int k0) {
    TmaPos p{};
    if (CONV == TMA_CONV_FWD || CONV == TMA_CONV_DGRAD || CONV == TMA_CONV_DGRAD_S) {
        tma_window<CONV>(sh, tm * TMA_BM, p.n, p.hs, p.ws);
        const int ch = tma_pos_channels<CONV>(sh), cols = tma_pos_cols<CONV>(sh);
        const int tap = k0 / ch;
        p.c0 = k0 - tap * ch;
        p.tr = tap / cols;
        p.ts = tap - p.tr * cols;
    }
    return p;
}

// Advances the position by one 64-deep k-tile.
template <int CONV>
__device__ __forceinline__ void tma_pos_next(const Shape& sh, TmaPos& p) {
    if (CONV == TMA_CONV_FWD || CONV == TMA_CONV_DGRAD || CONV == TMA_CONV_DGRAD_S) {
        p.c0 += TMA_KD;
        if (p.c0 >= tma_pos_channels<CONV>(sh)) {
            p.c0 = 0;
            if (++p.ts == tma_pos_cols<CONV>(sh)) p.ts = 0, ++p.tr;
        }
    }
}

// One k-tile (depth TMA_KD at reduction index kc; position `pos` for forward / grad-input) of work unit (tm, tn)
// into stage buffers sa / sb.
template <int CONV, bool A_KMAJOR, bool B_KMAJOR, int BN>
__device__ __forceinline__ void tma_produce(const TmaDesc* ta, const TmaDesc* tb, const Shape& sh, int tm, int tn,
                                            int kc, const TmaPos& pos, uint32_t sa, uint32_t sb, uint32_t full) {
    if (CONV == TMA_GEMM) {
        if (A_KMAJOR) {
            tma_load_2d(sa, ta, kc, tm * TMA_BM, full);
        } else {
#pragma unroll
            for (int p = 0; p < TMA_BM / 64; ++p) tma_load_2d(sa + p * 8192, ta, tm * TMA_BM + 64 * p, kc, full);
        }
        if (B_KMAJOR) {
            tma_load_2d(sb, tb, kc, tn * BN, full);
        } else {
#pragma unroll
            for (int p = 0; p < BN / 64; ++p) tma_load_2d(sb + p * 8192, tb, tn * BN + 64 * p, kc, full);
        }
    } else if (CONV == TMA_CONV_FWD || CONV == TMA_CONV_DGRAD) {
        tma_load_im2col(sa, ta, pos.c0, pos.ws, pos.hs, pos.n, (unsigned short)pos.ts, (unsigned short)pos.tr, full);
        if (CONV == TMA_CONV_FWD) {
            tma_load_2d(sb, tb, kc, tn * BN, full);
        } else {
            const int tap = pos.tr * sh.s + pos.ts;
            const int col = (sh.r * sh.s - 1 - tap) * sh.c + tn * BN;  // flipped tap; columns past C are unused
#pragma unroll
            for (int p = 0; p < BN / 64; ++p) tma_load_2d(sb + p * 8192, tb, col + 64 * p, pos.c0, full);
        }
    } else if (CONV == TMA_CONV_DGRAD_S) {
        // tap (i', j') = (pos.tr, pos.ts) of the class's tr x ts taps
        tma_load_im2col(sa, ta, pos.c0, pos.ws, pos.hs, pos.n, (unsigned short)pos.ts, (unsigned short)pos.tr, full);
        const int r = sh.r0 + sh.stride * (sh.tr - 1 - pos.tr), s = sh.s0 + sh.stride * (sh.ts - 1 - pos.ts);
        const int col = (r * sh.s + s) * sh.c + tn * BN;  // columns past C are unused
#pragma unroll
        for (int p = 0; p < BN / 64; ++p) tma_load_2d(sb + p * 8192, tb, col + 64 * p, pos.c0, full);
    } else {  // TMA_CONV_WGRAD, TMA_CONV_WGRAD_T: the im2col(x) panels are B's columns, or A's rows (transposed)
        constexpr bool T_ = CONV == TMA_CONV_WGRAD_T;
        constexpr int DY_PANELS = T_ ? BN / 64 : TMA_BM / 64, X_PANELS = T_ ? TMA_BM / 64 : BN / 64;
        const uint32_t sdy = T_ ? sb : sa, sx = T_ ? sa : sb;
        const int dy0 = T_ ? tn * BN : tm * TMA_BM, x0 = T_ ? tm * TMA_BM : tn * BN;
#pragma unroll
        for (int p = 0; p < DY_PANELS; ++p) tma_load_2d(sdy + p * 8192, T_ ? tb : ta, dy0 + 64 * p, kc, full);
        int n, hs, ws;
        tma_window<TMA_CONV_WGRAD>(sh, kc, n, hs, ws);
        const int taps = sh.r * sh.s;
#pragma unroll
        for (int p = 0; p < X_PANELS; ++p) {
            const int col = x0 + 64 * p;
            int tap = col / sh.c, c0 = col - tap * sh.c;
            if (tap >= taps) tap = taps - 1, c0 = 0;  // columns (rows) past R*S*C: any data, never stored
            const int r = tap / sh.s, s = tap - r * sh.s;
            tma_load_im2col(sx + p * 8192, T_ ? ta : tb, c0, ws, hs, n, (unsigned short)s, (unsigned short)r, full);
        }
    }
}

// Bias of output columns col and col + 1 (zero without bias or past N).
template <typename T>
__device__ __forceinline__ void tma_bias2(const Shape& sh, const T* bias, int col, float& b0, float& b1) {
    b0 = 0.f, b1 = 0.f;
    if (sh.has_bias && col < sh.N) {
        b0 = to_f(bias[col]);
        if (col + 1 < sh.N) b1 = to_f(bias[col + 1]);
    }
}

template <int BN, int TA, int TB, typename T>
__device__ __forceinline__ void tma_wgmma(float (&acc)[BN / 2], uint64_t da, uint64_t db, T t) {
    if constexpr (BN == 256) {
        wgmma_n256<TA, TB>(acc, da, db, t);
    } else if constexpr (BN == 128) {
        wgmma_n128<TA, TB>(acc, da, db, t);
    } else {
        wgmma_n64<TA, TB>(acc, da, db, t);
    }
}

// Barrier of the 256 consumer threads (both consumer warpgroups; named barrier 3).
__device__ __forceinline__ void consumers_bar() { asm volatile("bar.sync 3, 256;\n" ::: "memory"); }

// The value of an accumulator as the epilogue stores it (rounded to T).
template <typename T>
__device__ __forceinline__ float stored(float v) {
    return to_f(from_f<T>(v));
}

// Reduce-scatter over the 8 lanes of a warp that share lane % 4 (they hold the same columns, rows lane / 4 and
// lane / 4 + 8 of the warp's 16): in, each lane's v[0..8) of one group of 8 values; out, in v[0] of lane l, the
// sum over the 8 lanes of value (l >> 2) & 7. Three exchanges (xor 16, 8, 4), each halving the values a lane
// keeps: 7 shuffles per 8 values instead of 24 for reducing each value on its own. Fixed order: deterministic.
__device__ __forceinline__ void rs_sum8(float (&v)[8], int lane) {
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const int mask = 16 >> s, half = 4 >> s;
        const bool hi = (lane & mask) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float keep = hi ? v[half + i] : v[i], send = hi ? v[i] : v[half + i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
        }
    }
}

// Chan et al.'s merge weights for the three exchanges of rs_moments8, from this lane's row count n (0, 1 or 2):
// with a the lane's running set and b its partner's, fb = n_b / (n_a + n_b) and w = n_a n_b / (n_a + n_b).
struct MergeW {
    float fb[3], w[3];
};

__device__ __forceinline__ MergeW merge_weights(float n) {
    MergeW m;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const float nb = __shfl_xor_sync(0xffffffffu, n, 16 >> s);
        const float nt = n + nb;
        m.fb[s] = nt > 0.f ? nb / nt : 0.f;
        m.w[s] = nt > 0.f ? n * nb / nt : 0.f;
        n = nt;
    }
    return m;
}

// rs_sum8 for moments: (mean, sum of squared deviations from it) pairs merged pairwise (Chan et al.: exact
// whatever the mean, no cancellation), each lane's set weighted by its row count.
__device__ __forceinline__ void rs_moments8(float (&mean)[8], float (&m2)[8], const MergeW& mw, int lane) {
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const int mask = 16 >> s, half = 4 >> s;
        const bool hi = (lane & mask) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float km = hi ? mean[half + i] : mean[i], kq = hi ? m2[half + i] : m2[i];
            const float sm = hi ? mean[i] : mean[half + i], sq = hi ? m2[i] : m2[half + i];
            const float d = __shfl_xor_sync(0xffffffffu, sm, mask) - km;
            const float rq = __shfl_xor_sync(0xffffffffu, sq, mask);
            mean[i] = fmaf(d, mw.fb[s], km);
            m2[i] = fmaf(d * d, mw.w[s], kq + rq);
        }
    }
}

// Column (within the unit's BN) of value q = (lane >> 2) & 7 of group g after rs_sum8 / rs_moments8: group g holds
// fragments 4 g .. 4 g + 3 (value 2 jj + e: fragment 4 g + jj, column 2 (lane % 4) + e of its 8).
__device__ __forceinline__ int rs_col(int g, int lane) {
    const int q = (lane >> 2) & 7;
    return 8 * (4 * g + (q >> 1)) + 2 * (lane & 3) + (q & 1);
}

// The exchange of both epilogue reductions: once the previous unit's TMA stores have read the staging buffer,
// each lane's G reduced pairs (a, b) go to red[w8 * BN + col] and red[(8 + w8) * BN + col] (col = rs_col), and
// the 256 consumers meet, so that red holds every warp's values per column.
template <int G, int BN>
__device__ __forceinline__ void stage_pairs(const float (&a)[G], const float (&b)[G], float* red, int w8, int lane) {
    if ((threadIdx.x & 127) == 0) bulk_wait_all<true>();
    consumers_bar();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int col = rs_col(g, lane);
        red[w8 * BN + col] = a[g];
        red[(8 + w8) * BN + col] = b[g];
    }
    consumers_bar();
}

// BatchNorm statistics in the epilogue (the STATS kernels: the forward convolutions and 1x1 GEMMs whose output a
// training-mode BatchNorm normalises next, so that no separate pass reads the output again for its moments).
// Per unit (row tile tm, column tile tn; no split-K), over the tile's rows [128 tm, 128 tm + 128) clipped at M,
// from the values as stored: part[tm * N + col] = S = sum of x and part[(chunks + tm) * N + col] = M2 = the sum
// of squared deviations from the tile's own mean, chunks = ceil(M / 128); row tile 0 also writes the shift K = 0
// at part[2 chunks N + col]. That is the layout of bn_nhwc_moments_v8's partials with 128 rows per chunk
// (kernels/batchnorm/02_nhwc_vec.cu), which bn_nhwc_moments_final combines (Chan et al.) and turns into the
// statistics and the running update.
// Reduction, as (count, mean, M2) triples merged with Chan et al.'s formula (exact in FP32 whatever the mean):
// a thread's two rows per column, then the 8 lanes sharing a column set by reduce-scatter (rs_moments8: 14
// shuffles per 8 columns, 7 for the means and 7 for the M2s, plus merge_weights' 3 per unit), then the 8 consumer warps in shared memory (the epilogue staging buffers, once the
// previous unit's TMA stores have read them), in a fixed order: deterministic. The register work runs before
// the wait for those stores.
template <typename T, int BN>
__device__ __forceinline__ void tma_epilogue_stats(const float (&acc)[BN / 2], float* __restrict__ part,
                                                   const Shape& sh, int tm, int tn, int cw, float* red) {
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, w8 = cw * 4 + warp;
    const int ct = threadIdx.x - 128;  // 0 .. 255 over the consumers
    const int M = sh.M, N = sh.N, r0 = tm * TMA_BM;
    const int row = r0 + 16 * w8 + (lane >> 2);
    const bool v0 = row < M, v1 = row + 8 < M;  // v1 implies v0
    const MergeW mw = merge_weights((float)(v0 + v1));
    constexpr int G = BN / 32;  // groups of 8 values: 4 fragments x 2 columns
    float gm[G], gq[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mean[8], m2[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int j = 4 * g + (i >> 1), e = i & 1;
            const float x0 = stored<T>(acc[4 * j + e]), x1 = stored<T>(acc[4 * j + 2 + e]);
            const float d = x0 - x1;
            mean[i] = v1 ? 0.5f * (x0 + x1) : (v0 ? x0 : 0.f);
            m2[i] = v1 ? 0.5f * d * d : 0.f;
        }
        rs_moments8(mean, m2, mw, lane);
        gm[g] = mean[0];
        gq[g] = m2[0];
    }
    stage_pairs<G, BN>(gm, gq, red, w8, lane);
    const int chunks = (M + TMA_BM - 1) / TMA_BM;
    for (int col = ct; col < BN; col += 256) {
        const int gc = tn * BN + col;
        if (gc < N) {
            float cnt = 0.f, mean = 0.f, m2 = 0.f;
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                const float nw = (float)max(0, min(16, M - (r0 + 16 * w)));
                if (nw > 0.f) {
                    const float nt = cnt + nw, d = red[w * BN + col] - mean;
                    mean = fmaf(d, nw / nt, mean);
                    m2 += fmaf(d * d, cnt * nw / nt, red[(8 + w) * BN + col]);
                    cnt = nt;
                }
            }
            part[(size_t)tm * N + gc] = mean * cnt;
            part[(size_t)(chunks + tm) * N + gc] = m2;
            if (tm == 0) part[(size_t)2 * chunks * N + gc] = 0.f;
        }
    }
    // The staging buffer is written next (or by the next unit's statistics) only after every thread has read it.
    consumers_bar();
}

// The statistics warps' hand-over (warps 1-3 of the producer warpgroup, w = 0 .. 2; called once all three have met
// at named barrier 4 after their last read of the tile): warps 1 and 2 store their V sums a and V sums b in the
// 4 KB after the staging (hand; 8 V bytes a lane, 256 V a warp), the three meet again, and warp 3 adds them to its
// own, warp 1's then warp 2's (a fixed order). Every thread arrives on read once it reads nothing of the tile or
// the hand-over any more. Returns whether this thread holds the totals (warp 3).
template <int V>
__device__ __forceinline__ bool stats_hand_over(float (&a)[V], float (&b)[V], uint32_t hand, uint32_t read, int w,
                                                int lane) {
    static_assert(V % 4 == 0, "whole 16-byte stores");
    if (w < 2) {
        const uint32_t to = hand + w * 256 * V + lane * 8 * V;
#pragma unroll
        for (int e = 0; e < V / 4; ++e) {
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(to + 16 * e), "f"(a[4 * e]),
                         "f"(a[4 * e + 1]), "f"(a[4 * e + 2]), "f"(a[4 * e + 3])
                         : "memory");
        }
#pragma unroll
        for (int e = 0; e < V / 4; ++e) {
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(to + 4 * V + 16 * e), "f"(b[4 * e]),
                         "f"(b[4 * e + 1]), "f"(b[4 * e + 2]), "f"(b[4 * e + 3])
                         : "memory");
        }
    }
    asm volatile("bar.sync 4, 96;\n" ::: "memory");
    if (w < 2) {
        mbar_arrive(read);
        return false;
    }
#pragma unroll
    for (int o = 0; o < 2; ++o) {
        float h[2 * V];
        const uint32_t from = hand + o * 256 * V + lane * 8 * V;
#pragma unroll
        for (int e = 0; e < V / 2; ++e)
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(h[4 * e]), "=f"(h[4 * e + 1]), "=f"(h[4 * e + 2]), "=f"(h[4 * e + 3])
                         : "r"(from + 16 * e)
                         : "memory");
#pragma unroll
        for (int c = 0; c < V; ++c) {
            a[c] += h[c];
            b[c] += h[V + c];
        }
    }
    mbar_arrive(read);  // the tile and the hand-over read
    return true;
}

// The MOMENTS kernels' statistics, taken by warps 1-3 of the producer warpgroup (96 threads; warp 0 holds the
// TMA thread) from the tile the consumers staged for their TMA store, so that the consumers go straight on to the
// next unit's MMAs and the reduction runs under them (the consumers' own epilogue reduction, tma_epilogue_stats,
// left the tensor cores idle through it: +15-110% on the short-K shapes). Per unit: wait until both consumer
// warpgroups have staged the tile (barrier staged, phase zu), reduce it, arrive on barrier read once nothing of
// it is read any more (the consumers wait on that before staging the next unit), and write the partials as
// tma_epilogue_stats does: part[tm N + col] = S, part[(chunks + tm) N + col] = M2 about the tile's mean, K = 0 from
// row tile 0. The staging: rows [0, 64) and [64, 128) of the tile are the two warpgroups' buffers,
// TMA_EPI_WG_BYTES apart, 128-column halves (x256) 2 TMA_EPI_WG_BYTES apart, each two 64 x 64 boxes with the
// 128-byte swizzle (16-byte chunk j of row r at (j ^ (r % 8)) 16).
// Lane l of warp w takes the 8 columns of chunk l % (BN / 8) over the rows R = g + G i, g = LPC (w - 1) + l / (BN /
// 8), G = 3 LPC, LPC = 256 / BN lanes a chunk (a quarter warp reads 8 chunks of one row: no bank conflicts).
// One pass of shifted sums, the shift K_c the tile's row 0 (d = x - K_c: sum d and sum d^2, additive across
// threads, M2 = sum d^2 - (sum d)^2 / n; K_c is a value of the column, so |mean - K_c| is of the order of the
// column's spread and the cancellation small), in FP32 and in a fixed order (deterministic): warps 1 and 2 hand
// their sums to warp 3 through the 4 KB after the staging (TmaCfg::HAND_BYTES; not the tile itself, which the TMA
// stores may still be reading) between two named barriers (4), and warp 3 adds them to its own and then its LPC
// lanes a chunk. The values are those the TMA store writes (as stored in T), rows
// past M left out.
template <typename T, int BN, int EPI_BYTES>
__device__ __forceinline__ void tma_stats_warps(uint32_t epi, uint32_t staged, uint32_t read, float* __restrict__ part,
                                                const Shape& sh, int units, int mt, int nt) {
    constexpr int CH = BN / 8, LPC = 32 / CH, G = 3 * LPC;
    const int w = (threadIdx.x >> 5) - 1, lane = threadIdx.x & 31;  // w: 0 .. 2
    const int chunk = lane % CH, g = LPC * w + lane / CH;
    const int half = chunk >> 4, box = (chunk >> 3) & 1, j = chunk & 7;
    const uint32_t base = epi + half * 2 * TMA_EPI_WG_BYTES + box * 8192;
    const int M = sh.M, N = sh.N, chunks = (M + TMA_BM - 1) / TMA_BM;
    // The 8 values of this thread's chunk in tile row R (0 .. 127).
    auto load8 = [&](int R, float (&v)[8]) {
        const int r = R & 63;
        const uint32_t addr = base + (R >> 6) * TMA_EPI_WG_BYTES + r * 128 + ((j ^ (r & 7)) << 4);
        uint32_t q[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3])
                     : "r"(addr));  // ordered after mbar_wait's asm (both volatile)
#pragma unroll
        for (int e = 0; e < 4; ++e) unpack2<T>(q[e], v[2 * e], v[2 * e + 1]);
    };
    int zu = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x, ++zu) {
        int tm, tn, ks;
        tma_unit(u, mt, nt, 1, tm, tn, ks);
        const int rows = min(TMA_BM, M - tm * TMA_BM);
        mbar_wait(staged, zu & 1);
        float k[8], sd[8], sq[8];
        load8(0, k);
#pragma unroll
        for (int c = 0; c < 8; ++c) sd[c] = sq[c] = 0.f;
#pragma unroll 2
        for (int R = g; R < rows; R += G) {
            float v[8];
            load8(R, v);
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                const float d = v[c] - k[c];
                sd[c] += d;
                sq[c] = fmaf(d, d, sq[c]);
            }
        }
        // Every read of the tile done: warps 1 and 2 hand their sums to warp 3.
        asm volatile("bar.sync 4, 96;\n" ::: "memory");
        if (!stats_hand_over<8>(sd, sq, epi + EPI_BYTES, read, w, lane)) continue;
#pragma unroll
        for (int m = CH; m < 32; m <<= 1)
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                sd[c] += __shfl_xor_sync(0xffffffffu, sd[c], m);
                sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], m);
            }
        const int gc = tn * BN + 8 * chunk;
        if (lane < CH && gc < N) {  // N % 8 == 0: the chunk's 8 columns are all in or all out
            const float n = (float)rows, inv = 1.f / n;
            float S[8], Q[8];
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                S[c] = fmaf(n, k[c], sd[c]);
                Q[c] = fmaxf(0.f, fmaf(-sd[c] * inv, sd[c], sq[c]));
            }
            float4* ps = reinterpret_cast<float4*>(part + (size_t)tm * N + gc);
            float4* pq = reinterpret_cast<float4*>(part + (size_t)(chunks + tm) * N + gc);
            ps[0] = make_float4(S[0], S[1], S[2], S[3]);
            ps[1] = make_float4(S[4], S[5], S[6], S[7]);
            pq[0] = make_float4(Q[0], Q[1], Q[2], Q[3]);
            pq[1] = make_float4(Q[4], Q[5], Q[6], Q[7]);
            if (tm == 0) {
                float4* pk = reinterpret_cast<float4*>(part + (size_t)2 * chunks * N + gc);
                pk[0] = pk[1] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
}

// The GRAD_SUMS_W kernels' backward sums (EPI_GRAD_SUMS_W: x128 and x64), taken as tma_stats_warps takes the
// moments: warps 1-3 of the producer warpgroup read the stored gradient g from the staged tile and z from a whole
// z tile in shared memory (zt: (row half, 64-column box) boxes of 8 KB, 128-byte swizzle, as the staging), and the
// consumers only stage and store. Thread 32 loads each unit's z tile through map Z (barrier zfull, phase zu): the
// block's first at the start, each next one as soon as the three warps have read the tile before it, so the load
// runs under the consumers' MMAs. Per element, the arithmetic of tma_epilogue_grad_sums (the ReLU mask of
// bn(z) = (z - mean) invstd w + b, then g and g xhat summed); per unit, part[tm N + col] = sum g and
// part[(chunks + tm) N + col] = sum g xhat. A thread takes 4 columns (8 bytes of g and of z a row; a quarter warp
// reads 4 chunks of one row: no bank conflicts) over rows R = g0 + G i (G = 3 LPC, LPC = 128 / BN lanes a column
// quad); the sums go to warp 3 through the 4 KB after the staging, and then across its LPC lanes, in a fixed order.
template <typename T, int BN, int EPI_BYTES>
__device__ __forceinline__ void tma_gsums_warps(uint32_t epi, uint32_t staged, uint32_t read, uint32_t zt,
                                                uint32_t zfull, const TmaDesc* tz, float* __restrict__ part,
                                                const Shape& sh, int units, int mt, int nt) {
    constexpr int CQ = BN / 4, LPC = 32 / CQ, G = 3 * LPC, CB = BN / 64;
    const int w = (threadIdx.x >> 5) - 1, lane = threadIdx.x & 31;  // w: 0 .. 2
    const int quad = lane % CQ, g0 = LPC * w + lane / CQ;
    const int box = quad >> 4, jc = (quad >> 1) & 7, sub = quad & 1;  // column 4 quad = 64 box + 8 jc + 4 sub
    const int M = sh.M, N = sh.N, chunks = (M + TMA_BM - 1) / TMA_BM;
    // The z tile of unit u (thread 32 only).
    auto load_z = [&](int u) {
        int tm, tn, ks;
        tma_unit(u, mt, nt, 1, tm, tn, ks);
        mbar_expect_tx(zfull, TMA_BM * BN * 2);
#pragma unroll
        for (int b = 0; b < 2 * CB; ++b)
            tma_load_2d(zt + b * 8192, tz, tn * BN + 64 * (b % CB), tm * TMA_BM + 64 * (b / CB), zfull);
    };
    if (threadIdx.x == 32 && (int)blockIdx.x < units) load_z(blockIdx.x);
    // The 4 values at tile row R of the buffer at base (row halves half_stride apart, boxes box_stride apart).
    auto load4 = [&](uint32_t base, int half_stride, int box_stride, int R, float (&v)[4]) {
        const int r = R & 63;
        const uint32_t addr =
            base + (R >> 6) * half_stride + box * box_stride + r * 128 + ((jc ^ (r & 7)) << 4) + (sub << 3);
        uint32_t q[2];
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(q[0]), "=r"(q[1]) : "r"(addr));
#pragma unroll
        for (int e = 0; e < 2; ++e) unpack2<T>(q[e], v[2 * e], v[2 * e + 1]);
    };
    int zu = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x, ++zu) {
        int tm, tn, ks;
        tma_unit(u, mt, nt, 1, tm, tn, ks);
        const int rows = min(TMA_BM, M - tm * TMA_BM);
        const int gc = tn * BN + 4 * quad;
        // This thread's 4 channels (N % 8 == 0: all in or all out; out: any finite constants, nothing written).
        float mean[4], invstd[4], sc[4], bb[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int ch = gc < N ? gc + c : 0;
            mean[c] = sh.bn_stats[ch];
            invstd[c] = sh.bn_stats[2 * N + ch];
            sc[c] = invstd[c] * sh.bn_weight[ch];
            bb[c] = sh.bn_bias[ch];
        }
        mbar_wait(staged, zu & 1);
        mbar_wait(zfull, zu & 1);
        float sg[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
        for (int R = g0; R < rows; R += G) {
            float gv[4], zv[4];
            load4(epi, TMA_EPI_WG_BYTES, 8192, R, gv);
            load4(zt, CB * 8192, 8192, R, zv);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float gm = !(fmaf(zv[c] - mean[c], sc[c], bb[c]) >= 0.f) ? 0.f : gv[c];
                sg[c] += gm;
                sx[c] = fmaf(gm, (zv[c] - mean[c]) * invstd[c], sx[c]);
            }
        }
        // Every read of the staging and of the z tile done: the next unit's z may load, and warps 1 and 2 leave
        // their sums in the 4 KB after the staging for warp 3.
        asm volatile("bar.sync 4, 96;\n" ::: "memory");
        if (threadIdx.x == 32 && u + (int)gridDim.x < units) load_z(u + gridDim.x);
        if (!stats_hand_over<4>(sg, sx, epi + EPI_BYTES, read, w, lane)) continue;
#pragma unroll
        for (int m = CQ; m < 32; m <<= 1)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                sg[c] += __shfl_xor_sync(0xffffffffu, sg[c], m);
                sx[c] += __shfl_xor_sync(0xffffffffu, sx[c], m);
            }
        if (lane < CQ && gc < N) {
            *reinterpret_cast<float4*>(part + (size_t)tm * N + gc) = make_float4(sg[0], sg[1], sg[2], sg[3]);
            *reinterpret_cast<float4*>(part + (size_t)(chunks + tm) * N + gc) = make_float4(sx[0], sx[1], sx[2], sx[3]);
        }
    }
}

// The JOIN_SUMS_W kernels' backward sums of the BatchNorm whose output gradient the joined value g is (a
// bottleneck's last BatchNorm, without a ReLU of its own: the join's mask is the block output's ReLU): per column,
// sum g and sum g xhat, xhat = (z3 - mean) invstd with the statistics (3, N) in Shape::bn_stats. Warps 2-3 of the
// producer warpgroup (64 threads) walk the block's chunks (128 rows x 64 columns, the b ring's order q) as the
// consumers join them: chunk q's joined values lie in b buffer q % ZB once zjoined + 8 (q % ZB) has completed
// phase (q / ZB) & 1 (the storing thread of each consumer warpgroup arrives after its warpgroup's writes), and its
// z3 in z3 buffer q % Z3B, loaded through map Z3 by thread 64 (the first Z3B chunks at the start, chunk q + Z3B as
// soon as the warps have read chunk q). Thread t (0 .. 63) takes column quad t % 16 (8 bytes of each buffer a row:
// a half warp reads one whole 128-byte row, conflict-free) and rows t / 16 + 4 i, clipped at M. After the reads
// thread 64 frees the b buffer (the third arrival on its zempty), the lanes sharing a quad add their sums
// (shuffle), warp 2 hands its sums to warp 3 through the 512 bytes at hand, and warp 3 writes
// part[tm N + col] = sum g and part[(chunks + tm) N + col] = sum g xhat for the chunk's columns: the sums pass's
// partial layout, in a fixed order.
template <typename T, int BN, int ZB, int Z3B>
__device__ __forceinline__ void tma_join_sums_warps(uint32_t zbuf, uint32_t z3buf, uint32_t zjoined, uint32_t z3full,
                                                    uint32_t zempty, uint32_t hand, const TmaDesc* tz3,
                                                    float* __restrict__ part, const Shape& sh, int units, int mt,
                                                    int nt) {
    constexpr int ZW = 64, ZCH = BN / ZW, CHUNK = TMA_BM * ZW * 2;
    const int t = threadIdx.x - 64;
    const int quad = t & 15, rg = t >> 4, jc = quad >> 1, sub = quad & 1;
    const int M = sh.M, N = sh.N, chunks = (M + TMA_BM - 1) / TMA_BM;
    const int mine = (int)blockIdx.x < units ? (units - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int nq = mine * ZCH;  // this block's chunks
    // Chunk q -> its row tile and first column.
    auto coords = [&](int q, int& tm, int& c0) {
        int tn, ks;
        tma_unit((int)blockIdx.x + (q / ZCH) * (int)gridDim.x, mt, nt, 1, tm, tn, ks);
        c0 = tn * BN + ZW * (q % ZCH);
    };
    // Chunk q of z3 into its buffer (thread 64 only): two boxes of 64 rows.
    auto load_z3 = [&](int q) {
        int tm, c0;
        coords(q, tm, c0);
        const uint32_t bar = z3full + 8 * (q % Z3B), dst = z3buf + (q % Z3B) * CHUNK;
        mbar_expect_tx(bar, CHUNK);
        tma_load_2d(dst, tz3, c0, tm * TMA_BM, bar);
        tma_load_2d(dst + 8192, tz3, c0, tm * TMA_BM + 64, bar);
    };
    if (threadIdx.x == 64)
        for (int q = 0; q < Z3B && q < nq; ++q) load_z3(q);
    for (int q = 0; q < nq; ++q) {
        int tm, c0;
        coords(q, tm, c0);
        const int rows = min(TMA_BM, M - tm * TMA_BM);
        const int gc = c0 + 4 * quad;
        // This thread's 4 channels (N % 32 == 0: all in or all out; out: any finite constants, nothing written).
        float mean[4], invstd[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int ch = gc < N ? gc + c : 0;
            mean[c] = sh.bn_stats[ch];
            invstd[c] = sh.bn_stats[2 * N + ch];
        }
        const int zb = q % ZB, z3b = q % Z3B;
        mbar_wait(zjoined + 8 * zb, (q / ZB) & 1);
        mbar_wait(z3full + 8 * z3b, (q / Z3B) & 1);
        const uint32_t gbase = zbuf + zb * CHUNK, zbase = z3buf + z3b * CHUNK;
        float sg[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int R = rg; R < rows; R += 4) {
            const int r = R & 63;
            const uint32_t off = (R >> 6) * 8192 + r * 128 + ((jc ^ (r & 7)) << 4) + (sub << 3);
            uint32_t gq[2], zq[2];
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(gq[0]), "=r"(gq[1]) : "r"(gbase + off));
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(zq[0]), "=r"(zq[1]) : "r"(zbase + off));
            float gv[4], zv[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                unpack2<T>(gq[e], gv[2 * e], gv[2 * e + 1]);
                unpack2<T>(zq[e], zv[2 * e], zv[2 * e + 1]);
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                sg[c] += gv[c];
                sx[c] = fmaf(gv[c], (zv[c] - mean[c]) * invstd[c], sx[c]);
            }
        }
        // Every read of the two buffers done: the b buffer may be refilled, the z3 buffer takes chunk q + Z3B.
        asm volatile("bar.sync 5, 64;\n" ::: "memory");
        if (threadIdx.x == 64) {
            mbar_arrive(zempty + 8 * zb);
            if (q + Z3B < nq) load_z3(q + Z3B);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            sg[c] += __shfl_xor_sync(0xffffffffu, sg[c], 16);
            sx[c] += __shfl_xor_sync(0xffffffffu, sx[c], 16);
        }
        // (Warp 3 read the hand-over of chunk q - 1 before it arrived at the barrier above.)
        if (t < 16) {
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(hand + 32 * t), "f"(sg[0]), "f"(sg[1]),
                         "f"(sg[2]), "f"(sg[3])
                         : "memory");
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(hand + 32 * t + 16), "f"(sx[0]),
                         "f"(sx[1]), "f"(sx[2]), "f"(sx[3])
                         : "memory");
        }
        asm volatile("bar.sync 5, 64;\n" ::: "memory");
        if (t >= 32 && t < 48 && gc < N) {
            float h[8];
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(h[0]), "=f"(h[1]), "=f"(h[2]), "=f"(h[3])
                         : "r"(hand + 32 * quad)
                         : "memory");
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(h[4]), "=f"(h[5]), "=f"(h[6]), "=f"(h[7])
                         : "r"(hand + 32 * quad + 16)
                         : "memory");
            *reinterpret_cast<float4*>(part + (size_t)tm * N + gc) =
                make_float4(h[0] + sg[0], h[1] + sg[1], h[2] + sg[2], h[3] + sg[3]);
            *reinterpret_cast<float4*>(part + (size_t)(chunks + tm) * N + gc) =
                make_float4(h[4] + sx[0], h[5] + sx[1], h[6] + sx[2], h[7] + sx[3]);
        }
    }
}

// Two consecutive values of T (4-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load_pair(const T* p, float& a, float& b) {
    struct alignas(2 * sizeof(T)) P2 {
        T v[2];
    };
    const P2 v = *reinterpret_cast<const P2*>(p);
    a = to_f(v.v[0]);
    b = to_f(v.v[1]);
}

// The BatchNorm backward sums in the epilogue (the GRAD_SUMS kernels: the grad-input passes whose output is the
// gradient at a BatchNorm + ReLU's output, so that the sums pass need not read it again). Per unit (no split-K),
// over its 128 rows clipped at M, per column: g = the stored value where that BatchNorm's pre-activation
// bn(z) = (z - mean) invstd weight + bias is >= 0 (else 0: the ReLU mask, as kernels/batchnorm's grad_of takes it),
// xhat = (z - mean) invstd, z read at the same place (z is C-shaped, row-major; pairs of columns in one 4-byte
// load, the per-channel tensors in 8-byte loads: N even and the bases aligned, checked by the launcher);
// part[tm * N + col] = sum g and part[(chunks + tm) * N + col] = sum g xhat, chunks = ceil(M / 128): the partial
// layout of the sums pass, which bn_nhwc_bwd_final_v8 reduces. Reduction: the 8 lanes sharing a column set by
// reduce-scatter (rs_sum8), then the 8 consumer warps in the staging buffers, in a fixed order.
// ZS: z comes from a ring of ZBUFS shared-memory buffers of one chunk each (TmaCfg::Z_SMEM): chunk q of the
// block (the unit's first is zq0, then one per ZW = TmaCfg::ZW columns) lies in buffer b = q % ZBUFS at
// zs + b Z_CHUNK_BYTES, as 64 x 64 boxes, box (row half, column box) at 8192 (ZW / 64 rh + cb), 128-byte swizzle as
// the C staging; it is ready once barrier zfull + 8 b has completed phase q / ZBUFS. Every consumer thread arrives
// on zempty + 8 b (256 arrivals) once it has that chunk's values in registers, which frees the buffer for chunk
// q + ZBUFS. Same values, same arithmetic: bit for bit the global loads' sums.
template <typename T, int BN, bool ZS = false, int ZBUFS = 1>
__device__ __forceinline__ void tma_epilogue_grad_sums(const float (&acc)[BN / 2], float* __restrict__ part,
                                                       const T* __restrict__ z, const Shape& sh, int tm, int tn,
                                                       int cw, float* red, uint32_t zs = 0, uint32_t zfull = 0,
                                                       uint32_t zempty = 0, int zq0 = 0) {
    constexpr int ZW = TmaCfg<BN, EPI_GRAD_SUMS>::ZW, ZGROUPS = ZW / 32, ZBOXES = ZW / 64;  // per chunk: groups, boxes
    int zb = 0;  // ZS: the buffer of the chunk being read
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, w8 = cw * 4 + warp;
    const int ct = threadIdx.x - 128;
    const int M = sh.M, N = sh.N;
    const int row = tm * TMA_BM + 16 * w8 + (lane >> 2);
    const bool valid[2] = {row < M, row + 8 < M};
    constexpr int G = BN / 32;
    float gs[G], gx[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float sg[8], sgx[8];
        if constexpr (ZS) {
            if (g % ZGROUPS == 0) {
                const int q = zq0 + g / ZGROUPS;
                zb = q % ZBUFS;
                mbar_wait(zfull + 8 * zb, (q / ZBUFS) & 1);
            }
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const int j = 4 * g + jj;
            const int col = tn * BN + 8 * j + 2 * (lane & 3);  // even; N % 8 == 0, so col + 1 < N with col
            float s0 = 0.f, s1 = 0.f, x0s = 0.f, x1s = 0.f;
            if (col < N) {
                const float2 mean = *reinterpret_cast<const float2*>(sh.bn_stats + col);
                const float2 invstd = *reinterpret_cast<const float2*>(sh.bn_stats + 2 * N + col);
                const float2 w = *reinterpret_cast<const float2*>(sh.bn_weight + col);
                const float2 b = *reinterpret_cast<const float2*>(sh.bn_bias + col);
                const float sc0 = invstd.x * w.x, sc1 = invstd.y * w.y;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (valid[h]) {
                        float z0, z1;
                        if constexpr (ZS) {
                            const int r = 16 * warp + (lane >> 2) + 8 * h;  // row within the warpgroup's 64
                            const uint32_t addr = zs + zb * (TMA_BM * ZW * 2) +
                                                  (ZBOXES * cw + ((j >> 3) & (ZBOXES - 1))) * 8192 + r * 128 +
                                                  (((j & 7) ^ (r & 7)) << 4) + ((lane & 3) << 2);
                            uint32_t v;
                            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
                            unpack2<T>(v, z0, z1);
                        } else {
                            load_pair(z + (size_t)(row + 8 * h) * N + col, z0, z1);
                        }
                        const float g0 = !(fmaf(z0 - mean.x, sc0, b.x) >= 0.f) ? 0.f : stored<T>(acc[4 * j + 2 * h]);
                        const float g1 =
                            !(fmaf(z1 - mean.y, sc1, b.y) >= 0.f) ? 0.f : stored<T>(acc[4 * j + 2 * h + 1]);
                        s0 += g0;
                        s1 += g1;
                        x0s = fmaf(g0, (z0 - mean.x) * invstd.x, x0s);
                        x1s = fmaf(g1, (z1 - mean.y) * invstd.y, x1s);
                    }
                }
            }
            sg[2 * jj] = s0;
            sg[2 * jj + 1] = s1;
            sgx[2 * jj] = x0s;
            sgx[2 * jj + 1] = x1s;
        }
        rs_sum8(sg, lane);
        rs_sum8(sgx, lane);
        gs[g] = sg[0];
        gx[g] = sgx[0];
        if constexpr (ZS) {
            if (g % ZGROUPS == ZGROUPS - 1) mbar_arrive(zempty + 8 * zb);
        }
    }
    stage_pairs<G, BN>(gs, gx, red, w8, lane);
    const int chunks = (M + TMA_BM - 1) / TMA_BM;
    for (int col = ct; col < BN; col += 256) {
        const int gc = tn * BN + col;
        if (gc < N) {
            float a = 0.f, b = 0.f;
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                a += red[w * BN + col];
                b += red[(8 + w) * BN + col];
            }
            part[(size_t)tm * N + gc] = a;
            part[(size_t)(chunks + tm) * N + gc] = b;
        }
    }
    consumers_bar();
}

// An operand that the kernel normalises on its way to the tensor cores (the XF template argument): none, A
// (the NT GEMM's rows: a 1x1 convolution's input, channels along K) or B (the TN GEMM's columns: a 1x1
// grad-weight's input, channels along N). The operand is then relu(bn(z)) of the z its tensor map reads, with
// the BatchNorm of Shape::bn_* (training statistics), computed exactly as kernels/batchnorm's apply8 writes it
// (fmaf(z - mean, invstd * weight, bias), ReLU, rounded to T): the products are the ones of the materialised
// activation, bit for bit, and that activation is never written nor read (ResNet's bottleneck conv3).
constexpr int XF_NONE = 0, XF_A = 1, XF_B = 2;

// The per-channel constants of 8 channels ch .. ch + 7 of a BatchNorm over C channels (zero past C: such
// columns of the operand stay 0, as TMA filled them).
struct BnIn8 {
    float mean[8], scale[8], bias[8];
};

__device__ __forceinline__ void bnin_consts(const Shape& sh, int ch, int C, BnIn8& k) {
    if (ch + 8 <= C) {
        // C % 8 == 0 and the tensors on 16-byte boundaries (checked by the launcher): two float4 loads each.
        float iv[8], w[8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float4 m = __ldg(reinterpret_cast<const float4*>(sh.bn_stats + ch) + h);
            const float4 i = __ldg(reinterpret_cast<const float4*>(sh.bn_stats + 2 * C + ch) + h);
            const float4 ww = __ldg(reinterpret_cast<const float4*>(sh.bn_weight + ch) + h);
            const float4 b = __ldg(reinterpret_cast<const float4*>(sh.bn_bias + ch) + h);
            k.mean[4 * h] = m.x, k.mean[4 * h + 1] = m.y, k.mean[4 * h + 2] = m.z, k.mean[4 * h + 3] = m.w;
            iv[4 * h] = i.x, iv[4 * h + 1] = i.y, iv[4 * h + 2] = i.z, iv[4 * h + 3] = i.w;
            w[4 * h] = ww.x, w[4 * h + 1] = ww.y, w[4 * h + 2] = ww.z, w[4 * h + 3] = ww.w;
            k.bias[4 * h] = b.x, k.bias[4 * h + 1] = b.y, k.bias[4 * h + 2] = b.z, k.bias[4 * h + 3] = b.w;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) k.scale[j] = iv[j] * w[j];
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) k.mean[j] = 0.f, k.scale[j] = 0.f, k.bias[j] = 0.f;
    }
}

// relu(bn(z)) of the 16-byte chunk (8 channels) at shared address addr, in place.
template <typename T>
__device__ __forceinline__ void bnin_chunk(uint32_t addr, const BnIn8& k) {
    uint32_t v[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(addr));
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const T* e = reinterpret_cast<const T*>(&v[p]);
        float f0 = fmaf(to_f(e[0]) - k.mean[2 * p], k.scale[2 * p], k.bias[2 * p]);
        float f1 = fmaf(to_f(e[1]) - k.mean[2 * p + 1], k.scale[2 * p + 1], k.bias[2 * p + 1]);
        f0 = f0 > 0.0f ? f0 : 0.0f;
        f1 = f1 > 0.0f ? f1 : 0.0f;
        v[p] = pack2(from_f<T>(f0), from_f<T>(f1));
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]),
                 "r"(v[3])
                 : "memory");
}

// XF_A: a consumer warpgroup's own 64 rows of the K-major A stage at sa (128-byte rows of 64 channels from kc,
// 128-byte swizzle: the chunk at position pos of row r holds channels kc + 8 (pos ^ (r & 7))). 512 chunks over
// the warpgroup's 128 threads: thread t takes rows t / 8 + 16 i, position t % 8, so its 4 chunks share one
// channel group (r & 7 is the same for all four) and one set of constants, which bnin_a_consts loads a stage
// ahead (the loads land while the tensor cores run the stage before, instead of stalling the transform).
__device__ __forceinline__ void bnin_a_consts(int kc, const Shape& sh, BnIn8& k) {
    const int t = threadIdx.x & 127, pos = t & 7, r0 = t >> 3;
    bnin_consts(sh, kc + 8 * (pos ^ (r0 & 7)), sh.K, k);
}

template <typename T>
__device__ __forceinline__ void bnin_a(uint32_t sa, const BnIn8& k) {
    const int t = threadIdx.x & 127, pos = t & 7, r0 = t >> 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) bnin_chunk<T>(sa + (r0 + 16 * i) * 128 + pos * 16, k);
}

// XF_B: the N-major B stage at sb (BN / 64 panels of 64 k-rows x 64 channels, 8 KiB each, 128-byte swizzle: the
// chunk at position pos of k-row r of panel p holds channels n0 + 64 p + 8 (pos ^ (r & 7))), shared by both
// consumer warpgroups. Their 256 threads split it panel by panel: TPP = 256 / (BN / 64) threads a panel, thread t
// taking panel t / TPP, position t % 8 and k-rows (t % TPP) / 8 + (TPP / 8) i, so that all its chunks hold the
// same 8 channels (r & 7 is the same for all of them), whose constants it loads once per unit (bnin_b_consts).
template <int BN>
__device__ __forceinline__ void bnin_b_consts(int n0, const Shape& sh, BnIn8& k) {
    constexpr int TPP = 256 / (BN / 64);
    const int t = threadIdx.x - 128, tt = t % TPP, pos = tt & 7, r0 = tt >> 3;
    bnin_consts(sh, n0 + 64 * (t / TPP) + 8 * (pos ^ (r0 & 7)), sh.N, k);
}

template <typename T, int BN>
__device__ __forceinline__ void bnin_b(uint32_t sb, const BnIn8& k) {
    constexpr int TPP = 256 / (BN / 64), STEP = TPP / 8;
    const int t = threadIdx.x - 128, tt = t % TPP, pos = tt & 7, r0 = tt >> 3;
    const uint32_t base = sb + (t / TPP) * 8192 + pos * 16;
#pragma unroll
    for (int i = 0; i < 64 / STEP; ++i) bnin_chunk<T>(base + (r0 + STEP * i) * 128, k);
}

// XF_W: the operand normalised by warps 1-3 of the producer warpgroup instead of the consumers (the kernels
// without statistics warps: nt_bnin, tn_bnin), so that a stage is normalised while the tensor cores run the stages
// before it and the consumers only queue wgmmas. Each of the 96 threads keeps one 8-channel group, so one set of
// constants: XF_A, group g = t % 8 of the stage's 64 channels (reloaded each stage, k0 + 64 kt + 8 g) over rows
// t / 8 + 12 i of the 128; XF_B, panel p and group g of (p, g) = t % (BN / 8) (once per unit) over k-rows
// t / (BN / 8) + (768 / BN) i of the 64. A row's chunk of group g sits at position g ^ (r & 7) (the 128-byte
// swizzle); the 8 threads of a quarter warp cover one row's 128 bytes (no bank conflicts). Once a stage is
// normalised the warps fence their stores for the async proxy and arrive on named barrier XF_BAR0 + s (stage s),
// where the consumers wait instead of on full[s] (up to 8 stages: barriers 6-13; 0-5 are taken).
constexpr int XF_BAR0 = 6;
#ifndef IG_XF_IN_PRODUCER
#define IG_XF_IN_PRODUCER 1
#endif

__device__ __forceinline__ void xf_arrive(int s) {
    asm volatile("bar.arrive %0, 352;\n" ::"r"(XF_BAR0 + s) : "memory");
}
__device__ __forceinline__ void xf_sync(int s) { asm volatile("bar.sync %0, 352;\n" ::"r"(XF_BAR0 + s) : "memory"); }

// tma_xf_warps's split of a stage among its 96 threads, one place for the kernel and the compile-time check below:
// thread t keeps channel group combo(t) (XF_B: panel combo / 8, group combo % 8 of it) and normalises k-rows
// first_row(t), + J, .. < ROWS; chunk(t, r) is the byte offset of its chunk of row r in the stage.
template <int XF, int BN>
struct XfMap {
    static constexpr int NC = XF == XF_A ? 8 : BN / 8, J = 96 / NC, ROWS = XF == XF_A ? TMA_BM : TMA_KD;
    static constexpr int PANELS = XF == XF_A ? 1 : BN / 64;
    __host__ __device__ static constexpr int combo(int t) { return t % NC; }
    __host__ __device__ static constexpr int first_row(int t) { return t / NC; }
    __host__ __device__ static constexpr int chunk(int t, int r) {
        return (XF == XF_A ? 0 : TMA_A_BYTES + (combo(t) >> 3) * 8192) + r * 128 + (((combo(t) & 7) ^ (r & 7)) << 4);
    }
    // Every chunk of the stage's operand (PANELS x ROWS x 8, 16 bytes each: panels of ROWS 128-byte rows) taken by
    // exactly one thread, and its 8 channels (the 128-byte swizzle: position p of row r holds group p ^ (r & 7)) the
    // ones whose constants that thread holds (8 combo(t) from the operand's first channel).
    static constexpr bool covers_once() {
        if (96 % NC != 0) return false;
        int seen[PANELS * ROWS * 8] = {};
        const int base = XF == XF_A ? 0 : TMA_A_BYTES;
        for (int t = 0; t < 96; ++t)
            for (int r = first_row(t); r < ROWS; r += J) {
                const int off = chunk(t, r) - base, panel = off / (ROWS * 128), row = off % (ROWS * 128) / 128;
                const int pos = off % 128 / 16;
                if (off % 16 != 0 || row != r) return false;
                if (8 * (8 * panel + (pos ^ (row & 7))) != 8 * combo(t)) return false;
                ++seen[(panel * ROWS + row) * 8 + pos];
            }
        for (int i = 0; i < PANELS * ROWS * 8; ++i)
            if (seen[i] != 1) return false;
        return true;
    }
};
static_assert(XfMap<XF_A, 256>::covers_once() && XfMap<XF_A, 128>::covers_once() && XfMap<XF_A, 64>::covers_once(),
              "tma_xf_warps: A's chunks once each");
static_assert(XfMap<XF_B, 256>::covers_once() && XfMap<XF_B, 128>::covers_once() && XfMap<XF_B, 64>::covers_once(),
              "tma_xf_warps: B's chunks once each");

template <typename T, int BN, int XF, int STAGES, int STAGE_BYTES>
__device__ __forceinline__ void tma_xf_warps(uint32_t s0, uint32_t bars, const Shape& sh, int units, int mt, int nt,
                                             int splits) {
    static_assert(STAGES <= 8, "named barriers 6-13");
    using Map = XfMap<XF, BN>;
    const int t = threadIdx.x - 32, combo = Map::combo(t), j = Map::first_row(t);
    int it = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        int tm, tn, ks, k0;
        const int kts = tma_unit_ktiles(u, mt, nt, splits, sh, tm, tn, ks, k0);
        BnIn8 k;
        if constexpr (XF == XF_B) bnin_consts(sh, tn * BN + 8 * combo, sh.N, k);
        for (int kt = 0; kt < kts; ++kt, ++it) {
            const int s = it % STAGES;
            if constexpr (XF == XF_A) bnin_consts(sh, k0 + kt * TMA_KD + 8 * combo, sh.K, k);
            mbar_wait(bars + 8 * s, (it / STAGES) & 1);
            const uint32_t base = s0 + s * STAGE_BYTES;
#pragma unroll 4
            for (int r = j; r < Map::ROWS; r += Map::J) bnin_chunk<T>(base + Map::chunk(t, r), k);
            fence_async_smem();
            xf_arrive(s);
        }
    }
}

// The JOIN kernels' store (the grad-input of a bottleneck's first 1x1 convolution, joined as the block-output
// join of kernels/batchnorm would join it): for the pair of columns (col, col + 1) of an output row, with a0, a1
// the accumulators as the plain store takes them, g = mask ? a + b : 0 per element, a rounded to T first (the
// value the plain kernel stores), the sum in FP32, rounded once to T (bnv_join_partial's arithmetic: the same bits).
// bv holds the pair of the residual gradient b (C-shaped, row-major), read from the z ring where the joined pair
// then goes (tma_gemm_body's in-place store); the mask (ws) has bit k of byte (row * N + c) / 8 set where element
// c % 8 == k of that row's 8-channel group is on (the forward's relu_bits8); m is the byte of (row, col), read by
// the store a 32-column word at a time (N % 32 == 0, checked by the launcher; row * N / 32 < 2^32, as M * N < 2^31
// is).
template <typename T>
__device__ __forceinline__ uint32_t join_pair(float a0, float a1, uint32_t m, int col, uint32_t bv) {
    T b[2];
    memcpy(b, &bv, 4);
    const int bit = col & 7;
    const float g0 = ((m >> bit) & 1u) ? stored<T>(a0) + to_f(b[0]) : 0.f;
    const float g1 = ((m >> (bit + 1)) & 1u) ? stored<T>(a1) + to_f(b[1]) : 0.f;
    return pack2(from_f<T>(g0), from_f<T>(g1));
}

template <typename T, int CONV, bool A_KMAJOR, bool B_KMAJOR, int BN, int EPI = EPI_PLAIN, int XF = XF_NONE>
__device__ __forceinline__ void tma_gemm_body(const TmaDesc* ta, const TmaDesc* tb, const TmaDesc* tc,
                                              const TmaDesc* tz, T* C, float* ws, const T* bias, const Shape& sh,
                                              unsigned char* smem_raw, const TmaDesc* tz3 = nullptr,
                                              float* part = nullptr) {
    using Cfg = TmaCfg<BN, EPI>;
    constexpr int STAGES = Cfg::STAGES, STAGE_BYTES = Cfg::STAGE_BYTES;
    // The operand normalised by producer warps (tma_xf_warps) where they are free, else by the consumers (and by
    // the consumers everywhere in a build with -DIG_XF_IN_PRODUCER=0: the dev harnesses' A/B of the two).
    constexpr bool XF_W = XF != XF_NONE && !Cfg::STATS_WARPS && IG_XF_IN_PRODUCER;
    constexpr bool XF_C = XF != XF_NONE && !XF_W;
    constexpr int PRODUCER_REGS = XF_W ? 72 : Cfg::PRODUCER_REGS, CONSUMER_REGS = XF_W ? 216 : Cfg::CONSUMER_REGS;
    constexpr bool Z_SMEM = Cfg::Z_SMEM;
    static_assert(Cfg::SMEM_BYTES <= TmaLaunch<BN>::SMEM_BYTES, "the launcher passes TmaLaunch's size");
    unsigned char* smem = align1k<unsigned char>(smem_raw);
    const uint32_t s0 = smem_u32(smem);
    const uint32_t epi = s0 + STAGES * STAGE_BYTES;  // epilogue staging, Cfg::EPI_BYTES (none in place)
    constexpr int ZCH = Cfg::ZCH, ZW = Cfg::ZW, Z_BUFS = Cfg::Z_BUFS, Z_CHUNK = Cfg::Z_CHUNK_BYTES;
    const uint32_t zbuf = epi + Cfg::EPI_BYTES + Cfg::HAND_BYTES;  // the z buffers, Z_BUFS x Z_CHUNK
    // GRAD_SUMS_W: the z tile (Cfg::Z_TILE_BYTES) where the ring would be. JOIN_SUMS_W: the z3 ring after the ring.
    const uint32_t z3buf = zbuf + Z_BUFS * Z_CHUNK;
    // full[s] at bars + 8 s, empty[s] at + 8 (S + s)
    const uint32_t bars = zbuf + Z_BUFS * Z_CHUNK + Cfg::Z_TILE_BYTES + Cfg::Z3_BYTES;
    // Z_SMEM: zfull[b] at zfull + 8 b, zempty[b] at zempty + 8 b.
    const uint32_t zfull = bars + 16 * STAGES, zempty = zfull + 8 * Z_BUFS;
    // STATS_WARPS: staged (the consumers have staged the unit's tile: 256 arrivals) and read (the statistics warps
    // have read it: 96 arrivals).
    constexpr bool STATS_WARPS = Cfg::STATS_WARPS;
    const uint32_t staged = zempty + 8 * Z_BUFS, read = staged + 8;
    const uint32_t ztile = read + 8;  // GRAD_SUMS_W: the z tile has landed (1 arrival + its bytes)
    // JOIN_SUMS_W: zjoined[b] (both consumer warpgroups have joined b buffer b's chunk: 2 arrivals) and z3full[b].
    const uint32_t zjoined = ztile + 8, z3full = zjoined + 8 * Z_BUFS;
    // Z_SMEM with C stored through its map (the launcher's tma_c; its z map tz then covers z like C's): a producer
    // thread loads z; otherwise the epilogue reads z from global memory.
    const bool z_tma = Z_SMEM && sh.tma_c;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int M = sh.M, N = sh.N, K = sh.K;
    const int mt = (M + TMA_BM - 1) / TMA_BM, nt = (N + BN - 1) / BN;
    const int splits = K > 0 ? (K + sh.k_split - 1) / sh.k_split : 1;
    const int units = mt * nt * splits;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (STAGES + s), 2);
        }
        for (int b = 0; b < Z_BUFS; ++b) {
            mbar_init(zfull + 8 * b, 1);
            mbar_init(zempty + 8 * b, Cfg::Z_ARRIVALS);
        }
        if constexpr (STATS_WARPS) {
            mbar_init(staged, 256);
            mbar_init(read, 96);
        }
        if constexpr (Cfg::Z_TILE_BYTES > 0) mbar_init(ztile, 1);
        if constexpr (Cfg::JOIN_SUMS) {
            for (int b = 0; b < Z_BUFS; ++b) mbar_init(zjoined + 8 * b, 2);
            for (int b = 0; b < Cfg::Z3_BUFS; ++b) mbar_init(z3full + 8 * b, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (tid == 0) {
            int it = 0;
            for (int u = blockIdx.x; u < units; u += gridDim.x) {
                int tm, tn, ks, k0;
                const int kts = tma_unit_ktiles(u, mt, nt, splits, sh, tm, tn, ks, k0);
                TmaPos pos = tma_pos_init<CONV>(sh, tm, k0);
                for (int kt = 0; kt < kts; ++kt, ++it) {
                    const int s = it % STAGES;
                    const uint32_t par = (it / STAGES) & 1;
                    const uint32_t full = bars + 8 * s, empty = bars + 8 * (STAGES + s);
                    mbar_wait(empty, par ^ 1);
                    mbar_expect_tx(full, STAGE_BYTES);
                    const uint32_t sa = s0 + s * STAGE_BYTES;
                    tma_produce<CONV, A_KMAJOR, B_KMAJOR, BN>(ta, tb, sh, tm, tn, k0 + kt * TMA_KD, pos, sa,
                                                              sa + TMA_A_BYTES, full);
                    tma_pos_next<CONV>(sh, pos);
                }
            }
        } else if constexpr (Z_SMEM) {
            // (Only the GRAD_SUMS and JOIN kernels have a z loader: the others have no z buffers, Z_BUFS = 0. The
            // JOIN kernels' "z" is the residual gradient b.)
            if (z_tma && tid == 32) {
                // The z loader: each unit's chunks in turn, each into the next buffer of the ring as soon as the
                // epilogue has done with the chunk that held it (read it; JOIN: stored it), so the next unit's first
                // Z_BUFS chunks load during this unit's MMAs. The chunks beyond the ring, which can only load while
                // the epilogue runs (the x256 sums kernels' fourth), are prefetched into L2 with the first.
                int q = 0;
                for (int u = blockIdx.x; u < units; u += gridDim.x) {
                    int tm, tn, ks;
                    tma_unit(u, mt, nt, splits, tm, tn, ks);
#pragma unroll
                    for (int ch = 0; ch < ZCH; ++ch, ++q) {
                        const int c0 = tn * BN + ZW * ch, r0 = tm * TMA_BM;
                        constexpr int CB = ZW / 64;  // column boxes per row half
                        // Box b: rows r0 + 64 (b / CB), columns c0 + 64 (b % CB).
                        if (ch == 0 && Z_BUFS < ZCH) {
#pragma unroll
                            for (int c2 = Z_BUFS; c2 < ZCH; ++c2)
#pragma unroll
                                for (int b = 0; b < 2 * CB; ++b)
                                    tma_prefetch_2d(tz, c0 + ZW * c2 + 64 * (b % CB), r0 + 64 * (b / CB));
                        }
                        const int zb = q % Z_BUFS;
                        mbar_wait(zempty + 8 * zb, ((q / Z_BUFS) & 1) ^ 1);
                        mbar_expect_tx(zfull + 8 * zb, Z_CHUNK);
#pragma unroll
                        for (int b = 0; b < 2 * CB; ++b)
                            tma_load_2d(zbuf + zb * Z_CHUNK + b * 8192, tz, c0 + 64 * (b % CB), r0 + 64 * (b / CB),
                                        zfull + 8 * zb);
                    }
                }
            }
        }
        if constexpr (STATS_WARPS) {
            // ws is the statistics' partials (the launcher runs these kernels without split-K).
            if constexpr (Cfg::JOIN_SUMS) {
                // Warps 2-3 (thread 32 is the b ring's loader); the hand-over right before the ring.
                if (tid >= 64)
                    tma_join_sums_warps<T, BN, Z_BUFS, Cfg::Z3_BUFS>(zbuf, z3buf, zjoined, z3full, zempty,
                                                                     zbuf - Cfg::HAND_BYTES, tz3, part, sh, units,
                                                                     mt, nt);
            } else if (sh.tma_c && tid >= 32) {
                if constexpr (EPI == EPI_MOMENTS) {
                    tma_stats_warps<T, BN, Cfg::EPI_BYTES>(epi, staged, read, ws, sh, units, mt, nt);
                } else {
                    tma_gsums_warps<T, BN, Cfg::EPI_BYTES>(epi, staged, read, zbuf, ztile, tz, ws, sh, units, mt,
                                                           nt);
                }
            }
        }
        if constexpr (XF_W) {
            if (tid >= 32) tma_xf_warps<T, BN, XF, STAGES, STAGE_BYTES>(s0, bars, sh, units, mt, nt, splits);
        }
        return;
    }

    setmaxnreg_inc<CONSUMER_REGS>();
    if constexpr (EPI == EPI_GRAD_SUMS_W) {
        if (!sh.tma_c) __trap();  // the statistics warps read the staged tile
    }
    const int cw = wg - 1;              // consumer warpgroup: rows [64 cw, 64 cw + 64) of the tile
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    constexpr int NACC = BN / 2;
    float acc[NACC];
    // XF_A: the constants of the next stage to normalise (its channels k0 + 64 kt depend on the stage), loaded a
    // stage ahead of their use.
    BnIn8 ka;
    if constexpr (XF_C && XF == XF_A) {
        if (blockIdx.x < units) {
            int tm, tn, ks, k0;
            tma_unit_ktiles(blockIdx.x, mt, nt, splits, sh, tm, tn, ks, k0);
            bnin_a_consts(k0, sh, ka);
        }
    }
    // With an operand to normalise (XF), the stage is normalised one k-tile ahead of its wgmma: stage kt + 1 is
    // waited for and normalised right after the wgmma of stage kt is queued, so that the tensor cores have stages
    // kt - 1 and kt to run meanwhile (normalising first and then queueing left them one stage, which the
    // normalisation outlasted). Then the generic-proxy stores are fenced for wgmma (async proxy) and the threads
    // that share the operand meet at a barrier before any of them queues it.
    auto prepare = [&](int itx, int next_kc, const BnIn8& kb) {
        const int s1 = itx % STAGES;
        mbar_wait(bars + 8 * s1, (itx / STAGES) & 1);
        const uint32_t sa1 = s0 + s1 * STAGE_BYTES;
        if constexpr (XF == XF_A) {
            bnin_a<T>(sa1 + cw * 64 * 128, ka);
            if (next_kc >= 0) bnin_a_consts(next_kc, sh, ka);
            fence_async_smem();
            wg_bar(1 + cw);
        } else if constexpr (XF == XF_B) {
            bnin_b<T, BN>(sa1 + TMA_A_BYTES, kb);
            fence_async_smem();
            consumers_bar();
        }
    };
    int it = 0, zu = 0;
    int zpend = -1;  // JOIN, a warpgroup's storing thread: the buffer of its newest store, not yet released
    for (int u = blockIdx.x; u < units; u += gridDim.x, ++zu) {
        int tm, tn, ks, k0;
        const int kts = tma_unit_ktiles(u, mt, nt, splits, sh, tm, tn, ks, k0);
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
        if constexpr (Cfg::IS_JOIN) {
            // The ReLU mask bytes this thread's two rows need in the store (BN / 8 bytes a row, at most 32: one
            // sector), into L1 while the MMAs run. ws is the mask here.
            const int r0 = tm * TMA_BM + cw * 64 + warp * 16 + (lane >> 2);
            const unsigned char* mk = reinterpret_cast<const unsigned char*>(ws);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (r0 + 8 * h < M) {
                    const unsigned char* pm = mk + ((size_t)(r0 + 8 * h) * N + (size_t)tn * BN) / 8;
                    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(pm));
                }
            }
        }
        // XF_B: this thread's 8 channels of B are the same in every stage of the unit.
        BnIn8 kb;
        if constexpr (XF_C && XF == XF_B) bnin_b_consts<BN>(tn * BN, sh, kb);
        // XF_A: the channels of the stage after stage kt of this unit: the unit's next k-tile, or the first k-tile
        // of this block's next unit (-1: none).
        auto kc_after = [&](int kt) {
            if (kt + 1 < kts) return k0 + (kt + 1) * TMA_KD;
            if (u + (int)gridDim.x >= units) return -1;
            int tm2, tn2, ks2, k02;
            tma_unit_ktiles(u + gridDim.x, mt, nt, splits, sh, tm2, tn2, ks2, k02);
            return k02;
        };
        if constexpr (XF_C) {
            if (kts > 0) prepare(it, XF == XF_A ? kc_after(0) : -1, kb);
        }
        int prev = 0;
        for (int kt = 0; kt < kts; ++kt, ++it) {
            const int s = it % STAGES;
            if constexpr (XF == XF_NONE) mbar_wait(bars + 8 * s, (it / STAGES) & 1);
            if constexpr (XF_W) {
                // The stage normalised (its operand's stores fenced for the async proxy before the arrivals); the
                // stage's own barrier, complete by then, also orders the other operand's TMA bytes for this thread.
                xf_sync(s);
                mbar_wait(bars + 8 * s, (it / STAGES) & 1);
            }
            const uint32_t sa = s0 + s * STAGE_BYTES, sb = sa + TMA_A_BYTES;
            fence_regs(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < TMA_KD / 16; ++kk) {
                const uint64_t da = A_KMAJOR ? wg_desc(sa + cw * 64 * 128 + kk * 32, 16, 1024)
                                             : wg_desc(sa + cw * 8192 + kk * 2048, 8192, 1024);
                const uint64_t db = B_KMAJOR ? wg_desc(sb + kk * 32, 16, 1024) : wg_desc(sb + kk * 2048, 8192, 1024);
                tma_wgmma<BN, A_KMAJOR ? 0 : 1, B_KMAJOR ? 0 : 1>(acc, da, db, T());
            }
            wg_commit();
            if constexpr (XF_C) {
                if (kt + 1 < kts) prepare(it + 1, XF == XF_A ? kc_after(kt + 1) : -1, kb);
            }
            wg_wait<1>();
            fence_regs(acc);
            if (kt > 0 && (tid & 127) == 0) mbar_arrive(bars + 8 * (STAGES + prev));
            prev = s;
        }
        wg_wait<0>();
        fence_regs(acc);
        if (kts > 0 && (tid & 127) == 0) mbar_arrive(bars + 8 * (STAGES + prev));

        if constexpr (EPI == EPI_MOMENTS) {
            // ws is the statistics' partials here (the launcher runs these kernels without split-K). With map C the
            // statistics warps take them from the staged tile (tma_stats_warps); without it the consumers do.
            if (!sh.tma_c)
                tma_epilogue_stats<T, BN>(acc, ws, sh, tm, tn, cw,
                                          reinterpret_cast<float*>(smem + STAGES * STAGE_BYTES));
        } else if constexpr (EPI == EPI_GRAD_SUMS) {
            // ws: the sums' partials; the bias argument: the BatchNorm's input z (no bias in these passes).
            float* red = reinterpret_cast<float*>(smem + STAGES * STAGE_BYTES);
            if (z_tma) {
                tma_epilogue_grad_sums<T, BN, Z_SMEM, (Z_BUFS > 0 ? Z_BUFS : 1)>(acc, ws, bias, sh, tm, tn, cw, red,
                                                                                 zbuf, zfull, zempty, zu * ZCH);
            } else {
                tma_epilogue_grad_sums<T, BN>(acc, ws, bias, sh, tm, tn, cw, red);
            }
        }
        // Epilogue straight from the accumulators: fragment j (8 columns), element e: row + 8 (e >= 2),
        // column 2 (lane % 4) + (e & 1).
        const int row0 = tm * TMA_BM + cw * 64 + warp * 16 + (lane >> 2);
        const int col0 = tn * BN + 2 * (lane & 3);
        if constexpr (Cfg::IS_JOIN) {
            // In place, a z chunk at a time (the launcher runs these kernels with map C only, without split-K):
            // each thread reads its pairs of b from the ring, writes the joined pairs over them (the ring's boxes
            // have the C staging's 128-byte swizzle), and the warpgroup TMA-stores its row half of the chunk
            // straight from the ring. The storing thread frees a buffer once its store has read it, a chunk later
            // (wait_group.read 1: every store but the newest), so it never waits on the store it has just issued.
            if (!sh.tma_c) __trap();
            const int rloc = warp * 16 + (lane >> 2);  // row within this warpgroup's 64, + 8 h
            constexpr int ZBOXES = ZW / 64;
            uint32_t mw[2] = {0u, 0u};  // the mask words of the thread's two rows that cover column col
#pragma unroll
            for (int ch = 0; ch < ZCH; ++ch) {
                const int q = zu * ZCH + ch, zb = q % Z_BUFS;
                const uint32_t zc = zbuf + zb * Z_CHUNK;
                mbar_wait(zfull + 8 * zb, (q / Z_BUFS) & 1);
#pragma unroll
                for (int jj = 0; jj < ZW / 8; ++jj) {
                    const int j = ch * (ZW / 8) + jj;
                    const int col = col0 + 8 * j;
                    float b0, b1;
                    tma_bias2(sh, bias, col, b0, b1);
                    // A mask word covers 4 fragments (32 columns): read once for them.
                    if ((j & 3) == 0) {
                        const uint32_t* words = reinterpret_cast<const uint32_t*>(ws);
                        const int c = tn * BN + 8 * j, wc = c >> 5;  // the word's column group
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int row = row0 + 8 * h;
                            // Rows past M and columns past N: 0 (the TMA store clips those elements).
                            mw[h] = (row < M && c < N) ? words[(uint32_t)row * (uint32_t)(N >> 5) + wc] : 0u;
                        }
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = rloc + 8 * h;
                        const uint32_t addr = zc + (ZBOXES * cw + (jj >> 3)) * 8192 + r * 128 +
                                              (((jj & 7) ^ (r & 7)) << 4) + ((lane & 3) << 2);
                        uint32_t bv;
                        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(bv) : "r"(addr) : "memory");
                        const uint32_t m = (mw[h] >> (8 * (j & 3))) & 0xffu;
                        const uint32_t v =
                            join_pair<T>(acc[4 * j + 2 * h] + b0, acc[4 * j + 2 * h + 1] + b1, m, col, bv);
                        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
                    }
                }
                fence_async_smem();
                wg_bar(1 + cw);
                if ((tid & 127) == 0) {
                    const int row = tm * TMA_BM + cw * 64, c0 = tn * BN + ZW * ch;
#pragma unroll
                    for (int bx = 0; bx < ZBOXES; ++bx)
                        tma_store_2d(tc, zc + (ZBOXES * cw + bx) * 8192, c0 + 64 * bx, row);
                    bulk_commit();
                    // JOIN_SUMS_W: the statistics warps may read the joined chunk (this warpgroup's half).
                    if constexpr (Cfg::JOIN_SUMS) mbar_arrive(zjoined + 8 * zb);
                    bulk_wait_read_but_newest();
                    if (zpend >= 0) mbar_arrive(zempty + 8 * zpend);
                    zpend = zb;
                }
            }
        } else if (EPI == EPI_PLAIN && splits > 1) {
            float* out = ws + (size_t)ks * M * N;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = col0 + 8 * j;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row0 + 8 * h;
                    if (row < M && col < N) {
                        if (col + 1 < N) {
                            *reinterpret_cast<float2*>(out + (size_t)row * N + col) =
                                make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                        } else {
                            out[(size_t)row * N + col] = acc[4 * j + 2 * h];
                        }
                    }
                }
            }
        } else if (sh.tma_c) {
            // Through shared memory and TMA stores, 128 columns at a time: the stores drain while this warpgroup
            // runs the next unit's MMAs. Fragment j of row r goes to 16-byte chunk (j % 8) ^ (r % 8) of row r of
            // box j / 8 (the 128-byte swizzle; conflict-free: the 8 rows of a store phase hit 8 different chunks).
            // STATS_WARPS: every half has its own buffer (2 TMA_EPI_WG_BYTES apart), written once the statistics
            // warps have read the previous unit's tile and the previous stores have read theirs; the tile stays
            // until those warps have read it (barrier read, waited for at the next unit).
            const uint32_t buf = epi + cw * TMA_EPI_WG_BYTES;
            const int rloc = warp * 16 + (lane >> 2);  // row within this warpgroup's 64, + 8 h
            constexpr int EW = BN < 128 ? BN : 128;  // columns per staging round
            if constexpr (STATS_WARPS) mbar_wait(read, (zu & 1) ^ 1);
#pragma unroll
            for (int half = 0; half < BN / EW; ++half) {
                const uint32_t hbuf = STATS_WARPS ? buf + half * 2 * TMA_EPI_WG_BYTES : buf;
                if (!STATS_WARPS || half == 0) {
                    if ((tid & 127) == 0) bulk_wait_all<true>();
                    wg_bar(1 + cw);
                }
#pragma unroll
                for (int jj = 0; jj < EW / 8; ++jj) {
                    const int j = half * (EW / 8) + jj;
                    const int col = col0 + 8 * j;
                    float b0, b1;
                    tma_bias2(sh, bias, col, b0, b1);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = rloc + 8 * h;
                        const uint32_t addr =
                            hbuf + (jj >> 3) * 8192 + r * 128 + ((((jj & 7) ^ (r & 7))) << 4) + ((lane & 3) << 2);
                        const uint32_t v =
                            pack2(from_f<T>(acc[4 * j + 2 * h] + b0), from_f<T>(acc[4 * j + 2 * h + 1] + b1));
                        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
                    }
                }
                fence_async_smem();
                wg_bar(1 + cw);
                if ((tid & 127) == 0) {
                    const int row = tm * TMA_BM + cw * 64, c0 = tn * BN + half * EW;
#pragma unroll
                    for (int bx = 0; bx < EW / 64; ++bx) tma_store_2d(tc, hbuf + bx * 8192, c0 + 64 * bx, row);
                    bulk_commit();
                }
            }
            if constexpr (STATS_WARPS) mbar_arrive(staged);  // after this thread's stores to the staging
        } else {
            // Element offset of output row row0 + 8 h (strided grad-input: its dx pixel).
            size_t obase[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + 8 * h;
                if (CONV == TMA_CONV_DGRAD_S) {
                    const int n = row / (sh.mh * sh.mw), rem = row - n * sh.mh * sh.mw, hh = rem / sh.mw;
                    const int ih = hh * sh.stride + sh.ph, iw = (rem - hh * sh.mw) * sh.stride + sh.pw;
                    obase[h] = (((size_t)n * sh.h + ih) * sh.w + iw) * sh.ldc;
                } else {
                    obase[h] = (size_t)row * sh.ldc;
                }
            }
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = col0 + 8 * j;
                float b0, b1;
                tma_bias2(sh, bias, col, b0, b1);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row0 + 8 * h;
                    if (row < M && col < N) {
                        const T v0 = from_f<T>(acc[4 * j + 2 * h] + b0), v1 = from_f<T>(acc[4 * j + 2 * h + 1] + b1);
                        if (col + 1 < N && (sh.ldc & 1) == 0) {
                            *reinterpret_cast<uint32_t*>(C + obase[h] + col) = pack2(v0, v1);
                        } else {
                            C[obase[h] + col] = v0;
                            if (col + 1 < N) C[obase[h] + col + 1] = v1;
                        }
                    }
                }
            }
        }
    }
    if ((tid & 127) == 0) bulk_wait_all<false>();  // the staging buffer must outlive the last TMA store
}

}  // namespace ig

// One TMA kernel: (map A, map B, map C, map Z, C, split-K workspace, bias, shape), MODE one of ig::TMA_GEMM /
// TMA_CONV_*, AK / BKM whether A / B are K-major, BN the tile width. Map Z is read only by the GSUMS and JOIN
// kernels with map C in use (TmaCfg::Z_SMEM): z (GSUMS: the bias argument; JOIN: the residual gradient) as map C
// covers C. Used by gemm/ and
// conv/05_tma_wgmma.cu.
#define IG_TMA_KERNEL(NAME, T, MODE, AK, BKM, BN) IG_TMA_KERNEL_S(NAME, T, MODE, AK, BKM, BN, ig::EPI_PLAIN)
// The same with the BatchNorm statistics of the output in the epilogue (ig::tma_epilogue_stats): the workspace
// argument is the partials buffer, and there is no split-K.
#define IG_TMA_KERNEL_STATS(NAME, T, MODE, AK, BKM, BN) IG_TMA_KERNEL_S(NAME, T, MODE, AK, BKM, BN, ig::EPI_MOMENTS)
// The same with the BatchNorm backward sums of the output in the epilogue (ig::tma_epilogue_grad_sums): the
// workspace argument is the partials buffer, the bias argument the BatchNorm's input, Shape::bn_* its
// per-channel tensors; no split-K.
#define IG_TMA_KERNEL_GSUMS(NAME, T, MODE, AK, BKM, BN) IG_TMA_KERNEL_S(NAME, T, MODE, AK, BKM, BN, ig::EPI_GRAD_SUMS)
// The same with the sums taken by the statistics warps (ig::tma_gsums_warps; x128 and x64; map C and map Z).
#define IG_TMA_KERNEL_GSUMS_W(NAME, T, MODE, AK, BKM, BN) \
    IG_TMA_KERNEL_S(NAME, T, MODE, AK, BKM, BN, ig::EPI_GRAD_SUMS_W)
// The same with C joined with a residual gradient under a ReLU mask (ig::join_pair): the workspace argument is
// the mask, map Z covers the residual gradient as map C covers C (C must go through map C: the launcher's tma_c);
// no split-K.
#define IG_TMA_KERNEL_JOIN(NAME, T, MODE, AK, BKM, BN) IG_TMA_KERNEL_S(NAME, T, MODE, AK, BKM, BN, ig::EPI_JOIN)
// The same with the backward sums of the BatchNorm whose output gradient the joined value is, taken by statistics
// warps (ig::tma_join_sums_warps): two more arguments after map Z, map Z3 (that BatchNorm's input, C-shaped), and
// after the mask, the partials (ig::tma_join_sums_warps' layout); that BatchNorm's statistics in Shape::bn_stats.
#define IG_TMA_KERNEL_JOIN_SUMS(NAME, T, MODE, AK, BKM, BN)                                                       \
    extern "C" __global__ void __launch_bounds__(ig::TMA_THREADS, 1)                                            \
        NAME(const __grid_constant__ ig::TmaDesc ta, const __grid_constant__ ig::TmaDesc tb,                    \
             const __grid_constant__ ig::TmaDesc tc, const __grid_constant__ ig::TmaDesc tz,                    \
             const __grid_constant__ ig::TmaDesc tz3, T* __restrict__ c, float* __restrict__ ws,                 \
             float* __restrict__ part, const T* __restrict__ bias, ig::Shape sh) {                               \
        extern __shared__ __align__(1024) unsigned char ig_smem[];                                               \
        ig::tma_gemm_body<T, MODE, AK, BKM, BN, ig::EPI_JOIN_SUMS_W, ig::XF_NONE>(&ta, &tb, &tc, &tz, c, ws, bias, \
                                                                                  sh, ig_smem, &tz3, part);      \
    }
// The same with operand A (NT) or B (TN) normalised on its way to the tensor cores (ig::XF_A / XF_B, relu(bn(z))
// with the BatchNorm in Shape::bn_*; split-K allowed).
#define IG_TMA_KERNEL_XF(NAME, T, MODE, AK, BKM, BN, XF) IG_TMA_KERNEL_SX(NAME, T, MODE, AK, BKM, BN, ig::EPI_PLAIN, XF)
#define IG_TMA_KERNEL_S(NAME, T, MODE, AK, BKM, BN, EPI) IG_TMA_KERNEL_SX(NAME, T, MODE, AK, BKM, BN, EPI, ig::XF_NONE)
#define IG_TMA_KERNEL_SX(NAME, T, MODE, AK, BKM, BN, EPI, XF)                                                    \
    extern "C" __global__ void __launch_bounds__(ig::TMA_THREADS, 1)                                            \
        NAME(const __grid_constant__ ig::TmaDesc ta, const __grid_constant__ ig::TmaDesc tb,                    \
             const __grid_constant__ ig::TmaDesc tc, const __grid_constant__ ig::TmaDesc tz, T* __restrict__ c,  \
             float* __restrict__ ws, const T* __restrict__ bias, ig::Shape sh) {                                 \
        extern __shared__ __align__(1024) unsigned char ig_smem[];                                               \
        ig::tma_gemm_body<T, MODE, AK, BKM, BN, EPI, XF>(&ta, &tb, &tc, &tz, c, ws, bias, sh, ig_smem);          \
    }
