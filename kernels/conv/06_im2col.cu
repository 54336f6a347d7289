// 06_im2col: explicit im2col for convolutions with very few input channels (the 3-channel RGB stem), whose
// product then runs on the TMA GEMM (kernels/gemm/05_tma_wgmma.cu) as a plain matrix product.
//
// What changed vs the implicit GEMMs: the implicit-GEMM kernels need C to be a multiple of 8 (16-byte loads; the
// TMA im2col path a multiple of 64), so the stem's input was zero-padded from 3 to 8 channels and ran 8/3 of the
// useful MACs at ~26 TFLOP/s forward (1.2 ms per step at batch 128, the largest single item of the ResNet-152
// convolution set). Here the R*S*C = 147 products of a pixel become one row of K' = 152 elements (K rounded up to
// 8, zero-filled), written once to a [pixels][K'] buffer:
//   forward:      y[npq][ko]  = cols[npq][k'] . w'[ko][k']^T     (w' = w as [Ko][R*S*C], zero-padded to K')
//   grad-weight:  dw'[ko][k'] = dy[npq][ko]^T . cols[npq][k']
// The launcher (crates/kernels/src/cuda_gemm.rs, `im2col_conv`) runs the rows in chunks of whole images that
// bound the buffer, and pads / gathers the weights with pad_rows / sum_rows below.
#include "gemm/igemm.cuh"

// cols[row][k'] for the rows [m0, m0 + rows) of the pixel walk (n, p, q): k' = (r * S + s) * C + c < K, zero for
// k' in [K, K') and for taps outside the image (the padding). One thread writes one 16-byte chunk (8 columns); the
// (r, s, c) of the K' columns comes from a table in shared memory built per block.
struct Im2colArgs {
    long long m0;
    int rows, h, w, c, p, q, r, stride, pad, kp;
};

template <typename T>
__device__ __forceinline__ void im2col_body(const T* __restrict__ x, T* __restrict__ cols, const Im2colArgs& a) {
    extern __shared__ int im2col_tab[];  // per column k': r << 20 | s << 10 | c, or -1 past K
    const int taps_k = a.r * a.r * a.c;
    for (int k = threadIdx.x; k < a.kp; k += blockDim.x) {
        if (k < taps_k) {
            const int tap = k / a.c, ch = k - tap * a.c, rr = tap / a.r, ss = tap - rr * a.r;
            im2col_tab[k] = rr << 20 | ss << 10 | ch;
        } else {
            im2col_tab[k] = -1;
        }
    }
    __syncthreads();
    const int chunks = a.kp / 8;
    const long long total = (long long)a.rows * chunks;
    const int pq = a.p * a.q;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / chunks;
        const int j = (int)(i - row * chunks);
        const long long m = a.m0 + row;
        const int n = (int)(m / pq), rem = (int)(m - (long long)n * pq), oh = rem / a.q, ow = rem - oh * a.q;
        const int h0 = oh * a.stride - a.pad, w0 = ow * a.stride - a.pad;
        const T* xn = x + (size_t)n * a.h * a.w * a.c;
        uint32_t v[4];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            T pair[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int t = im2col_tab[8 * j + e + u];
                const int ih = h0 + (t >> 20), iw = w0 + ((t >> 10) & 1023);
                pair[u] = (t >= 0 && ih >= 0 && ih < a.h && iw >= 0 && iw < a.w)
                              ? xn[((size_t)ih * a.w + iw) * a.c + (t & 1023)]
                              : ig::zero<T>();
            }
            v[e / 2] = ig::pack2(pair[0], pair[1]);
        }
        *reinterpret_cast<uint4*>(cols + (size_t)row * a.kp + 8 * j) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

// im2col_rows: the same cols as im2col_nhwc, one block per output row (n, oh) of the chunk: the R input rows that
// row's windows read, ih = oh * stride - pad + r, over the columns iw in [-pad, (Q - 1) * stride - pad + R) are
// staged once in shared memory (zeros outside the image), then the row's Q x K' outputs are written from there as
// coalesced 16-byte chunks. im2col_nhwc gathers each element from global memory with two 64-bit divisions per chunk:
// the ResNet-152 stem (batch 256, K' = 152, ~1 GB of cols) ran at about a third of the H200's write bandwidth
// (0.83 ms a launch, ktrace 2026-12-05). Shared memory: 4 K' bytes of table + R * Wp * C elements (Wp = (Q - 1) *
// stride + R), so the launcher (cuda/im2col.rs) takes this kernel only where that fits in 48 KB.
#define IM2COL_STAGE 8
template <typename T>
__device__ __forceinline__ void im2col_rows_body(const T* __restrict__ x, T* __restrict__ cols,
                                                 const Im2colArgs& a) {
    extern __shared__ int im2col_rows_sm[];
    int* tab = im2col_rows_sm;  // per column k': r * Wp * C + s * C + c (the tile's offset at ow = 0), or -1 past K
    T* tile = reinterpret_cast<T*>(im2col_rows_sm + ((a.kp + 3) & ~3));  // [R][Wp * C]
    const int wpc = ((a.q - 1) * a.stride + a.r) * a.c;                     // one staged row: Wp * C elements
    const int taps_k = a.r * a.r * a.c;
    for (int k = threadIdx.x; k < a.kp; k += blockDim.x) {
        if (k < taps_k) {
            const int tap = k / a.c, ch = k - tap * a.c, rr = tap / a.r, ss = tap - rr * a.r;
            tab[k] = rr * wpc + ss * a.c + ch;
        } else {
            tab[k] = -1;
        }
    }
    const int chunks = a.kp / 8;
    const int n0 = (int)(a.m0 / ((long long)a.p * a.q));
    const int out_rows = a.rows / a.q;  // (n, oh) rows of this chunk of images
    for (int br = blockIdx.x; br < out_rows; br += gridDim.x) {
        const int nl = br / a.p, oh = br - nl * a.p;
        const T* xn = x + (size_t)(n0 + nl) * a.h * a.w * a.c;
        // Staged element e of row rr: input row ih = oh * stride - pad + rr, flat column e = (iw + pad) * C + ch,
        // contiguous in x where 0 <= iw < W.
        const int lo = a.pad * a.c, hi = (a.pad + a.w) * a.c;
        __syncthreads();  // the previous row's reads of the tile (and, the first time, the table's writes)
        // IM2COL_STAGE loads a thread in flight before their shared-memory stores: one load at a time, each
        // store waiting on its load, left the staging latency-bound (about 19 loads a thread for the RGB stem).
        const int staged = a.r * wpc;
        for (int i0 = threadIdx.x; i0 < staged; i0 += IM2COL_STAGE * blockDim.x) {
            T v[IM2COL_STAGE];
#pragma unroll
            for (int u = 0; u < IM2COL_STAGE; ++u) {
                const int i = i0 + u * blockDim.x;
                const int rr = i / wpc, e = i - rr * wpc;
                const int ih = oh * a.stride - a.pad + rr;
                v[u] = (i < staged && ih >= 0 && ih < a.h && e >= lo && e < hi)
                           ? xn[(size_t)ih * a.w * a.c + (e - lo)]
                           : ig::zero<T>();
            }
#pragma unroll
            for (int u = 0; u < IM2COL_STAGE; ++u) {
                const int i = i0 + u * blockDim.x;
                if (i < staged) tile[i] = v[u];
            }
        }
        __syncthreads();
        T* out = cols + (size_t)br * a.q * a.kp;
        for (int i = threadIdx.x; i < a.q * chunks; i += blockDim.x) {
            const int ow = i / chunks, j = i - ow * chunks;
            const int base = ow * a.stride * a.c;
            uint32_t v[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const int t0 = tab[8 * j + e], t1 = tab[8 * j + e + 1];
                v[e / 2] = ig::pack2(t0 >= 0 ? tile[t0 + base] : ig::zero<T>(),
                                     t1 >= 0 ? tile[t1 + base] : ig::zero<T>());
            }
            *reinterpret_cast<uint4*>(out + (size_t)i * 8) = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

// dst[i][k] = src[i][k] for k < cols, 0 for cols <= k < ld_dst (rows x ld_dst outputs; src rows ld_src apart).
template <typename T>
__device__ __forceinline__ void pad_rows_body(const T* __restrict__ src, T* __restrict__ dst, int rows, int cols,
                                              int ld_src, int ld_dst) {
    const long long total = (long long)rows * ld_dst;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / ld_dst), k = (int)(i - (long long)r * ld_dst);
        dst[i] = k < cols ? src[(size_t)r * ld_src + k] : ig::zero<T>();
    }
}

// dst[i][k] = sum over the `parts` partial results src[z][i][k] (z in order, FP32 sum), for k < cols; src rows
// are ld_src apart, dst rows cols apart (drops the zero-padded columns of the grad-weight GEMM).
template <typename T>
__device__ __forceinline__ void sum_rows_body(const T* __restrict__ src, T* __restrict__ dst, int parts, int rows,
                                              int cols, int ld_src) {
    const long long total = (long long)rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / cols), k = (int)(i - (long long)r * cols);
        float s = 0.f;
        for (int z = 0; z < parts; ++z) s += ig::to_f(src[((size_t)z * rows + r) * ld_src + k]);
        dst[i] = ig::from_f<T>(s);
    }
}

#define IM2COL_ALL(T, SUF)                                                                                      \
    extern "C" __global__ void im2col_nhwc_##SUF(const T* x, T* cols, Im2colArgs a) { im2col_body<T>(x, cols, a); } \
    extern "C" __global__ void im2col_rows_##SUF(const T* x, T* cols, Im2colArgs a) {                              \
        im2col_rows_body<T>(x, cols, a);                                                                       \
    }                                                                                                          \
    extern "C" __global__ void pad_rows_##SUF(const T* src, T* dst, int rows, int cols, int ld_src, int ld_dst) {  \
        pad_rows_body<T>(src, dst, rows, cols, ld_src, ld_dst);                                                \
    }                                                                                                          \
    extern "C" __global__ void sum_rows_##SUF(const T* src, T* dst, int parts, int rows, int cols, int ld_src) {   \
        sum_rows_body<T>(src, dst, parts, rows, cols, ld_src);                                                 \
    }

IM2COL_ALL(__nv_bfloat16, bf16)
IM2COL_ALL(__half, f16)
