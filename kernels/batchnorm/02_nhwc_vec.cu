// Training-mode BatchNorm (+ optional fused ReLU) over channels-last activations, 8 channels per thread.
// Variant 02 (nhwc_vec): 16-byte accesses. 01_nhwc.cu gives each thread one channel, so a bf16 warp moves 64 bytes
// per row in 2-byte loads; the ktrace of the explicit ResNet-152 step (2026-12-03) had its five row passes at 35 ms
// per step, about a third of copy speed. The statistics take one pass over x (per-chunk shifted sums, combined
// exactly by bn_nhwc_moments_final, which also updates the running statistics) instead of 01's two passes and two
// finalisers. The backward writes 01's partial-sum layout (reduced by bn_nhwc_bwd_final_v8) and the same
// per-element expressions (bn_pre, the ReLU mask that passes the gradient at a pre-activation of exactly 0), so
// 01's header describes the math.
//
// Needs c % 8 == 0 and G = c / 8 dividing 256 (c = 8 .. 2048 in powers of two: every ResNet width), operands on
// 16-byte boundaries and per-channel tensors on 16-byte boundaries (the launcher, cuda/bn.rs, checks and falls
// back to 01 otherwise).
//
// Reductions (moments, bwd_sum): block of 256 threads, grid (chunks). Thread t owns channel group cg = t % G
// (channels 8 cg .. 8 cg + 7) and row t / G of each of its chunk's row groups (VB / G rows each: chunk k holds the
// groups k, k + chunks, ..., see for_chunk_rows; the rpc argument is unused there); it accumulates 8 FP32
// sums in registers, then the threads of one channel group are summed in a fixed order through shared memory and
// written as part[chunk * c + ch] and part[(chunks + chunk) * c + ch]. Deterministic, no atomics.
// Element-wise passes (apply, bwd_dx): one thread per 8 consecutive elements, grid-stride, 16-byte loads of the
// per-channel constants.
//
// Exported: bn_nhwc_{moments,apply,bwd_sum,bwd_dx}_v8_{f32,bf16,f16}, bn_nhwc_join_sum_{1,2}_v8_{f32,bf16,f16}
// (the block output's ReLU gradient with its BatchNorm's backward sums), bn_nhwc_moments_final,
// bn_nhwc_bwd_final_v8, bn_nhwc_running_update; the cooperative one-launch kernels (kernels.bn_cooperative, at the
// end): bn_nhwc_train_v8, bn_nhwc_train2_v8, bn_nhwc_train_bwd_v8, bn_nhwc_train_join_bwd_{1,2}_v8, and the
// stem's bn_nhwc_train_pool_v8 (BatchNorm + ReLU + the 3x3/2 max-pool with its window argmax) and
// bn_nhwc_train_bwd_pool_v8 (that pool's backward from the offsets inside the BatchNorm + ReLU backward), each
// _{f32,bf16,f16}.

#include "common.cuh"
#include "maxpool/nhwc.cuh"

#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define VB 256

__device__ __forceinline__ void load8f(const float* __restrict__ p, float (&v)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ float bn_pre(float x, float mean, float scale, float bias) {
    return fmaf(x - mean, scale, bias);
}

// Row of the reductions' shared buffer: VB floats (one a thread) + 4, so that chunk_sums' reads (a warp's 32
// consecutive channels: 8 offsets k times 4 channel groups) fall in 32 different banks.
#define GS (VB + 4)
// Floats of a reduction's shared buffer: 16 rows of GS (acc a, then acc b).
#define GS_FLOATS (16 * GS)

// The block's sums of a[8] and b[8] per channel, handed to write(ch, sum a, sum b) for every channel ch < c, by
// thread ch % VB (ResNet's c <= 2048 = 8 VB): the sum over the row lanes j = 0 .. VB / G - 1 of a[ch % 8] of thread
// j G + ch / 8, added in that order from 0. Each channel's order is that of the earlier group_sum, which left the
// sums to the G threads t < G, 8 channels x VB / G row lanes each, one after another (at c = 64: 256 dependent
// shared-memory adds a thread, twice); here every thread adds one channel's lanes. Every thread calls it (barriers).
template <typename F>
__device__ __forceinline__ void chunk_sums(const float (&a)[8], const float (&b)[8], float* sh, int G, int c,
                                           F&& write) {
    const int t = threadIdx.x;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        sh[k * GS + t] = a[k];
        sh[(8 + k) * GS + t] = b[k];
    }
    __syncthreads();
    const int rsn = VB / G;
    for (int ch = t; ch < c; ch += VB) {
        const float* p = sh + (ch & 7) * GS + (ch >> 3);
        float sa = 0.0f, sb = 0.0f;
        for (int j = 0; j < rsn; ++j) {
            sa += p[j * G];
            sb += p[8 * GS + j * G];
        }
        write(ch, sa, sb);
    }
    __syncthreads();
}

// The rows of the reductions' chunks (moments, backward sums): row group gi holds rows gi VB / G .. (gi + 1) VB /
// G - 1, one row a thread of a 256-thread block (4 KB of bf16), and chunk k of `chunks` the groups k, k + chunks,
// k + 2 chunks, ..., taken from the last to the first (the kernel before wrote the tensor's end last, so that is
// what L2 still holds). At each step the blocks of a launch read one contiguous window of the tensor, as the
// element-wise passes do. On an H100 (kernels/dev/batchnorm/bnbench.cu, 2026-12-06) the backward launches took 4%
// less time a ResNet-152 step than over chunks of consecutive rows (each block streaming its own 1/396th); the
// moments pass gained nothing (x alone reads at 2.2-2.6 TB/s either way: too few bytes in flight a thread).
// Row groups of a (rows, c) tensor: rows / rstep rounded up, rstep = VB / (c / 8) a power of two (32-bit: the
// launchers check rows < 2^31).
__device__ __forceinline__ int row_groups(int64_t rows, int c) {
    const int shift = 8 - (__ffs(c >> 3) - 1);
    return (int)((rows + (1 << shift) - 1) >> shift);
}

// f(r) for each row r of chunk `chunk` that this thread reads: row t / G of the chunk's row groups, from the
// last group to the first (every chunk has one: chunks <= the groups, cuda/bn.rs's split), U rows in flight. Only
// the tensor's last group can be short: with PEEL it is taken first on its own, so that the loop tests nothing;
// without, each row is tested (fewer registers where f is large: the joins).
template <int U, bool PEEL = true, typename F>
__device__ __forceinline__ void for_chunk_rows(int64_t rows, int c, int chunk, int chunks, F&& f) {
    const int rstep = VB / (c >> 3), lane = threadIdx.x / (c >> 3), ng = row_groups(rows, c);
    int gi = ng - 1 - (ng - 1 - chunk) % chunks;
    if (PEEL && gi == ng - 1) {
        const int64_t r = (int64_t)gi * rstep + lane;
        if (r < rows) f(r);
        gi -= chunks;
    }
#pragma unroll U
    for (; gi >= 0; gi -= chunks) {
        const int64_t r = (int64_t)gi * rstep + lane;
        if (PEEL || r < rows) f(r);
    }
}

// for_chunk_rows with the loads batched: ld(r) makes row r's loads (a value of V), use(v) the rest, in the same
// row order, so the same sums bit for bit. U rows' loads are issued before the first use. for_chunk_rows' unrolled
// loop tests its bound after each row, and ptxas keeps a row's loads behind the previous row's exit test: in the
// moments loop one 16-byte load a thread was in flight (SASS, 2026-12-07), 12 KB a SM at 3 blocks of 256 threads,
// too few bytes to cover DRAM latency. On an H100 (kernels/dev/batchnorm/bnbench.cu, 2026-12-07) 4 rows in flight
// took ResNet-152's forward BatchNorm launches from 14.50 to 13.60 ms a step (8 rows: 13.73); the backward sums
// and the joins (two and three loads a row already) gained nothing: 22.30 with one row, 25.3 with two (spills at
// 80 registers), 22.7 with four at 2 blocks a SM. The tensor's last (possibly short) group is peeled as there; every
// other row is in range.
template <int U, typename V, typename L, typename F>
__device__ __forceinline__ void for_chunk_rows_ld(int64_t rows, int c, int chunk, int chunks, L&& ld, F&& use) {
    const int rstep = VB / (c >> 3), lane = threadIdx.x / (c >> 3), ng = row_groups(rows, c);
    int gi = ng - 1 - (ng - 1 - chunk) % chunks;
    if (gi == ng - 1) {
        const int64_t r = (int64_t)gi * rstep + lane;
        if (r < rows) use(ld(r));
        gi -= chunks;
    }
    for (; gi >= (U - 1) * chunks; gi -= U * chunks) {
        V v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ld((int64_t)(gi - u * chunks) * rstep + lane);
#pragma unroll
        for (int u = 0; u < U; ++u) use(v[u]);
    }
    for (; gi >= 0; gi -= chunks) use(ld((int64_t)gi * rstep + lane));
}

// Rows of each chunk: with rpc > 0 chunks of rpc consecutive rows (the convolution epilogue's moments), else the
// row groups of for_chunk_rows (the moments pass's): with ng - 1 = q chunks + m, chunk k has q + 1 groups for
// k <= m, q after, and chunk m the last group, short by ng rstep - rows rows. No division a chunk.
struct ChunkRows {
    int64_t rows, rpc, cut;
    int q, m, rstep;
    __device__ __forceinline__ ChunkRows(int64_t rows_, int64_t rpc_, int c, int chunks) : rows(rows_), rpc(rpc_) {
        rstep = VB / (c >> 3);
        const int ng = row_groups(rows, c);
        q = (ng - 1) / chunks;
        m = (ng - 1) - q * chunks;
        cut = (int64_t)ng * rstep - rows;
    }
    __device__ __forceinline__ float operator()(int k) const {
        if (rpc > 0) return (float)min(rpc, rows - (int64_t)k * rpc);
        return (float)((int64_t)(q + (k <= m ? 1 : 0)) * rstep - (k == m ? cut : 0));
    }
};

// Single-pass statistics of one chunk of rows, as sums of d = x - K with K the channel's value in row 0 (a value of
// the data: the shifted sums do not cancel the way raw sums of x and x^2 do, whatever the mean). Writes
// part[chunk * c + ch] = S_chunk = sum d and part[(chunks + chunk) * c + ch] = M2_chunk = sum d^2 - S^2 / n (the
// chunk's sum of squared deviations from its own mean); block 0 also writes K to part[2 * chunks * c + ch]. The
// finaliser bn_nhwc_moments_final combines the chunks exactly (Chan et al.'s pairwise formula).
// Chunk `chunk` of `chunks` (a block's: blockIdx.x of gridDim.x, or one of several in bn_nhwc_train_v8's loop).
template <typename T>
__device__ void bnv_moments(const T* __restrict__ x, float* __restrict__ part, int64_t rows, int c, int64_t rpc,
                            int chunk, int chunks) {
    __shared__ float sh[GS_FLOATS];
    const int G = c >> 3, t = threadIdx.x, cg = t % G, ch0 = cg * 8;
    float k[8];
    {
        const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(x + ch0);
#pragma unroll
        for (int j = 0; j < 8; ++j) k[j] = to_f32(v.v[j]);
    }
    float s1[8] = {0, 0, 0, 0, 0, 0, 0, 0}, s2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for_chunk_rows_ld<4, Vec8<T>>(
        rows, c, chunk, chunks, [&](int64_t r) { return *reinterpret_cast<const Vec8<T>*>(x + r * c + ch0); },
        [&](const Vec8<T>& v) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float d = to_f32(v.v[j]) - k[j];
                s1[j] += d;
                s2[j] = fmaf(d, d, s2[j]);
            }
        });
    const float n = ChunkRows(rows, 0, c, chunks)(chunk);
    chunk_sums(s1, s2, sh, G, c, [&](int ch, float S, float Q) {
        part[(int64_t)chunk * c + ch] = S;
        part[((int64_t)chunks + chunk) * c + ch] = fmaxf(fmaf(-S, S / n, Q), 0.0f);
        if (chunk == 0) part[2 * (int64_t)chunks * c + ch] = to_f32(x[ch]);
    });
}

// Per-channel constants of channels ch0 .. ch0 + 7.
struct Consts {
    float mean[8], invstd[8], scale[8], shift[8];
};

// (stats is not __restrict__: the cooperative kernels read it after writing it in an earlier phase.)
__device__ __forceinline__ Consts load_consts(const float* stats, const float* __restrict__ weight,
                                              const float* __restrict__ bias, int c, int ch0) {
    Consts k;
    float w[8];
    load8f(stats + ch0, k.mean);
    load8f(stats + 2 * c + ch0, k.invstd);
    load8f(weight + ch0, w);
    load8f(bias + ch0, k.shift);
#pragma unroll
    for (int j = 0; j < 8; ++j) k.scale[j] = k.invstd[j] * w[j];
    return k;
}

// What a normalisation pass adds before its ReLU: nothing (RES_NONE), the identity shortcut r (RES_RAW: a
// block output), or the shortcut normalised by its own BatchNorm (RES_BN: a downsample block's output); with a
// shortcut the ReLU always follows. Each element as kernels/residual/01_fused.cu's bn_add_relu computes it
// (v = bn_pre(x), res = r or bn_pre_r(r), s = v + res, rounded once).
#define RES_NONE 0
#define RES_RAW 1
#define RES_BN 2

// One group of 8 elements of bnv_apply_res: v (and the shortcut rv) -> o.
template <typename T, int RES>
__device__ __forceinline__ Vec8<T> apply8(const Vec8<T>& v, const Vec8<T>& rv, const Consts& k, const Consts& kr,
                                          int relu) {
    Vec8<T> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float f = bn_pre(to_f32(v.v[j]), k.mean[j], k.scale[j], k.shift[j]);
        if (RES == RES_RAW) f = f + to_f32(rv.v[j]);
        if (RES == RES_BN) f = f + bn_pre(to_f32(rv.v[j]), kr.mean[j], kr.scale[j], kr.shift[j]);
        if (RES != RES_NONE || relu) f = f > 0.0f ? f : 0.0f;
        o.v[j] = from_f32<T>(f);
    }
    return o;
}

// A block output's ReLU mask of 8 elements: bit j set where o.v[j] > 0, the test the join's gradient makes on the
// block output y (bnv_join_partial), so that the backward reads rows * c / 8 bytes instead of y.
template <typename T>
__device__ __forceinline__ uint8_t relu_bits8(const Vec8<T>& o) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m |= (to_f32(o.v[j]) > 0.0f ? 1u : 0u) << j;
    return (uint8_t)m;
}

// y = [relu](bn(x) [+ shortcut]): one thread per 8 consecutive elements, grid-stride. The stride (gridDim.x * 256)
// is a multiple of G = c / 8 (G divides 256): a thread keeps its channel group, so its constants load once.
// The loop takes U groups at a time, all loads first: as a plain grid-stride loop (not unrolled by nvcc) each
// thread had one 16-byte load in flight, and the inner BatchNorm + ReLU launches of a ResNet-152 step moved 34-49%
// of the H100's DRAM peak (scripts/profile-bn.sh, 2026-12-05). Each element's arithmetic is unchanged.
// With MASK (a block output) also each group's relu_bits8, at mask[group] (rows * c / 8 bytes); a template
// parameter, so that the launches without it keep their registers (bnv_apply_masked picks it at run time).
template <typename T, int RES, bool MASK = false>
__device__ void bnv_apply_res(const T* __restrict__ x, const T* __restrict__ r, const float* stats,
                              const float* __restrict__ weight, const float* __restrict__ bias, const float* stats_r,
                              const float* __restrict__ weight_r, const float* __restrict__ bias_r,
                              T* __restrict__ y, int64_t rows, int c, int relu, uint8_t* __restrict__ mask) {
    constexpr int U = RES == RES_NONE ? 4 : 2;
    const int64_t groups = rows * (int64_t)(c >> 3);
    const int64_t g0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int ch0 = (int)(g0 % (c >> 3)) * 8;
    const Consts k = load_consts(stats, weight, bias, c, ch0);
    Consts kr;
    if (RES == RES_BN) kr = load_consts(stats_r, weight_r, bias_r, c, ch0);
    int64_t g = g0;
    for (; g + (U - 1) * stride < groups; g += U * stride) {
        Vec8<T> v[U], rv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = *reinterpret_cast<const Vec8<T>*>(x + (g + u * stride) * 8);
        if (RES != RES_NONE) {
#pragma unroll
            for (int u = 0; u < U; ++u) rv[u] = *reinterpret_cast<const Vec8<T>*>(r + (g + u * stride) * 8);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const Vec8<T> o = apply8<T, RES>(v[u], rv[u], k, kr, relu);
            *reinterpret_cast<Vec8<T>*>(y + (g + u * stride) * 8) = o;
            if (MASK) mask[g + u * stride] = relu_bits8(o);
        }
    }
    for (; g < groups; g += stride) {
        const int64_t i = g * 8;
        const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(x + i);
        Vec8<T> rv;
        if (RES != RES_NONE) rv = *reinterpret_cast<const Vec8<T>*>(r + i);
        const Vec8<T> o = apply8<T, RES>(v, rv, k, kr, relu);
        *reinterpret_cast<Vec8<T>*>(y + i) = o;
        if (MASK) mask[g] = relu_bits8(o);
    }
}

// bnv_apply_res with the mask where mask is non-null (the test made once per launch).
template <typename T, int RES>
__device__ void bnv_apply_masked(const T* __restrict__ x, const T* __restrict__ r, const float* stats,
                                 const float* __restrict__ weight, const float* __restrict__ bias,
                                 const float* stats_r, const float* __restrict__ weight_r,
                                 const float* __restrict__ bias_r, T* __restrict__ y, int64_t rows, int c,
                                 uint8_t* __restrict__ mask) {
    if (mask != nullptr) {
        bnv_apply_res<T, RES, true>(x, r, stats, weight, bias, stats_r, weight_r, bias_r, y, rows, c, 1, mask);
    } else {
        bnv_apply_res<T, RES>(x, r, stats, weight, bias, stats_r, weight_r, bias_r, y, rows, c, 1, nullptr);
    }
}

template <typename T>
__device__ void bnv_apply(const T* __restrict__ x, const float* stats, const float* __restrict__ weight,
                          const float* __restrict__ bias, T* __restrict__ y, int64_t rows, int c, int relu) {
    bnv_apply_res<T, RES_NONE>(x, nullptr, stats, weight, bias, nullptr, nullptr, nullptr, y, rows, c, relu, nullptr);
}

// g (dy, masked by the ReLU recomputed from x when relu) and xhat of one element, as 01's bn_grad.
__device__ __forceinline__ void grad_of(float xv, float dyv, const Consts& k, int j, int relu, float& g, float& xhat) {
    g = (relu && !(bn_pre(xv, k.mean[j], k.scale[j], k.shift[j]) >= 0.0f)) ? 0.0f : dyv;
    xhat = (xv - k.mean[j]) * k.invstd[j];
}

// One row of a chunk's backward sums: the 8 elements (x, dy) added to ag (g) and agx (g * xhat), in order.
template <typename T>
__device__ __forceinline__ void add_grad_row(const Vec8<T>& xv, const Vec8<T>& gv, const Consts& k, int relu,
                                             float (&ag)[8], float (&agx)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float g, xhat;
        grad_of(to_f32(xv.v[j]), to_f32(gv.v[j]), k, j, relu, g, xhat);
        ag[j] += g;
        agx[j] = fmaf(g, xhat, agx[j]);
    }
}

// The chunk's backward sums over the block's threads of each channel group (chunk_sums), written as its partials:
// part[chunk * c + ch] = sum g, part[(chunks + chunk) * c + ch] = sum g * xhat.
__device__ __forceinline__ void write_grad_partials(const float (&ag)[8], const float (&agx)[8], float* sh, int G,
                                                    float* __restrict__ part, int c, int chunk, int chunks) {
    chunk_sums(ag, agx, sh, G, c, [&](int ch, float sg, float sgx) {
        part[(int64_t)chunk * c + ch] = sg;
        part[((int64_t)chunks + chunk) * c + ch] = sgx;
    });
}

template <typename T>
__device__ void bnv_bwd_partial(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ stats,
                                const float* __restrict__ weight, const float* __restrict__ bias,
                                float* __restrict__ part, int64_t rows, int c, int64_t rpc, int relu, int chunk,
                                int chunks) {
    __shared__ float sh[GS_FLOATS];
    const int G = c >> 3, t = threadIdx.x, cg = t % G, ch0 = cg * 8;
    const Consts k = load_consts(stats, weight, bias, c, ch0);
    float ag[8] = {0, 0, 0, 0, 0, 0, 0, 0}, agx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for_chunk_rows<4>(rows, c, chunk, chunks, [&](int64_t r) {
        const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(x + r * c + ch0);
        const Vec8<T> gv = *reinterpret_cast<const Vec8<T>*>(dy + r * c + ch0);
        add_grad_row(xv, gv, k, relu, ag, agx);
    });
    write_grad_partials(ag, agx, sh, G, part, c, chunk, chunks);
}

// The ReLU gradient at a block's output joined with the residual gradient, as relu_grad_{1,2} of
// kernels/residual/01_fused.cu compute it (g = y > 0 ? a (+ b) : 0 in FP32, rounded once to T and written to gout),
// and in the same pass the BatchNorm backward sums over (x, g) of the block's last BatchNorm, as bnv_bwd_partial
// (relu = 0) computes them from the rounded g: same chunks, the same per-row and per-chunk code (add_grad_row,
// write_grad_partials), same partial layout (reduced by bn_nhwc_bwd_final_v8), so g and the sums equal the two
// kernels' bit for bit, with one read of g and one launch fewer.
// With STRIDED (TWO only) b is the shortcut gradient of a 1x1 stride-2 downsample on its own grid: (n, (bh + 1) / 2,
// (bw + 1) / 2, c) for a block output of (n, bh, bw, c) rows, nonzero only at the even (y, x) cells, where it reads
// b and elsewhere adds +0 (what the memset of the full-size strided grad-input holds), so g is the same bit for bit
// without the full-size b (ResNet-152 at batch 256: 411 + 205 + 103 MB memset, then read here, a step).
template <typename T, bool TWO, bool STRIDED = false>
__device__ void bnv_join_partial(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ y,
                                 const uint8_t* __restrict__ mask, T* __restrict__ gout, const T* __restrict__ x,
                                 const float* __restrict__ stats, const float* __restrict__ weight,
                                 const float* __restrict__ bias, float* __restrict__ part, int64_t rows, int c,
                                 int64_t rpc, int chunk, int chunks, int bh = 0, int bw = 0) {
    __shared__ float sh[GS_FLOATS];
    const int G = c >> 3, t = threadIdx.x, cg = t % G, ch0 = cg * 8;
    const Consts k = load_consts(stats, weight, bias, c, ch0);
    float ag[8] = {0, 0, 0, 0, 0, 0, 0, 0}, agx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    // STRIDED's coordinates take registers: 2 rows in flight there instead of 4 (no spills).
    for_chunk_rows<STRIDED ? 2 : 4, false>(rows, c, chunk, chunks, [&](int64_t r) {
        const int64_t i = r * c + ch0;
        const Vec8<T> av = *reinterpret_cast<const Vec8<T>*>(a + i);
        // The ReLU's mask: y > 0, or its bits (relu_bits8 of the same y) where the forward wrote them.
        uint32_t m = 0;
        Vec8<T> yv;
        if (mask != nullptr) {
            m = mask[i >> 3];
        } else {
            yv = *reinterpret_cast<const Vec8<T>*>(y + i);
        }
        const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(x + i);
        Vec8<T> bv;
        if (TWO && !STRIDED) bv = *reinterpret_cast<const Vec8<T>*>(b + i);
        if (STRIDED) {
            // 32-bit cell coordinates (the launcher checks rows < 2^31).
            const int rr = (int)r, plane = bh * bw;
            const int img = rr / plane, rem = rr - img * plane;
            const int yy = rem / bw, xx = rem - yy * bw;
            if (((yy | xx) & 1) == 0) {
                const int oh = (bh + 1) >> 1, ow = (bw + 1) >> 1;
                const int64_t o = (int64_t)((img * oh + (yy >> 1)) * ow + (xx >> 1)) * c + ch0;
                bv = *reinterpret_cast<const Vec8<T>*>(b + o);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) bv.v[j] = from_f32<T>(0.0f);
            }
        }
        Vec8<T> gv;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float s = TWO ? to_f32(av.v[j]) + to_f32(bv.v[j]) : to_f32(av.v[j]);
            const bool on = mask != nullptr ? ((m >> j) & 1u) != 0u : to_f32(yv.v[j]) > 0.0f;
            gv.v[j] = from_f32<T>(on ? s : 0.0f);
        }
        *reinterpret_cast<Vec8<T>*>(gout + i) = gv;
        add_grad_row(xv, gv, k, 0, ag, agx);
    });
    write_grad_partials(ag, agx, sh, G, part, c, chunk, chunks);
}

// One group of 8 elements of bnv_bwd_dx.
template <typename T>
__device__ __forceinline__ Vec8<T> dx8(const Vec8<T>& xv, const Vec8<T>& gv, const Consts& k, const float (&a)[8],
                                       const float (&k1)[8], const float (&k2)[8], int relu) {
    Vec8<T> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float gr, xhat;
        grad_of(to_f32(xv.v[j]), to_f32(gv.v[j]), k, j, relu, gr, xhat);
        // (gr - k1) - xhat k2 as one explicit FMA: the form ptxas chose for the plain expression, written out so
        // that every kernel that inlines this (the cooperative ones too) rounds the same way.
        o.v[j] = from_f32<T>(a[j] * fmaf(-xhat, k2[j], gr - k1[j]));
    }
    return o;
}

// The grad-input factors of channels ch0 .. ch0 + 7: a = weight * invstd, k1 = sum g / count, k2 = sum g xhat /
// count (sums (2, c), written by an earlier phase in the cooperative kernels: not __restrict__).
__device__ __forceinline__ void dx_factors(const float* __restrict__ weight, const float* sums, const Consts& k,
                                           int c, int ch0, float count, float (&a)[8], float (&k1)[8],
                                           float (&k2)[8]) {
    float w[8], s1[8], s2[8];
    load8f(weight + ch0, w);
    load8f(sums + ch0, s1);
    load8f(sums + c + ch0, s2);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        a[j] = w[j] * k.invstd[j];
        k1[j] = s1[j] / count;
        k2[j] = s2[j] / count;
    }
}

template <typename T>
__device__ void bnv_bwd_dx(const T* __restrict__ x, const T* dy, const float* stats,
                           const float* __restrict__ weight, const float* __restrict__ bias,
                           const float* sums, T* __restrict__ dx, int64_t rows, int c, float count,
                           int relu) {
    const int64_t groups = rows * (int64_t)(c >> 3);
    const int64_t g0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    // The stride (gridDim.x * 256) is a multiple of G = c / 8 (G divides 256): a thread keeps its channel group,
    // so its per-channel constants are loaded once.
    const int ch0 = (int)(g0 % (c >> 3)) * 8;
    const Consts k = load_consts(stats, weight, bias, c, ch0);
    float a[8], k1[8], k2[8];
    dx_factors(weight, sums, k, c, ch0, count, a, k1, k2);
    // Two groups at a time, loads first (as bnv_apply_res, for the loads in flight).
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t g = g0;
    for (; g + stride < groups; g += 2 * stride) {
        Vec8<T> xv[2], gv[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            xv[u] = *reinterpret_cast<const Vec8<T>*>(x + (g + u * stride) * 8);
            gv[u] = *reinterpret_cast<const Vec8<T>*>(dy + (g + u * stride) * 8);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            *reinterpret_cast<Vec8<T>*>(dx + (g + u * stride) * 8) = dx8<T>(xv[u], gv[u], k, a, k1, k2, relu);
        }
    }
    for (; g < groups; g += stride) {
        const int64_t i = g * 8;
        const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(x + i);
        const Vec8<T> gv = *reinterpret_cast<const Vec8<T>*>(dy + i);
        *reinterpret_cast<Vec8<T>*>(dx + i) = dx8<T>(xv, gv, k, a, k1, k2, relu);
    }
}

#define BNV_EXPORT(T, NAME)                                                                                         \
    extern "C" __global__ void bn_nhwc_moments_v8_##NAME(const T* x, float* part, long long rows, int c,            \
                                                         long long rpc) {                                           \
        bnv_moments<T>(x, part, rows, c, rpc, blockIdx.x, gridDim.x);                                               \
    }                                                                                                               \
    extern "C" __global__ void bn_nhwc_apply_v8_##NAME(const T* x, const float* stats, const float* weight,          \
                                                       const float* bias, T* y, long long rows, int c, int relu) {   \
        bnv_apply<T>(x, stats, weight, bias, y, rows, c, relu);                                                     \
    }                                                                                                               \
    extern "C" __global__ void bn_nhwc_bwd_sum_v8_##NAME(const T* x, const T* dy, const float* stats,               \
                                                         const float* weight, const float* bias, float* part,       \
                                                         long long rows, int c, long long rpc, int relu) {          \
        bnv_bwd_partial<T>(x, dy, stats, weight, bias, part, rows, c, rpc, relu, blockIdx.x, gridDim.x);            \
    }                                                                                                               \
    extern "C" __global__ void bn_nhwc_bwd_dx_v8_##NAME(const T* x, const T* dy, const float* stats,                \
                                                        const float* weight, const float* bias, const float* sums,  \
                                                        T* dx, long long rows, int c, float count, int relu) {      \
        bnv_bwd_dx<T>(x, dy, stats, weight, bias, sums, dx, rows, c, count, relu);                                  \
    }                                                                                                               \
    extern "C" __global__ void bn_nhwc_join_sum_1_v8_##NAME(const T* a, const T* b, const T* y, T* g, const T* x,   \
                                                            const float* stats, const float* weight,                \
                                                            const float* bias, float* part, long long rows, int c,  \
                                                            long long rpc) {                                        \
        bnv_join_partial<T, false>(a, b, y, nullptr, g, x, stats, weight, bias, part, rows, c, rpc, blockIdx.x,     \
                                   gridDim.x);                                                                      \
    }                                                                                                               \
    extern "C" __global__ void bn_nhwc_join_sum_2_v8_##NAME(const T* a, const T* b, const T* y, T* g, const T* x,   \
                                                            const float* stats, const float* weight,                \
                                                            const float* bias, float* part, long long rows, int c,  \
                                                            long long rpc) {                                        \
        bnv_join_partial<T, true>(a, b, y, nullptr, g, x, stats, weight, bias, part, rows, c, rpc, blockIdx.x,      \
                                  gridDim.x);                                                                       \
    }

BNV_EXPORT(float, f32)
BNV_EXPORT(__nv_bfloat16, bf16)
BNV_EXPORT(__half, f16)

// The finalisers below: block (FX, FY) = (8 channels, 128 chunk lanes), one block per 8 channels; each column
// sums its chunks in a strided loop, then a fixed-order tree over the 128 lanes (deterministic). 01's finalisers
// (32 x 8 threads per 32 channels) left ~1000 chunks to 8 lanes: 19-45 us a launch on the H200, 10 ms per
// ResNet-152 step. Their bodies (moments_final_cols, bwd_final_cols) take the column count NX as a template
// parameter: bn_nhwc_train_v8 / bn_nhwc_train_bwd_v8 run them with 2 columns x the same 128 lanes in their
// 256-thread blocks, so every channel is reduced in the same order and the results are equal bit for bit.
#define FX 8
#define FY 128

// Sum of acc over the FY lanes of column tx (lane ty), returned to every thread of the column.
template <int NX>
__device__ __forceinline__ float lane_sum(float acc, float (&sh)[FY][NX], int tx, int ty) {
    sh[ty][tx] = acc;
    __syncthreads();
#pragma unroll
    for (int s = FY / 2; s > 0; s >>= 1) {
        if (ty < s) sh[ty][tx] += sh[ty + s][tx];
        __syncthreads();
    }
    const float r = sh[0][tx];
    __syncthreads();
    return r;
}

// lane_sum of two values at once (a through sh, b through shb): each reduced by the same tree as lane_sum alone,
// so the same sums bit for bit, with one set of barriers for both.
template <int NX>
__device__ __forceinline__ void lane_sum2(float& a, float& b, float (&sh)[FY][NX], float (&shb)[FY][NX], int tx,
                                          int ty) {
    sh[ty][tx] = a;
    shb[ty][tx] = b;
    __syncthreads();
#pragma unroll
    for (int s = FY / 2; s > 0; s >>= 1) {
        if (ty < s) {
            sh[ty][tx] += sh[ty + s][tx];
            shb[ty][tx] += shb[ty + s][tx];
        }
        __syncthreads();
    }
    a = sh[0][tx];
    b = shb[0][tx];
    __syncthreads();
}

// A chunk's term of the second (M2) sum: its own M2 plus n (mean_k - dmean)^2, with n its rows and mean_k = S / n
// (Chan's merge about the first sum's mean).
__device__ __forceinline__ float m2_term(float s, float m2, float n, float dmean) {
    const float d = s / n - dmean;
    return fmaf(n * d, d, m2);
}

// Channel ch (column tx, lane ty) of bn_nhwc_moments_final; every thread of the block calls it (barriers).
template <int NX>
__device__ __forceinline__ void moments_final_cols(const float* part, float* __restrict__ stats,
                                                   int chunks, int c, long long rows, long long rpc, float eps,
                                                   float* running_mean, float* running_var, float momentum, int ch,
                                                   int tx, int ty, float (&sh)[FY][NX]) {
    const float count = (float)rows;
    const ChunkRows nrows(rows, rpc, c, chunks);
    // The values the lane-0 thread needs after the sums (the shift K, the running statistics), loaded now, so
    // that their latency runs under the reductions instead of after them.
    float kshift = 0.0f, rmean = 0.0f, rvar = 0.0f;
    if (ty == 0 && ch < c) {
        kshift = part[2 * (int64_t)chunks * c + ch];
        if (running_mean != nullptr) {
            rmean = running_mean[ch];
            rvar = running_var[ch];
        }
    }
    // Up to FK partials a lane (chunks <= FK * FY: the launchers' default split, 132 x 3 chunks) are loaded
    // once, S and M2 together, so that the second sum waits for no load; the epilogue's 128-row chunks (thousands)
    // read them in the loops. The same additions in the same order either way.
    constexpr int FK = 4;
    const bool held = chunks <= FK * FY;
    float sv[FK], mv[FK];
    float acc = 0.0f;
    if (held) {
#pragma unroll
        for (int i = 0; i < FK; ++i) {
            const int k = ty + i * FY;
            const bool in = ch < c && k < chunks;
            sv[i] = in ? part[(int64_t)k * c + ch] : 0.0f;
            mv[i] = in ? part[((int64_t)chunks + k) * c + ch] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < FK; ++i) {
            if (ch < c && ty + i * FY < chunks) acc += sv[i];
        }
    } else if (ch < c) {
        for (int k = ty; k < chunks; k += FY) acc += part[(int64_t)k * c + ch];
    }
    const float dmean = lane_sum<NX>(acc, sh, tx, ty) / count;
    acc = 0.0f;
    if (held) {
#pragma unroll
        for (int i = 0; i < FK; ++i) {
            const int k = ty + i * FY;
            if (ch < c && k < chunks) acc += m2_term(sv[i], mv[i], nrows(k), dmean);
        }
    } else if (ch < c) {
        for (int k = ty; k < chunks; k += FY)
            acc += m2_term(part[(int64_t)k * c + ch], part[((int64_t)chunks + k) * c + ch], nrows(k), dmean);
    }
    const float m2 = lane_sum<NX>(acc, sh, tx, ty);
    if (ty == 0 && ch < c) {
        const float mean = kshift + dmean;
        const float var = m2 / count;
        stats[ch] = mean;
        stats[c + ch] = var;
        stats[2 * c + ch] = 1.0f / sqrtf(var + eps);
        if (running_mean != nullptr) {
            const float unbiased = var * (count / (count - 1.0f));
            running_mean[ch] = (1.0f - momentum) * rmean + momentum * mean;
            running_var[ch] = (1.0f - momentum) * rvar + momentum * unbiased;
        }
    }
}

// Channel ch (column tx, lane ty) of bn_nhwc_bwd_final_v8; every thread of the block calls it (barriers).
// Up to FK partials a lane are loaded at once (as moments_final_cols does; the loop took one chunk's pair at a
// time), then added in the loop's order; the two sums share one lane_sum2.
template <int NX>
__device__ __forceinline__ void bwd_final_cols(const float* part, float* __restrict__ sums, int chunks,
                                               int c, int ch, int tx, int ty, float (&sh)[FY][NX],
                                               float (&shb)[FY][NX]) {
    constexpr int FK = 4;
    float ag = 0.0f, agx = 0.0f;
    if (ch < c) {
        if (chunks <= FK * FY) {
            float gv[FK], xv[FK];
#pragma unroll
            for (int i = 0; i < FK; ++i) {
                const int k = ty + i * FY;
                gv[i] = k < chunks ? part[(int64_t)k * c + ch] : 0.0f;
                xv[i] = k < chunks ? part[((int64_t)chunks + k) * c + ch] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < FK; ++i) {
                if (ty + i * FY < chunks) {
                    ag += gv[i];
                    agx += xv[i];
                }
            }
        } else {
            for (int k = ty; k < chunks; k += FY) {
                ag += part[(int64_t)k * c + ch];
                agx += part[((int64_t)chunks + k) * c + ch];
            }
        }
    }
    lane_sum2<NX>(ag, agx, sh, shb, tx, ty);
    if (ty == 0 && ch < c) {
        sums[ch] = ag;
        sums[c + ch] = agx;
    }
}

// Combines bn_nhwc_moments_v8's chunks into stats (3, c) = [mean, biased var, invstd] (chunk i holds n_i rows:
// rpc = 0 for the moments pass's row groups, rpc > 0 for a convolution epilogue's chunks of rpc rows, ChunkRows):
// D = sum S_i / N, mean = K + D, M2 = sum M2_i + n_i (S_i / n_i - D)^2, in a fixed order. With running_mean
// (non-null) also PyTorch's running update in place, with the unbiased variance:
// running = (1 - momentum) running + momentum batch, and num_batches_tracked (non-null) += 1. Block (FX, FY), one
// block per FX channels.
extern "C" __global__ void __launch_bounds__(FX * FY)
    bn_nhwc_moments_final(const float* part, float* stats, int chunks, int c, long long rows, long long rpc, float eps,
                          float* running_mean, float* running_var, long long* num_batches_tracked, float momentum) {
    __shared__ float sh[FY][FX];
    const int tx = threadIdx.x, ty = threadIdx.y;
    moments_final_cols<FX>(part, stats, chunks, c, rows, rpc, eps, running_mean, running_var, momentum,
                           blockIdx.x * FX + tx, tx, ty, sh);
    if (num_batches_tracked != nullptr && blockIdx.x == 0 && tx == 0 && ty == 0) num_batches_tracked[0] += 1;
}

// sums (2, c) = [sum g (dbias), sum g * xhat (dweight)] from bn_nhwc_bwd_sum_v8's two halves of partials.
extern "C" __global__ void __launch_bounds__(FX * FY)
    bn_nhwc_bwd_final_v8(const float* part, float* sums, int chunks, int c) {
    __shared__ float sh[FY][FX], shb[FY][FX];
    bwd_final_cols<FX>(part, sums, chunks, c, blockIdx.x * FX + threadIdx.x, threadIdx.x, threadIdx.y, sh, shb);
}

// ----- one cooperative launch per BatchNorm (kernels.bn_cooperative) ------------------------------------------
// bn_nhwc_train_v8: the statistics and the normalisation of a training-mode BatchNorm (+ ReLU) in one launch,
// equal bit for bit to bn_nhwc_moments_v8 + bn_nhwc_moments_final + bn_nhwc_apply_v8 (with res non-null:
// + the residual kernels' bn_add_relu_raw_v8, y = relu(bn(x) + res), a block output): phase 1 writes the same
// chunks' partials (each block loops over chunks blockIdx.x, + gridDim.x, ...), phase 2 runs the finaliser's
// body over pairs of channels (2 columns x the same 128 lanes), phase 3 the element-wise pass. Between the phases
// a grid-wide barrier (cooperative_groups, a cooperative launch: every block resident at once, so the grid is at
// most the occupancy times the SMs; the launcher sizes it). Block 256 threads (VB), grid <= chunks.
// bn_nhwc_train_bwd_v8: the backward the same way, bn_nhwc_bwd_sum_v8 + bn_nhwc_bwd_final_v8 + bn_nhwc_bwd_dx_v8
// in one launch, the sums (2, c) also written out (dbias, dweight). With have_sums phase 1 is skipped: part already
// holds the chunks' partials of the backward sums, written by the grad-input's epilogue (kernels.bn_stats "fused"
// or "backward": chunks = its 128-row units), so the launch is bit for bit bn_nhwc_bwd_final_v8 over them +
// bn_nhwc_bwd_dx_v8, in one launch instead of two.
// With rev (the launchers' default) phase 1 takes the chunks from the last to the first (block b first takes
// chunk chunks - 1 - b): the kernel before it (the conv that made x, the grad-input that made dy) wrote the
// tensors' ends last, so those are what the 50 MB L2 still holds; phase 3 then runs from the front, which phase 1
// read last. Each chunk's partials are the same whichever block computes them, so the results do not change.
// With have_moments (bn_nhwc_train_v8, bn_nhwc_train2_v8) phase 1 is skipped: part (and part_r) already hold the
// chunks' partials in bn_nhwc_moments_v8's layout, written by the convolution's epilogue (kernels.bn_stats with
// kernels.bn_cooperative; rpc = the epilogue's 128 rows a chunk), so the launch is bit for bit
// bn_nhwc_moments_final + the element-wise pass over them.
// Phases 1 and 2 of bn_nhwc_train_v8 (and bn_nhwc_train_pool_v8), each ending at a grid-wide barrier: the
// chunks' partials (unless have_moments), then stats and the running update.
template <typename T>
__device__ void bnv_train_stats(const T* __restrict__ x, float* __restrict__ part, float* __restrict__ stats,
                                int64_t rows, int c, int64_t rpc, int chunks, float eps, float* running_mean,
                                float* running_var, long long* num_batches_tracked, float momentum, int have_moments,
                                int rev) {
    cg::grid_group grid = cg::this_grid();
    if (!have_moments) {
        for (int k = blockIdx.x; k < chunks; k += gridDim.x) {
            bnv_moments<T>(x, part, rows, c, rpc, rev ? chunks - 1 - k : k, chunks);
        }
        grid.sync();
    }
    __shared__ float sh[FY][2];
    const int tx = threadIdx.x & 1, ty = threadIdx.x >> 1;
    for (int p = blockIdx.x; p < (c >> 1); p += gridDim.x) {
        moments_final_cols<2>(part, stats, chunks, c, rows, have_moments ? rpc : 0, eps, running_mean, running_var,
                              momentum, 2 * p + tx, tx, ty, sh);
    }
    if (num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) num_batches_tracked[0] += 1;
    grid.sync();
}

template <typename T>
__device__ void bnv_train(const T* __restrict__ x, const T* __restrict__ res, float* __restrict__ part,
                          float* __restrict__ stats, const float* __restrict__ weight, const float* __restrict__ bias,
                          T* __restrict__ y, uint8_t* __restrict__ mask, int64_t rows, int c, int64_t rpc,
                          int chunks, float eps, float* running_mean, float* running_var,
                          long long* num_batches_tracked, float momentum, int relu, int have_moments, int rev) {
    bnv_train_stats<T>(x, part, stats, rows, c, rpc, chunks, eps, running_mean, running_var, num_batches_tracked,
                       momentum, have_moments, rev);
    // y null: the statistics only (the normalisation runs inside the next convolution, ig::bnin_a / bnin_b).
    if (y == nullptr) return;
    if (res != nullptr) {
        bnv_apply_masked<T, RES_RAW>(x, res, stats, weight, bias, nullptr, nullptr, nullptr, y, rows, c, mask);
    } else {
        bnv_apply<T>(x, stats, weight, bias, y, rows, c, relu);
    }
}

// A downsample block's output in one launch: the statistics of its last conv output x and of the downsample conv
// output r (same rows and channels), then y = relu(bn(x) + bn_r(r)), bit for bit bn_nhwc_moments_v8 +
// bn_nhwc_moments_final twice + the residual kernels' bn_add_relu_bn_v8 (v = bn(x), res = bn_r(r), s = v + res).
// Phase 1 runs both tensors' chunks (work items 0 .. 2 chunks), phase 2 both finalisers (2 x c / 2 channel pairs).
template <typename T>
__device__ void bnv_train2(const T* __restrict__ x, const T* __restrict__ r, float* __restrict__ part,
                           float* __restrict__ part_r, float* __restrict__ stats, float* __restrict__ stats_r,
                           const float* __restrict__ weight, const float* __restrict__ bias,
                           const float* __restrict__ weight_r, const float* __restrict__ bias_r, T* __restrict__ y,
                           uint8_t* __restrict__ mask, int64_t rows, int c, int64_t rpc, int chunks, float eps,
                           float eps_r, float* running_mean, float* running_var, long long* num_batches_tracked,
                           float* running_mean_r, float* running_var_r, long long* num_batches_tracked_r,
                           float momentum, float momentum_r, int have_moments, int rev) {
    cg::grid_group grid = cg::this_grid();
    if (!have_moments) {
        for (int kk = blockIdx.x; kk < 2 * chunks; kk += gridDim.x) {
            const int k = rev ? 2 * chunks - 1 - kk : kk;
            if (k < chunks) {
                bnv_moments<T>(x, part, rows, c, rpc, k, chunks);
            } else {
                bnv_moments<T>(r, part_r, rows, c, rpc, k - chunks, chunks);
            }
        }
        grid.sync();
    }
    __shared__ float sh[FY][2];
    const int tx = threadIdx.x & 1, ty = threadIdx.x >> 1, pairs = c >> 1;
    for (int p = blockIdx.x; p < 2 * pairs; p += gridDim.x) {
        if (p < pairs) {
            moments_final_cols<2>(part, stats, chunks, c, rows, have_moments ? rpc : 0, eps, running_mean,
                                  running_var, momentum, 2 * p + tx, tx, ty, sh);
        } else {
            moments_final_cols<2>(part_r, stats_r, chunks, c, rows, have_moments ? rpc : 0, eps_r, running_mean_r,
                                  running_var_r, momentum_r, 2 * (p - pairs) + tx, tx, ty, sh);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (num_batches_tracked != nullptr) num_batches_tracked[0] += 1;
        if (num_batches_tracked_r != nullptr) num_batches_tracked_r[0] += 1;
    }
    grid.sync();
    bnv_apply_masked<T, RES_BN>(x, r, stats, weight, bias, stats_r, weight_r, bias_r, y, rows, c, mask);
}

template <typename T>
__device__ void bnv_train_bwd(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ stats,
                              const float* __restrict__ weight, const float* __restrict__ bias,
                              float* __restrict__ part, float* __restrict__ sums, T* __restrict__ dx, int64_t rows,
                              int c, int64_t rpc, int chunks, float count, int relu, int rev, int have_sums) {
    cg::grid_group grid = cg::this_grid();
    if (!have_sums) {
        for (int k = blockIdx.x; k < chunks; k += gridDim.x) {
            bnv_bwd_partial<T>(x, dy, stats, weight, bias, part, rows, c, rpc, relu, rev ? chunks - 1 - k : k,
                               chunks);
        }
        grid.sync();
    }
    __shared__ float sh[FY][2], shb[FY][2];
    const int tx = threadIdx.x & 1, ty = threadIdx.x >> 1;
    for (int p = blockIdx.x; p < (c >> 1); p += gridDim.x) {
        bwd_final_cols<2>(part, sums, chunks, c, 2 * p + tx, tx, ty, sh, shb);
    }
    grid.sync();
    bnv_bwd_dx<T>(x, dy, stats, weight, bias, sums, dx, rows, c, count, relu);
}

// bn_nhwc_train_join_bwd_{1,2}_v8: a block output's ReLU gradient (joined with the shortcut's gradient b for
// _2) and its last BatchNorm's backward in one launch, bit for bit bn_nhwc_join_sum_{1,2}_v8 +
// bn_nhwc_bwd_final_v8 + bn_nhwc_bwd_dx_v8 (relu = 0): phase 1 writes g (the gradient at the pre-ReLU block output)
// and the sums' partials, phase 3 dx from (x, g).
// With STRIDED, b on the stride-2 downsample's grid (bnv_join_partial): bn_nhwc_train_join_bwd_2s_v8.
template <typename T, bool TWO, bool STRIDED = false>
__device__ void bnv_train_join_bwd(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ y,
                                   const uint8_t* __restrict__ mask, T* __restrict__ gout, const T* __restrict__ x,
                                   const float* __restrict__ stats, const float* __restrict__ weight,
                                   const float* __restrict__ bias, float* __restrict__ part, float* __restrict__ sums,
                                   T* __restrict__ dx, int64_t rows, int c, int64_t rpc, int chunks, float count,
                                   int rev, int bh = 0, int bw = 0) {
    cg::grid_group grid = cg::this_grid();
    for (int k = blockIdx.x; k < chunks; k += gridDim.x) {
        const int kc = rev ? chunks - 1 - k : k;
        bnv_join_partial<T, TWO, STRIDED>(a, b, y, mask, gout, x, stats, weight, bias, part, rows, c, rpc, kc, chunks,
                                          bh, bw);
    }
    grid.sync();
    __shared__ float sh[FY][2], shb[FY][2];
    const int tx = threadIdx.x & 1, ty = threadIdx.x >> 1;
    for (int p = blockIdx.x; p < (c >> 1); p += gridDim.x) {
        bwd_final_cols<2>(part, sums, chunks, c, 2 * p + tx, tx, ty, sh, shb);
    }
    grid.sync();
    bnv_bwd_dx<T>(x, gout, stats, weight, bias, sums, dx, rows, c, count, 0);
}

// bn_nhwc_train_pool_v8: the ImageNet stem's BatchNorm + ReLU and its max-pool (kernel 3, stride 2, padding 1)
// in one launch, bit for bit bn_nhwc_train_v8 (relu) followed by maxpool/04_nhwc_vec.cu's maxpool2d_nhwc_fwd_v8 and
// maxpool2d_nhwc_argmax_v8 on its output: phases 1 and 2 as bn_nhwc_train_v8's, phase 3 the pool over
// v = relu(bn(x)) rounded to T (apply8's expression), computed as the windows read x, so the full-resolution
// activation (ResNet-152 at batch 256: 411 MB) is never written nor read back twice. x (n, h, w, c) -> y (n, oh,
// ow, c) and arg (n, oh, ow, c) bytes, the winner's offset ky * 3 + kx in its window (window8's rules: the first
// maximum wins, a NaN always wins). One thread per (output pixel, 8 channels), grid-stride; the stride is a
// multiple of G = c / 8, so a thread keeps its channel group and loads its constants once.
// The value the stem's pool compares: relu(bn(x)) rounded to T, as apply8 writes it (window8's map).
template <typename T>
struct BnReluRounded {
    const Consts& k;
    __device__ __forceinline__ float operator()(float v, int j) const {
        float f = bn_pre(v, k.mean[j], k.scale[j], k.shift[j]);
        f = f > 0.0f ? f : 0.0f;
        return to_f32(from_f32<T>(f));
    }
};

template <typename T>
__device__ void bnv_pool_k3s2p1(const T* __restrict__ x, const float* stats, const float* __restrict__ weight,
                                const float* __restrict__ bias, T* __restrict__ y, uint8_t* __restrict__ arg, int n,
                                int h, int w, int c, int oh, int ow) {
    // 32-bit coordinates (the launcher checks n * oh * ow * G < 2^31); G is a power of two.
    const int G = c >> 3, gshift = __ffs(G) - 1;
    const int plane = oh * ow;
    const int groups = n * plane * G;
    const int g0 = blockIdx.x * blockDim.x + threadIdx.x;
    const int stride = gridDim.x * blockDim.x;
    const int ch0 = (g0 & (G - 1)) * 8;
    const Consts k = load_consts(stats, weight, bias, c, ch0);
    const PoolGeomNhwc g{h, w, c, oh, ow, 3, 2, 1};
    for (int i = g0; i < groups; i += stride) {
        const int pix = i >> gshift;
        const int img = pix / plane;
        const int rem = pix - img * plane;
        const int oy = rem / ow, ox = rem - oy * ow;
        int a[8];
        float best[8];
        window8<T>(x + (int64_t)img * h * w * c, g, oy, ox, ch0, a, best, BnReluRounded<T>{k});
        Vec8<T> out;
#pragma unroll
        for (int j = 0; j < 8; ++j) out.v[j] = from_f32<T>(best[j]);
        *reinterpret_cast<Vec8<T>*>(y + (int64_t)pix * c + ch0) = out;
        *reinterpret_cast<uint2*>(arg + (int64_t)pix * c + ch0) = pack_offsets8(a);
    }
}

// ----- the stem's max-pool backward inside its BatchNorm backward (bn_nhwc_train_bwd_pool_v8) --------------------
// The gradient at stem cell (iy, ix) (8 channels from ch0) of image img, gathered from the pooled gradient g1 (+ g2,
// the first block's two gradients: each window's sum rounded to T first) through the windows' argmax offsets arg:
// bit for bit maxpool/04_nhwc_vec.cu's maxpool_bwd_k3s2p1_v8 (cell (2m + cy, 2q + cx) lies in windows (m + wy,
// q + wx), wy <= cy, wx <= cx, at offset (cy + 1 - 2 wy) * 3 + (cx + 1 - 2 wx); the windows that chose it summed
// from 0 in that order, then rounded to T).
template <typename T>
__device__ __forceinline__ Vec8<T> pool_grad8(const uint8_t* __restrict__ arg, const T* __restrict__ g1,
                                              const T* __restrict__ g2, int img, int iy, int ix, int c, int oh,
                                              int ow, int ch0) {
    const int m = iy >> 1, cy = iy & 1, q = ix >> 1, cx = ix & 1;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int wy = 0; wy <= cy; ++wy) {
        for (int wx = 0; wx <= cx; ++wx) {
            const int oy = m + wy, ox = q + wx;
            if (oy >= oh || ox >= ow) continue;
            const int64_t o = ((int64_t)(img * oh + oy) * ow + ox) * c + ch0;
            const uint2 a = *reinterpret_cast<const uint2*>(arg + o);
            Vec8<T> d = *reinterpret_cast<const Vec8<T>*>(g1 + o);
            if (g2 != nullptr) {
                const Vec8<T> d2 = *reinterpret_cast<const Vec8<T>*>(g2 + o);
#pragma unroll
                for (int j = 0; j < 8; ++j) d.v[j] = d.v[j] + d2.v[j];
            }
            const int want = (cy + 1 - 2 * wy) * 3 + (cx + 1 - 2 * wx);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint32_t word = j < 4 ? a.x : a.y;
                if ((int)((word >> (8 * (j & 3))) & 255u) == want) acc[j] += to_f32(d.v[j]);
            }
        }
    }
    Vec8<T> out;
#pragma unroll
    for (int j = 0; j < 8; ++j) out.v[j] = from_f32<T>(acc[j]);
    return out;
}

// The stem's pool geometry and its gradients, for pool_grad8 at a row (cell) of the stem's (n h w, c) rows.
template <typename T>
struct PoolDy {
    const uint8_t* __restrict__ arg;
    const T* __restrict__ g1;
    const T* __restrict__ g2;
    int h, w, c, oh, ow;
    // Row (cell) `row` < 2^31 (the launcher checks rows * G < 2^31): 32-bit divisions.
    __device__ __forceinline__ Vec8<T> at(int row, int ch0) const {
        const int hw = h * w;
        const int img = row / hw;
        const int rem = row - img * hw;
        const int iy = rem / w;
        return pool_grad8<T>(arg, g1, g2, img, iy, rem - iy * w, c, oh, ow, ch0);
    }
};

// bn_nhwc_train_bwd_pool_v8: the stem's max-pool backward (from the offsets, of g1 + g2) and its BatchNorm + ReLU
// backward in one launch, bit for bit maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8 (or the one-gradient kernel) followed
// by bn_nhwc_train_bwd_v8 (relu) on its output: phases 1 and 3 are bnv_bwd_partial's and bnv_bwd_dx's with dy
// gathered per cell by pool_grad8 instead of read, so the full-resolution gradient (ResNet-152 at batch 256:
// 411 MB) is never written nor read back twice.
template <typename T>
__device__ void bnv_train_bwd_pool(const T* __restrict__ x, PoolDy<T> src, const float* __restrict__ stats,
                                   const float* __restrict__ weight, const float* __restrict__ bias,
                                   float* __restrict__ part, float* __restrict__ sums, T* __restrict__ dx,
                                   int64_t rows, int c, int64_t rpc, int chunks, float count, int rev) {
    cg::grid_group grid = cg::this_grid();
    const int G = c >> 3;
    {
        __shared__ float shp[GS_FLOATS];
        const int t = threadIdx.x, ch0 = (t % G) * 8;
        const Consts k = load_consts(stats, weight, bias, c, ch0);
        for (int kk = blockIdx.x; kk < chunks; kk += gridDim.x) {
            const int chunk = rev ? chunks - 1 - kk : kk;
            float ag[8] = {0, 0, 0, 0, 0, 0, 0, 0}, agx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for_chunk_rows<1>(rows, c, chunk, chunks, [&](int64_t r) {
                const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(x + r * c + ch0);
                add_grad_row(xv, src.at((int)r, ch0), k, 1, ag, agx);
            });
            write_grad_partials(ag, agx, shp, G, part, c, chunk, chunks);
        }
    }
    grid.sync();
    __shared__ float sh[FY][2], shb[FY][2];
    const int tx = threadIdx.x & 1, ty = threadIdx.x >> 1;
    for (int p = blockIdx.x; p < (c >> 1); p += gridDim.x) {
        bwd_final_cols<2>(part, sums, chunks, c, 2 * p + tx, tx, ty, sh, shb);
    }
    grid.sync();
    const int64_t groups = rows * (int64_t)G;
    const int64_t g0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int ch0 = (int)(g0 % G) * 8;
    const Consts k = load_consts(stats, weight, bias, c, ch0);
    float a[8], k1[8], k2[8];
    dx_factors(weight, sums, k, c, ch0, count, a, k1, k2);
    const int gshift = __ffs(G) - 1;
    for (int64_t g = g0; g < groups; g += (int64_t)gridDim.x * blockDim.x) {
        const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(x + g * 8);
        *reinterpret_cast<Vec8<T>*>(dx + g * 8) = dx8<T>(xv, src.at((int)(g >> gshift), ch0), k, a, k1, k2, 1);
    }
}

#define BNV_TRAIN_EXPORT(T, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(VB, 4)                                                             \
        bn_nhwc_train_v8_##NAME(const T* x, const T* res, float* part, float* stats, const float* weight,           \
                                const float* bias, T* y, uint8_t* mask, long long rows, int c, long long rpc,       \
                                int chunks, float eps, float* running_mean, float* running_var,                     \
                                long long* num_batches_tracked, float momentum, int relu, int have_moments,        \
                                int rev) {                                                                          \
        bnv_train<T>(x, res, part, stats, weight, bias, y, mask, rows, c, rpc, chunks, eps, running_mean,            \
                     running_var, num_batches_tracked, momentum, relu, have_moments, rev);                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(VB, 3)                                                             \
        bn_nhwc_train_bwd_v8_##NAME(const T* x, const T* dy, const float* stats, const float* weight,               \
                                    const float* bias, float* part, float* sums, T* dx, long long rows, int c,      \
                                    long long rpc, int chunks, float count, int relu, int rev, int have_sums) {     \
        bnv_train_bwd<T>(x, dy, stats, weight, bias, part, sums, dx, rows, c, rpc, chunks, count, relu, rev,        \
                         have_sums);                                                                                \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(VB, 3) bn_nhwc_train2_v8_##NAME(                                   \
        const T* x, const T* r, float* part, float* part_r, float* stats, float* stats_r, const float* weight,      \
        const float* bias, const float* weight_r, const float* bias_r, T* y, uint8_t* mask, long long rows, int c,  \
        long long rpc, int chunks, float eps, float eps_r, float* running_mean, float* running_var,                 \
        long long* num_batches_tracked, float* running_mean_r, float* running_var_r,                                \
        long long* num_batches_tracked_r, float momentum, float momentum_r, int have_moments, int rev) {            \
        bnv_train2<T>(x, r, part, part_r, stats, stats_r, weight, bias, weight_r, bias_r, y, mask, rows, c, rpc,    \
                      chunks, eps, eps_r, running_mean, running_var, num_batches_tracked, running_mean_r,           \
                      running_var_r, num_batches_tracked_r, momentum, momentum_r, have_moments, rev);               \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(VB, 3) bn_nhwc_train_join_bwd_1_v8_##NAME(                         \
        const T* a, const T* b, const T* y, const uint8_t* mask, T* g, const T* x, const float* stats,              \
        const float* weight, const float* bias, float* part, float* sums, T* dx, long long rows, int c,             \
        long long rpc, int chunks, float count, int rev) {                                                          \
        bnv_train_join_bwd<T, false>(a, b, y, mask, g, x, stats, weight, bias, part, sums, dx, rows, c, rpc,        \
                                     chunks, count, rev);                                                           \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(VB, 3) bn_nhwc_train_join_bwd_2_v8_##NAME(                         \
        const T* a, const T* b, const T* y, const uint8_t* mask, T* g, const T* x, const float* stats,              \
        const float* weight, const float* bias, float* part, float* sums, T* dx, long long rows, int c,             \
        long long rpc, int chunks, float count, int rev) {                                                          \
        bnv_train_join_bwd<T, true>(a, b, y, mask, g, x, stats, weight, bias, part, sums, dx, rows, c, rpc,         \
                                    chunks, count, rev);                                                            \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(VB, 3) bn_nhwc_train_join_bwd_2s_v8_##NAME(                        \
        const T* a, const T* b, const T* y, const uint8_t* mask, T* g, const T* x, const float* stats,              \
        const float* weight, const float* bias, float* part, float* sums, T* dx, long long rows, int c,             \
        long long rpc, int chunks, float count, int rev, int bh, int bw) {                                          \
        bnv_train_join_bwd<T, true, true>(a, b, y, mask, g, x, stats, weight, bias, part, sums, dx, rows, c, rpc,   \
                                          chunks, count, rev, bh, bw);                                              \
    }

BNV_TRAIN_EXPORT(float, f32)
BNV_TRAIN_EXPORT(__nv_bfloat16, bf16)
BNV_TRAIN_EXPORT(__half, f16)

#define BNV_POOL_EXPORT(T, NAME)                                                                                    \
    extern "C" __global__ void __launch_bounds__(VB, 3) bn_nhwc_train_pool_v8_##NAME(                               \
        const T* x, float* part, float* stats, const float* weight, const float* bias, T* y, uint8_t* arg,          \
        long long rows, int c, long long rpc, int chunks, float eps, float* running_mean, float* running_var,       \
        long long* num_batches_tracked, float momentum, int have_moments, int rev, int n, int h, int w, int oh,     \
        int ow) {                                                                                                   \
        bnv_train_stats<T>(x, part, stats, rows, c, rpc, chunks, eps, running_mean, running_var,                   \
                           num_batches_tracked, momentum, have_moments, rev);                                      \
        bnv_pool_k3s2p1<T>(x, stats, weight, bias, y, arg, n, h, w, c, oh, ow);                                    \
    }

#define BNV_POOL_BWD_EXPORT(T, NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(VB, 2) bn_nhwc_train_bwd_pool_v8_##NAME(                           \
        const T* x, const uint8_t* arg, const T* g1, const T* g2, const float* stats, const float* weight,          \
        const float* bias, float* part, float* sums, T* dx, long long rows, int c, long long rpc, int chunks,       \
        float count, int rev, int h, int w, int oh, int ow) {                                                       \
        bnv_train_bwd_pool<T>(x, PoolDy<T>{arg, g1, g2, h, w, c, oh, ow}, stats, weight, bias, part, sums, dx,      \
                              rows, c, rpc, chunks, count, rev);                                                    \
    }

BNV_POOL_BWD_EXPORT(float, f32)
BNV_POOL_BWD_EXPORT(__nv_bfloat16, bf16)
BNV_POOL_BWD_EXPORT(__half, f16)

BNV_POOL_EXPORT(float, f32)
BNV_POOL_EXPORT(__nv_bfloat16, bf16)
BNV_POOL_EXPORT(__half, f16)

// PyTorch's running update from finished statistics (3, c), for the 01 path whose finalisers do not take it: one
// thread per channel, grid-stride; num_batches_tracked (non-null) += 1 by thread 0.
extern "C" __global__ void bn_nhwc_running_update(const float* stats, int c, float count, float* running_mean,
                                                  float* running_var, long long* num_batches_tracked, float momentum) {
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c; ch += gridDim.x * blockDim.x) {
        const float unbiased = stats[c + ch] * (count / (count - 1.0f));
        running_mean[ch] = (1.0f - momentum) * running_mean[ch] + momentum * stats[ch];
        running_var[ch] = (1.0f - momentum) * running_var[ch] + momentum * unbiased;
    }
    if (num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) num_batches_tracked[0] += 1;
}
