// Tensor-core GEMM core shared by the matmul (kernels/gemm/) and implicit-GEMM convolution (kernels/conv/)
// kernels: C[M][N] = sum_k A[m][k] * B[k][n] (+ bias[n]), BF16/FP16 operands, FP32 accumulation.
//
// - mma.sync.m16n8k16 (sm_80+; on sm_90 the same instruction runs on Hopper's tensor cores).
// - Block tile BM x BN x 32, warps arranged WM x WN, STAGES-deep shared-memory ring filled by cp.async
//   (16-byte, L2-only .cg copies, zero-filled out of bounds), one __syncthreads per k-tile.
// - Operands are produced by "loaders" that know where element (mn, k) of A or B lives in global memory:
//   plain row/column-major matrices, or the implicit im2col views of a channels-last convolution. A loader
//   stores its tile either K-major ([rows][32], 64-byte rows) or MN-major ([32][rows]); fragments come out
//   of shared memory with ldmatrix (K-major) or ldmatrix.trans (MN-major), so no operand is ever transposed
//   in global memory.
// - Shared layouts are XOR-swizzled on 16-byte chunks: K-major chunk c of row r sits at c ^ ((r >> 1) & 3),
//   MN-major chunk c of k-row r at c ^ (r & 7); both make every ldmatrix phase and every cp.async store
//   bank-conflict free.
// - VEC loaders move 8 contiguous elements per cp.async and need the contiguous extent (channels, K or N) to be
//   a multiple of 8 and 16-byte aligned; the scalar variants load element by element (any shape: the 3-channel
//   stem, odd matrices) and are the slow path.
// - Split-K: blockIdx.z takes K range [z * k_split, (z + 1) * k_split); with split output the block writes FP32
//   partial sums to ws[z][M][N] and splitk_reduce adds them in order (deterministic) into C.
// - Loaders keep per-chunk (r, s, c) / (n, p, q) counters and advance them by 32 each k-tile, so the main loop
//   does no integer division.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace ig {

constexpr int BK = 32;

// Problem description passed by value (mirrors `GemmShape` in crates/kernels/src/cuda_gemm.rs, #[repr(C)]).
struct Shape {
    int M, N, K;        // GEMM extents
    int lda, ldb, ldc;  // leading dimensions of plain operands and of C (elements)
    int n, h, w, c;     // conv input (n, h, w, c)
    int ko, r, s;       // conv output channels and kernel size
    int p, q;           // conv output size
    int stride, pad;
    int k_split;        // K elements per blockIdx.z (multiple of the k-tile depth)
    int has_bias;
    // Grad-input phase class (see DgradA): input pixels h = hh * stride + ph (hh < mh), w = ww * stride + pw
    // (ww < mw); kernel taps r = r0 + stride * i (i < tr), s = s0 + stride * j (j < ts).
    int ph, pw, mh, mw, r0, s0, tr, ts;
    int tma_c;  // TMA kernels: 1 = C (contiguous, ldc = N, N % 8 == 0) is stored through its tensor map
    // The GRAD_SUMS TMA kernels (ig::tma_epilogue_grad_sums): the BatchNorm whose output gradient C is, its
    // statistics (3, N) = [mean, var, invstd], weight and bias (N), FP32. Null elsewhere.
    const float* bn_stats;
    const float* bn_weight;
    const float* bn_bias;
};

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <typename T> __device__ __forceinline__ T zero() { return from_f<T>(0.f); }

__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 a, __nv_bfloat16 b) {
    __nv_bfloat162 v = __halves2bfloat162(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack2(__half a, __half b) {
    __half2 v = __halves2half2(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
}
// pack2's inverse: the two values of T in the 32-bit word w (the lower address first), as floats.
template <typename T>
__device__ __forceinline__ void unpack2(uint32_t w, float& a, float& b) {
    T pair[2];
    memcpy(pair, &w, 4);
    a = to_f(pair[0]);
    b = to_f(pair[1]);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    int bytes = pred ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __nv_bfloat16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offsets of 16-byte chunk `chunk` (8 elements) in a swizzled tile.
// KD = 32: 64-byte rows, chunk c of row r at c ^ ((r >> 1) & 3); KD = 64: 128-byte rows, at c ^ (r & 7).
template <int KD>
__device__ __forceinline__ int off_kmajor(int row, int chunk) {
    static_assert(KD == 32 || KD == 64, "k-tile depth 32 or 64");
    return KD == 32 ? row * KD + ((chunk ^ ((row >> 1) & 3)) << 3) : row * KD + ((chunk ^ (row & 7)) << 3);
}
template <int COLS>
__device__ __forceinline__ int off_mnmajor(int krow, int chunk) {
    static_assert(COLS >= 64, "MN-major swizzle needs at least 8 chunks per row");
    return krow * COLS + ((chunk ^ (krow & 7)) << 3);
}
// MN-major tile in wgmma's 128-byte-swizzle canonical layout (kernels/gemm/wgmma.cuh): the MN extent is cut into
// 64-element panels of KD k-rows each (panel stride KD * 64 elements); inside a panel k-row r is 128 bytes with
// chunk c at c ^ (r & 7).
template <int COLS, int KD>
__device__ __forceinline__ int off_mnpanel(int krow, int chunk) {
    static_assert(COLS % 64 == 0, "panelled MN-major layout needs a multiple of 64 columns");
    return (chunk >> 3) * (KD * 64) + krow * 64 + (((chunk & 7) ^ (krow & 7)) << 3);
}
// The MN-major layout of a loader: PANEL = false for the ldmatrix core (gemm_body), true for wgmma.
template <int COLS, int KD, bool PANEL>
__device__ __forceinline__ int off_mn(int krow, int chunk) {
    if constexpr (PANEL) return off_mnpanel<COLS, KD>(krow, chunk);
    else return off_mnmajor<COLS>(krow, chunk);
}

// ---------------------------------------------------------------------------------------------------------
// Loaders (k-tile depth KD = 32 or 64). K-major: tile [ROWS][KD]; chunk j of a thread covers row idx / (KD / 8),
// k offset (idx % (KD / 8)) * 8. MN-major: tile [KD][ROWS]; chunk j covers k-row idx / (ROWS / 8), column offset (idx % (ROWS / 8)) * 8.
// Each has init(shape, operand pointer, first row/column of the block, first k, tid) and load(stage), which
// issues the copies of the next k-tile and advances by KD.

// X[mn][k] = base[mn * ld + k]: A of a row-major matmul, B given as (N, K) (e.g. Linear's weight).
// PANEL: unused (K-major tiles have one layout); there for a uniform loader signature.
template <typename T, int ROWS, int THREADS, bool VEC, int KD = 32, bool PANEL = false>
struct PlainK {
    static constexpr int CPT = ROWS * (KD / 8) / THREADS;
    const T* base;
    int ld, MN, K, k;
    int row[CPT], kc[CPT];
    __device__ void init(const T* b, int ld_, int MN_, int K_, int mn0, int k0, int tid) {
        base = b; ld = ld_; MN = MN_; K = K_; k = k0;
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            int idx = tid + j * THREADS;
            row[j] = idx / (KD / 8);
            kc[j] = (idx % (KD / 8)) << 3;
            row[j] += 0;
        }
        mnbase = mn0;
    }
    int mnbase;
    __device__ void load(T* s) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            int mn = mnbase + row[j], gk = k + kc[j];
            T* dst = s + off_kmajor<KD>(row[j], kc[j] >> 3);
            if (VEC) {
                bool ok = mn < MN && gk < K;
                cp_async16(dst, ok ? base + (int64_t)mn * ld + gk : base, ok);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    bool ok = mn < MN && gk + e < K;
                    dst[e] = ok ? base[(int64_t)mn * ld + gk + e] : zero<T>();
                }
            }
        }
        k += KD;
    }
};

// X[k][mn] = base[k * ld + mn]: B of a row-major matmul, A given transposed (e.g. dy^T in grad-weight).
template <typename T, int ROWS, int THREADS, bool VEC, int KD = 32, bool PANEL = false>
struct PlainMN {
    static constexpr int CPR = ROWS / 8;  // chunks per k-row
    static constexpr int CPT = KD * CPR / THREADS;
    const T* base;
    int ld, MN, K, k, mn;
    int krow[CPT], mc;
    __device__ void init(const T* b, int ld_, int MN_, int K_, int mn0, int k0, int tid) {
        base = b; ld = ld_; MN = MN_; K = K_; k = k0;
        mc = (tid % CPR) << 3;
        mn = mn0 + mc;
#pragma unroll
        for (int j = 0; j < CPT; ++j) krow[j] = (tid + j * THREADS) / CPR;
    }
    __device__ void load(T* s) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            int gk = k + krow[j];
            T* dst = s + off_mn<ROWS, KD, PANEL>(krow[j], mc >> 3);
            if (VEC) {
                bool ok = gk < K && mn < MN;
                cp_async16(dst, ok ? base + (int64_t)gk * ld + mn : base, ok);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    bool ok = gk < K && mn + e < MN;
                    dst[e] = ok ? base[(int64_t)gk * ld + mn + e] : zero<T>();
                }
            }
        }
        k += KD;
    }
};

// Forward conv, A[m][k]: m = (n, p, q) output pixel, k = (r, s, c) with c fastest; A = x[n][p*st-pad+r][q*st-pad+s][c].
template <typename T, int ROWS, int THREADS, bool VEC, int KD = 32>
struct ConvFwdA {
    static constexpr int CPT = ROWS * (KD / 8) / THREADS;
    const T* x;
    Shape sh;
    int k;
    int row[CPT], kc[CPT];
    int nb[CPT], h0[CPT], w0[CPT];  // nb = -1 when the row is past M
    int r[CPT], s[CPT], c[CPT];     // counters of k + kc (VEC path)
    __device__ void init(const T* x_, const Shape& sh_, int m0, int k0, int tid) {
        x = x_; sh = sh_; k = k0;
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            int idx = tid + j * THREADS;
            row[j] = idx / (KD / 8);
            kc[j] = (idx % (KD / 8)) << 3;
            int m = m0 + row[j];
            int pq = sh.p * sh.q;
            int n = m / pq, rem = m - n * pq;
            int p = rem / sh.q, q = rem - p * sh.q;
            nb[j] = m < sh.M ? n : -1;
            h0[j] = p * sh.stride - sh.pad;
            w0[j] = q * sh.stride - sh.pad;
            int kk = k0 + kc[j];
            int rs = kk / sh.c;
            c[j] = kk - rs * sh.c;
            r[j] = rs / sh.s;
            s[j] = rs - r[j] * sh.s;
        }
    }
    __device__ __forceinline__ bool at(int j, int rr, int ss, int64_t& off) const {
        int hh = h0[j] + rr, ww = w0[j] + ss;
        bool ok = nb[j] >= 0 && rr < sh.r && (unsigned)hh < (unsigned)sh.h && (unsigned)ww < (unsigned)sh.w;
        off = (((int64_t)nb[j] * sh.h + hh) * sh.w + ww) * sh.c;
        return ok;
    }
    __device__ void load(T* sm) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            T* dst = sm + off_kmajor<KD>(row[j], kc[j] >> 3);
            if (VEC) {
                int64_t off;
                bool ok = at(j, r[j], s[j], off);
                cp_async16(dst, ok ? x + off + c[j] : x, ok);
                c[j] += KD;
                while (c[j] >= sh.c) {
                    c[j] -= sh.c;
                    if (++s[j] == sh.s) { s[j] = 0; ++r[j]; }
                }
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    int kk = k + kc[j] + e;
                    int rs = kk / sh.c, cc = kk - rs * sh.c;
                    int rr = rs / sh.s, ss = rs - rr * sh.s;
                    int64_t off;
                    bool ok = kk < sh.K && at(j, rr, ss, off);
                    dst[e] = ok ? x[off + cc] : zero<T>();
                }
            }
        }
        k += KD;
    }
};

// Grad-input of a strided conv, decomposed into stride^2 phase classes so that no tap is wasted: for the input
// pixels of class (ph, pw) (h = hh * stride + ph, w = ww * stride + pw) exactly the taps r = r0 + stride * i,
// s = s0 + stride * j with (ph + pad - r) divisible by the stride reach an output, at p = (h + pad - r) / stride.
// One launch per class; stride 1 is the single class (0, 0) with every tap.
// A[m][k]: m = (n, hh, ww), k = (i, j, ko) with ko fastest; A = dy[n][p][q][ko] (zero where p or q is outside).
template <typename T, int ROWS, int THREADS, bool VEC, int KD = 32>
struct DgradA {
    static constexpr int CPT = ROWS * (KD / 8) / THREADS;
    const T* dy;
    Shape sh;
    int k;
    int row[CPT], kc[CPT];
    int nb[CPT], hp[CPT], wp[CPT];
    int ti[CPT], tj[CPT], o[CPT];
    __device__ void init(const T* dy_, const Shape& sh_, int m0, int k0, int tid) {
        dy = dy_; sh = sh_; k = k0;
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            int idx = tid + j * THREADS;
            row[j] = idx / (KD / 8);
            kc[j] = (idx % (KD / 8)) << 3;
            int m = m0 + row[j];
            int hw = sh.mh * sh.mw;
            int n = m / hw, rem = m - n * hw;
            int hh = rem / sh.mw, ww = rem - hh * sh.mw;
            nb[j] = m < sh.M ? n : -1;
            hp[j] = hh * sh.stride + sh.ph + sh.pad;
            wp[j] = ww * sh.stride + sh.pw + sh.pad;
            int kk = k0 + kc[j];
            int ij = kk / sh.ko;
            o[j] = kk - ij * sh.ko;
            ti[j] = ij / sh.ts;
            tj[j] = ij - ti[j] * sh.ts;
        }
    }
    __device__ __forceinline__ bool at(int j, int i_, int j_, int64_t& off) const {
        int pn = hp[j] - (sh.r0 + sh.stride * i_), qn = wp[j] - (sh.s0 + sh.stride * j_);
        bool ok = nb[j] >= 0 && i_ < sh.tr && pn >= 0 && qn >= 0;
        int p = pn, q = qn;
        if (sh.stride != 1) {
            p = pn / sh.stride;  // exact: the class guarantees divisibility
            q = qn / sh.stride;
        }
        ok = ok && p < sh.p && q < sh.q;
        off = (((int64_t)nb[j] * sh.p + p) * sh.q + q) * sh.ko;
        return ok;
    }
    __device__ void load(T* sm) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            T* dst = sm + off_kmajor<KD>(row[j], kc[j] >> 3);
            if (VEC) {
                int64_t off;
                bool ok = at(j, ti[j], tj[j], off);
                cp_async16(dst, ok ? dy + off + o[j] : dy, ok);
                o[j] += KD;
                while (o[j] >= sh.ko) {
                    o[j] -= sh.ko;
                    if (++tj[j] == sh.ts) { tj[j] = 0; ++ti[j]; }
                }
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    int kk = k + kc[j] + e;
                    int ij = kk / sh.ko, oo = kk - ij * sh.ko;
                    int ii = ij / sh.ts, jj = ij - ii * sh.ts;
                    int64_t off;
                    bool ok = kk < sh.K && at(j, ii, jj, off);
                    dst[e] = ok ? dy[off + oo] : zero<T>();
                }
            }
        }
        k += KD;
    }
};

// Grad-input, B[k][n]: k = (i, j, ko) of the phase class, n = c; B = w[ko][r0 + st*i][s0 + st*j][c]. MN-major.
template <typename T, int ROWS, int THREADS, bool VEC, int KD = 32, bool PANEL = false>
struct DgradB {
    static constexpr int CPR = ROWS / 8;
    static constexpr int CPT = KD * CPR / THREADS;
    const T* wt;
    Shape sh;
    int k, col;
    int krow[CPT], mc;
    int ti[CPT], tj[CPT], o[CPT];
    __device__ void init(const T* w_, const Shape& sh_, int n0, int k0, int tid) {
        wt = w_; sh = sh_; k = k0;
        mc = (tid % CPR) << 3;
        col = n0 + mc;
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            krow[j] = (tid + j * THREADS) / CPR;
            int kk = k0 + krow[j];
            int ij = kk / sh.ko;
            o[j] = kk - ij * sh.ko;
            ti[j] = ij / sh.ts;
            tj[j] = ij - ti[j] * sh.ts;
        }
    }
    __device__ __forceinline__ int64_t off(int oo, int i_, int j_, int c) const {
        int r = sh.r0 + sh.stride * i_, s = sh.s0 + sh.stride * j_;
        return (((int64_t)oo * sh.r + r) * sh.s + s) * sh.c + c;
    }
    __device__ void load(T* sm) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            T* dst = sm + off_mn<ROWS, KD, PANEL>(krow[j], mc >> 3);
            if (VEC) {
                bool ok = ti[j] < sh.tr && col < sh.c;
                cp_async16(dst, ok ? wt + off(o[j], ti[j], tj[j], col) : wt, ok);
                o[j] += KD;
                while (o[j] >= sh.ko) {
                    o[j] -= sh.ko;
                    if (++tj[j] == sh.ts) { tj[j] = 0; ++ti[j]; }
                }
            } else {
                int kk = k + krow[j];
                int ij = kk / sh.ko, oo = kk - ij * sh.ko;
                int ii = ij / sh.ts, jj = ij - ii * sh.ts;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    bool ok = kk < sh.K && col + e < sh.c;
                    dst[e] = ok ? wt[off(oo, ii, jj, col + e)] : zero<T>();
                }
            }
        }
        k += KD;
    }
};

// Grad-weight, B[k][n]: k = (n, p, q) output pixel, n = (r, s, c) with c fastest;
// B = x[n][p*st-pad+r][q*st-pad+s][c]. MN-major.
template <typename T, int ROWS, int THREADS, bool VEC, int KD = 32, bool PANEL = false>
struct WgradB {
    static constexpr int CPR = ROWS / 8;
    static constexpr int CPT = KD * CPR / THREADS;
    const T* x;
    Shape sh;
    int k, col, mc;
    int cr, cs, cc;  // (r, s, c) of col (VEC path)
    int krow[CPT];
    int nb[CPT], p[CPT], q[CPT];
    __device__ void init(const T* x_, const Shape& sh_, int n0, int k0, int tid) {
        x = x_; sh = sh_; k = k0;
        mc = (tid % CPR) << 3;
        col = n0 + mc;
        int rs = col / sh.c;
        cc = col - rs * sh.c;
        cr = rs / sh.s;
        cs = rs - cr * sh.s;
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            krow[j] = (tid + j * THREADS) / CPR;
            int kk = k0 + krow[j];
            int pq = sh.p * sh.q;
            nb[j] = kk / pq;
            int rem = kk - nb[j] * pq;
            p[j] = rem / sh.q;
            q[j] = rem - p[j] * sh.q;
        }
    }
    __device__ __forceinline__ bool at(int n, int pp, int qq, int rr, int ss, int64_t& off) const {
        int hh = pp * sh.stride - sh.pad + rr, ww = qq * sh.stride - sh.pad + ss;
        bool ok = n < sh.n && (unsigned)hh < (unsigned)sh.h && (unsigned)ww < (unsigned)sh.w;
        off = (((int64_t)n * sh.h + hh) * sh.w + ww) * sh.c;
        return ok;
    }
    __device__ void load(T* sm) {
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            T* dst = sm + off_mn<ROWS, KD, PANEL>(krow[j], mc >> 3);
            if (VEC) {
                int64_t off;
                bool ok = col < sh.N && at(nb[j], p[j], q[j], cr, cs, off);
                cp_async16(dst, ok ? x + off + cc : x, ok);
                q[j] += KD;
                while (q[j] >= sh.q) {
                    q[j] -= sh.q;
                    if (++p[j] == sh.p) { p[j] = 0; ++nb[j]; }
                }
            } else {
                int kk = k + krow[j];
                int pq = sh.p * sh.q;
                int n = kk / pq, rem = kk - n * pq;
                int pp = rem / sh.q, qq = rem - pp * sh.q;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    int cl = col + e;
                    int rs = cl / sh.c, c = cl - rs * sh.c;
                    int rr = rs / sh.s, ss = rs - rr * sh.s;
                    int64_t off;
                    bool ok = kk < sh.K && cl < sh.N && at(n, pp, qq, rr, ss, off);
                    dst[e] = ok ? x[off + c] : zero<T>();
                }
            }
        }
        k += KD;
    }
};

template <typename T, int BM, int BN, int MI, int NI, int THREADS, bool OUT_SPLIT, bool ROWMAP>
__device__ __forceinline__ void epilogue(const float (&acc)[MI][NI][4], int wm0, int wn0, const Shape& sh, T* C,
                                         float* ws, const T* bias, T* smem);

// ---------------------------------------------------------------------------------------------------------
// The kernel body. LA / LB are loader types; A_KMAJOR / B_KMAJOR say how their tiles sit in shared memory.
// OUT_SPLIT: write FP32 partial sums to ws + blockIdx.z * M * N (row-major, ld N) instead of T to C.
// ROWMAP: GEMM row m is input pixel (n, hh, ww) of a grad-input phase class; it is stored at row
// (n * h + hh * stride + ph) * w + ww * stride + pw of C.
template <typename T, int BM, int BN, int WM, int WN, int STAGES, bool A_KMAJOR, bool B_KMAJOR, bool OUT_SPLIT,
          typename LA, typename LB, bool ROWMAP = false, int KD = 32>
__device__ __forceinline__ void gemm_body(LA& la, LB& lb, const Shape& sh, int k_begin, int k_end, T* C, float* ws,
                                          const T* bias, T* smem) {
    constexpr int THREADS = WM * WN * 32;
    constexpr int TM = BM / WM, TN = BN / WN;  // warp tile
    constexpr int MI = TM / 16, NI = TN / 8;
    static_assert(NI % 2 == 0, "warp tile N must be a multiple of 16");
    constexpr int A_ELEMS = BM * KD, B_ELEMS = BN * KD, STAGE = A_ELEMS + B_ELEMS;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp / WN) * TM, wn0 = (warp % WN) * TN;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    const int ktiles = k_end > k_begin ? (k_end - k_begin + KD - 1) / KD : 0;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ktiles) {
            la.load(smem + st * STAGE);
            lb.load(smem + st * STAGE + A_ELEMS);
        }
        cp_async_commit();
    }

    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            int nt = kt + STAGES - 1;
            if (nt < ktiles) {
                T* st = smem + (nt % STAGES) * STAGE;
                la.load(st);
                lb.load(st + A_ELEMS);
            }
            cp_async_commit();
        }
        const T* sa = smem + (kt % STAGES) * STAGE;
        const T* sb = sa + A_ELEMS;
#pragma unroll
        for (int kk = 0; kk < KD; kk += 16) {
            uint32_t af[MI][4];
            uint32_t bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                int base = wm0 + mi * 16;
                if (A_KMAJOR) {
                    int row = base + (lane & 7) + ((lane >> 3) & 1) * 8;
                    int chunk = (kk >> 3) + (lane >> 4);
                    ldsm_x4(af[mi], smem_u32(sa + off_kmajor<KD>(row, chunk)));
                } else {
                    int krow = kk + (lane & 7) + (lane >> 4) * 8;
                    int chunk = (base >> 3) + ((lane >> 3) & 1);
                    ldsm_x4_t(af[mi], smem_u32(sa + off_mnmajor<BM>(krow, chunk)));
                }
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                int base = wn0 + nj * 16;
                uint32_t t4[4];
                if (B_KMAJOR) {
                    int row = base + (lane & 7) + (lane >> 4) * 8;
                    int chunk = (kk >> 3) + ((lane >> 3) & 1);
                    ldsm_x4(t4, smem_u32(sb + off_kmajor<KD>(row, chunk)));
                } else {
                    int krow = kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                    int chunk = (base >> 3) + (lane >> 4);
                    ldsm_x4_t(t4, smem_u32(sb + off_mnmajor<BN>(krow, chunk)));
                }
                bf[2 * nj][0] = t4[0];
                bf[2 * nj][1] = t4[1];
                bf[2 * nj + 1][0] = t4[2];
                bf[2 * nj + 1][1] = t4[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma16816(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1], T());
        }
    }
    cp_async_wait<0>();
    constexpr int CS_LD = BN + 8;
    static_assert(BM * CS_LD <= STAGES * STAGE, "epilogue tile must fit in the pipeline's shared memory");
    epilogue<T, BM, BN, MI, NI, THREADS, OUT_SPLIT, ROWMAP>(acc, wm0, wn0, sh, C, ws, bias, smem);
}

// Writes a block's accumulators: fragment (mi, ni) of the warp at (wm0, wn0) holds rows g, g + 8 and columns
// 2t, 2t + 1 of a 16x8 tile (the mma.sync and the wgmma accumulator layouts agree on this). `smem` must hold
// BM x (BN + 8) elements and every cp.async / wgmma reading it must have completed.
template <typename T, int BM, int BN, int MI, int NI, int THREADS, bool OUT_SPLIT, bool ROWMAP>
__device__ __forceinline__ void epilogue(const float (&acc)[MI][NI][4], int wm0, int wn0, const Shape& sh, T* C,
                                         float* ws, const T* bias, T* smem) {
    const int lane = threadIdx.x & 31;
    const int m_blk = blockIdx.x * BM, n_blk = blockIdx.y * BN;
    const int g = lane >> 2, t = lane & 3;
    if (OUT_SPLIT) {
        // FP32 partial sums straight from the fragments (the split-K workspace is re-read once by the reduce).
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                int col = n_blk + wn0 + ni * 8 + 2 * t;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    int row = m_blk + wm0 + mi * 16 + g + hf * 8;
                    if (row >= sh.M) continue;
                    float* o = ws + (int64_t)blockIdx.z * sh.M * sh.N + (int64_t)row * sh.N + col;
                    if (col < sh.N) o[0] = acc[mi][ni][2 * hf];
                    if (col + 1 < sh.N) o[1] = acc[mi][ni][2 * hf + 1];
                }
            }
        return;
    }
    // T output: the block's tile goes through shared memory (rows padded by 8 elements: the fragment stores of
    // a warp hit 32 distinct banks), then leaves as 16-byte row chunks, so every warp store covers whole 32-byte
    // sectors of consecutive columns. The pipeline buffers are free: all cp.async groups are drained.
    constexpr int CS_LD = BN + 8;
    __syncthreads();
    T* cs = smem;
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
        int cl = wn0 + ni * 8 + 2 * t;
        int col = n_blk + cl;
        float b0 = 0.f, b1 = 0.f;
        if (sh.has_bias) {
            if (col < sh.N) b0 = to_f(bias[col]);
            if (col + 1 < sh.N) b1 = to_f(bias[col + 1]);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                int rl = wm0 + mi * 16 + g + hf * 8;
                *reinterpret_cast<uint32_t*>(cs + rl * CS_LD + cl) =
                    pack2(from_f<T>(acc[mi][ni][2 * hf] + b0), from_f<T>(acc[mi][ni][2 * hf + 1] + b1));
            }
    }
    __syncthreads();
    const bool vec_out = (sh.ldc % 8) == 0;
    constexpr int CPR = BN / 8;
    for (int idx = threadIdx.x; idx < BM * CPR; idx += THREADS) {
        int rl = idx / CPR, cl = (idx % CPR) * 8;
        int row = m_blk + rl, col = n_blk + cl;
        if (row >= sh.M || col >= sh.N) continue;
        if (ROWMAP && sh.stride != 1) {
            int hw = sh.mh * sh.mw;
            int n = row / hw, rem = row - n * hw;
            int hh = rem / sh.mw, ww = rem - hh * sh.mw;
            row = (n * sh.h + hh * sh.stride + sh.ph) * sh.w + ww * sh.stride + sh.pw;
        }
        T* o = C + (int64_t)row * sh.ldc + col;
        const T* src = cs + rl * CS_LD + cl;
        if (vec_out && col + 8 <= sh.N) {
            *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (col + e < sh.N) o[e] = src[e];
        }
    }
}

template <int BM, int BN, int STAGES, int KD = 32>
constexpr int smem_bytes() { return STAGES * (BM + BN) * KD * 2; }

}  // namespace ig

// Deterministic split-K reduction: C[i] = sum over z of ws[z][i] (+ bias[i % N]), converted to T.
#define IG_SPLITK_REDUCE(NAME, T)                                                                               \
    extern "C" __global__ void NAME(const float* __restrict__ ws, T* __restrict__ C, int mn, int splits) {      \
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < mn; i += gridDim.x * blockDim.x) {                \
            float v = 0.f;                                                                                      \
            for (int z = 0; z < splits; ++z) v += ws[(int64_t)z * mn + i];                                      \
            C[i] = ig::from_f<T>(v);                                                                            \
        }                                                                                                       \
    }
