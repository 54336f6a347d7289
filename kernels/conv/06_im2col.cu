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
    extern "C" __global__ void pad_rows_##SUF(const T* src, T* dst, int rows, int cols, int ld_src, int ld_dst) {  \
        pad_rows_body<T>(src, dst, rows, cols, ld_src, ld_dst);                                                \
    }                                                                                                          \
    extern "C" __global__ void sum_rows_##SUF(const T* src, T* dst, int parts, int rows, int cols, int ld_src) {   \
        sum_rows_body<T>(src, dst, parts, rows, cols, ld_src);                                                 \
    }

IM2COL_ALL(__nv_bfloat16, bf16)
IM2COL_ALL(__half, f16)
