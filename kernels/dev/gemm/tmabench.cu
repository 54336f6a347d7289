// tmabench: a standalone timing harness for the TMA GEMM kernels of kernels/gemm/05_tma_wgmma.cu with and without
// their BatchNorm epilogues, on ResNet-152's 1x1 convolutions at batch N (default 256), outside the trainer, so that
// an epilogue change is timed and checked in seconds on the GPU machine (nvcc there; no Rust build):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels -o tmabench kernels/dev/gemm/tmabench.cu
// (-I another checkout's kernels/ times that checkout's kernels with this harness.)
//   ./tmabench [batch (256)] [table: main | gsumsw | join | bnin | 3x3 (default: all)]
// For each shape and tile (x256, x128, x64) it times, in bf16:
//   - the forward 1x1 convolution as the NT GEMM, plain (gemm_nt_x*) and with the BatchNorm moments of its output
//     in the epilogue (gemm_nt_stats_x*);
//   - the grad-input 1x1 convolution as the NN GEMM, plain (gemm_nn_x*) and with the BatchNorm backward sums of its
//     output in the epilogue, reading z (gemm_nn_gsums_x*).
// Launches as the trainer's tma_run does (crates/kernels/src/cuda/tma.rs): the same tensor maps (A boxes of
// 64 x 128, B 64 x BN for NT and 64 x 64 for NN, C and z 64 x 64, 128-byte swizzle), a persistent grid of
// min(units, SMs) blocks, no split-K (the epilogue kernels take none; the plain ones are timed the same way, so
// the difference is the epilogue's cost), C stored through its tensor map. Each figure is the mean of a CUDA graph
// of 20 back-to-back launches replayed 10 times. Each output prints an FNV-1a hash (C, and the partials), so that
// two builds of an epilogue can be compared bit for bit (scripts/bn-dev-bench.sh runs two builds and compares
// them). On the l3 and l4 shapes the partials are also checked against FP64 sums on the host (the exit status
// says whether every check passed).
// Then the same for the stride-1 3x3 grad-input convolutions (conv2 of the bottlenecks that do not downsample), plain
// (conv_dgrad_x*_tma) and with the backward sums (conv_dgrad_gsums_x*_tma), through the trainer's im2col map of dy
// (kernels/conv/05_tma_wgmma.cu; crates/kernels/src/cuda/conv.rs's Dgrad pass).
// Then the conv1 grad-inputs joined with a residual gradient b under a ReLU mask (gemm_nn_join_x*, the
// kernels.join_in_conv store: g = mask ? round(round(acc) + b) : 0, b through map Z), against the plain NN GEMM; on
// the l3 and l4 shapes the joined output is checked bit for bit against that formula applied on the host to the
// plain kernel's output.
// With ig::tma_gsums_warps (IG_TMA_KERNEL_GSUMS_W), the 1x1 grad-inputs with the backward sums taken by the
// statistics warps, against the consumers' epilogue sums, x128 and x64, checked against FP64 on l3 / l4.
// With IG_TMA_KERNEL_JOIN_SUMS, the joined conv1 grad-inputs with the backward sums of the block before's last
// BatchNorm (no ReLU: sum g and sum g xhat3 over the joined g) taken by statistics warps (gemm_nn_joinsw_x*), against
// the plain join; the joined output checked bit for bit against the join's, the partials against FP64 on l3 / l4.
// The conv3 forwards over relu(bn(z)) normalised in the kernel (gemm_nt_bnin_x*, gemm_nt_bnin_stats_x*) against
// the plain and stats kernels over the materialised input: bit for bit, and their cost (built with
// -DIG_XF_IN_PRODUCER=0, gemm_nt_bnin_x* normalises in its consumers, as before the producer warps took it).
// The last lines weight each shape by its launches in one ResNet-152 step: milliseconds a step.
#include "conv/05_tma_wgmma.cu"
#include "gemm/05_tma_wgmma.cu"

#define DEV_HARNESS "tmabench"
#include "dev/devbench.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstring>

typedef __nv_bfloat16 T;

static int g_sms = 0;
static PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;
static PFN_cuTensorMapEncodeIm2col_v12000 g_encode_im2col = nullptr;

// A CUtensorMap as the kernels' parameter type.
static ig::TmaDesc as_desc(const CUtensorMap& m) {
    ig::TmaDesc d;
    static_assert(sizeof(d) == sizeof(m), "TmaDesc is a CUtensorMap");
    std::memcpy(&d, &m, sizeof(m));
    return d;
}

// The trainer's tma_map: a row-major outer x inner matrix, boxes of 64 x box_outer, 128-byte swizzle, zero fill.
static ig::TmaDesc tma_map(const void* p, int inner, int outer, int box_outer) {
    CUtensorMap m;
    const cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    const cuuint64_t strides[1] = {(cuuint64_t)inner * sizeof(T)};
    const cuuint32_t boxes[2] = {64, (cuuint32_t)box_outer};
    const cuuint32_t es[2] = {1, 1};
    const CUresult r = g_encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(p), dims, strides, boxes,
                                es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "tmabench: cuTensorMapEncodeTiled failed (%d) for %d x %d\n", (int)r, outer, inner);
        std::exit(1);
    }
    return as_desc(m);
}

// The trainer's tma_im2col_map for a stride-1 pass: the channels-last tensor (n, h, w, c), columns of `pixels`
// pixels x 64 channels, window corners from `lo` to h - 1 + `up` (both dimensions), zero fill outside.
static ig::TmaDesc im2col_map(const void* p, int n, int h, int w, int c, int lo, int up, int pixels) {
    CUtensorMap m;
    const cuuint64_t dims[4] = {(cuuint64_t)c, (cuuint64_t)w, (cuuint64_t)h, (cuuint64_t)n};
    const cuuint64_t strides[3] = {(cuuint64_t)c * sizeof(T), (cuuint64_t)w * c * sizeof(T),
                                   (cuuint64_t)h * w * c * sizeof(T)};
    const int lower[2] = {lo, lo}, upper[2] = {up, up};
    const cuuint32_t es[4] = {1, 1, 1, 1};
    const CUresult r = g_encode_im2col(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(p), dims, strides,
                                       lower, upper, 64, (cuuint32_t)pixels, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "tmabench: cuTensorMapEncodeIm2col failed (%d) for %dx%dx%dx%d\n", (int)r, n, h, w, c);
        std::exit(1);
    }
    return as_desc(m);
}

// Deterministic pseudo-random values in [-2, 2) * scale + offset, a hash of the index and seed.
__global__ void fill_rand(T* p, long long n, unsigned seed, float scale, float offset) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        p[i] = __float2bfloat16_rn(hash_unit(i, seed) * scale + offset);
    }
}

// relu(bn(z)) of an (.., c) tensor as kernels/batchnorm's apply8 and ig::bnin_chunk compute it:
// fmaf(z - mean, invstd * weight, bias), ReLU, rounded once; stats (3, c) = [mean, var, invstd].
__global__ void bn_relu_ref(const T* z, T* x, long long n, int c, const float* stats, const float* w, const float* b) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        const float v = fmaf(__bfloat162float(z[i]) - stats[ch], stats[2 * c + ch] * w[ch], b[ch]);
        x[i] = __float2bfloat16_rn(v > 0.0f ? v : 0.0f);
    }
}

template <typename U>
static std::vector<U> host(const U* d, size_t n) {
    std::vector<U> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(U), cudaMemcpyDeviceToHost));
    return h;
}

static float bf(T v) { return __bfloat162float(v); }

// The harness's own check, against a host computation in FP64 from the kernel's stored output: the moments'
// partials of a STATS launch (each chunk of 128 rows: S = sum y, M2 = sum of squares about the chunk's mean;
// merged here with Chan et al.), as relative errors of the column sums and M2s (worst column).
static void check_stats(const T* y_d, const float* part_d, int m, int n, double& e_s, double& e_m2) {
    const std::vector<T> y = host(y_d, (size_t)m * n);
    const int chunks = (m + ig::TMA_BM - 1) / ig::TMA_BM;
    const std::vector<float> part = host(part_d, (size_t)2 * chunks * n);
    std::vector<double> s(n, 0.0), a(n, 0.0), m2(n, 0.0);
    for (int r = 0; r < m; ++r)
        for (int c = 0; c < n; ++c) {
            const double v = bf(y[(size_t)r * n + c]);
            s[c] += v;
            a[c] += std::fabs(v);
        }
    for (int r = 0; r < m; ++r)
        for (int c = 0; c < n; ++c) {
            const double d = bf(y[(size_t)r * n + c]) - s[c] / m;
            m2[c] += d * d;
        }
    e_s = e_m2 = 0.0;
    for (int c = 0; c < n; ++c) {
        double gs = 0.0;
        for (int t = 0; t < chunks; ++t) gs += part[(size_t)t * n + c];
        const double gmean = gs / m;
        double gm2 = 0.0;
        for (int t = 0; t < chunks; ++t) {
            const double nt = std::min(ig::TMA_BM, m - ig::TMA_BM * t), d = part[(size_t)t * n + c] / nt - gmean;
            gm2 += part[(size_t)(chunks + t) * n + c] + nt * d * d;
        }
        e_s = std::max(e_s, std::fabs(gs - s[c]) / std::max(a[c], 1e-30));
        e_m2 = std::max(e_m2, std::fabs(gm2 - m2[c]) / std::max(m2[c], 1e-30));
    }
}

// The same for a GSUMS launch: per column of dx, sum g and sum g xhat over the rows where the BatchNorm + ReLU
// passes (fmaf(z - mean, invstd weight, bias) >= 0, as the kernel decides it), g the stored dx, xhat = (z - mean)
// invstd; relative to the sums of |g| and |g xhat|.
static void check_sums(const T* dx_d, const T* z_d, const float* part_d, int m, int n, const std::vector<float>& st,
                       int stride, const std::vector<float>& w, const std::vector<float>& b, double& e_g,
                       double& e_gx, bool relu = true) {
    const std::vector<T> dx = host(dx_d, (size_t)m * n), z = host(z_d, (size_t)m * n);
    const int chunks = (m + ig::TMA_BM - 1) / ig::TMA_BM;
    const std::vector<float> part = host(part_d, (size_t)2 * chunks * n);
    std::vector<double> sg(n, 0.0), sgx(n, 0.0), ag(n, 0.0), agx(n, 0.0);
    for (int r = 0; r < m; ++r)
        for (int c = 0; c < n; ++c) {
            const float mean = st[c], invstd = st[2 * stride + c], zv = bf(z[(size_t)r * n + c]);
            if (relu && !(std::fmaf(zv - mean, invstd * w[c], b[c]) >= 0.f)) continue;
            const double g = bf(dx[(size_t)r * n + c]), xh = (double)(zv - mean) * invstd;
            sg[c] += g;
            sgx[c] += g * xh;
            ag[c] += std::fabs(g);
            agx[c] += std::fabs(g * xh);
        }
    e_g = e_gx = 0.0;
    for (int c = 0; c < n; ++c) {
        double gg = 0.0, ggx = 0.0;
        for (int t = 0; t < chunks; ++t) {
            gg += part[(size_t)t * n + c];
            ggx += part[(size_t)(chunks + t) * n + c];
        }
        e_g = std::max(e_g, std::fabs(gg - sg[c]) / std::max(ag[c], 1e-30));
        e_gx = std::max(e_gx, std::fabs(ggx - sgx[c]) / std::max(agx[c], 1e-30));
    }
}

struct Shape1x1 {
    const char* name;
    long long m;  // output pixels n * p * q
    int cin, cout;
    int launches;  // 1x1 convolutions of this shape in one ResNet-152 step (forward; the grad-input alike)
};

// One kernel launch: (map A, map B, map C, [map Z,] C, workspace / partials, bias / z, shape), as tma_run passes
// them; map Z (z's tensor map, for GSUMS kernels that load z through TMA) only where the kernels take it
// (IG_TMA_HAS_MAP_Z), so that the harness builds against trees with and without it.
// A JOIN_SUMS launch (js) also takes map Z3 after map Z and the partials after the mask (IG_TMA_KERNEL_JOIN_SUMS).
struct Launch {
    const void* f;
    ig::TmaDesc ma, mb, mc, mz, mz3;
    T* c;
    float* ws;
    float* part = nullptr;
    bool js = false;
    const T* bias;
    ig::Shape sh;
    int grid, smem;
    void operator()() {
        if (js) {
            void* args[] = {&ma, &mb, &mc, &mz, &mz3, &c, &ws, &part, &bias, &sh};
            CK(cudaLaunchKernel(f, dim3(grid), dim3(ig::TMA_THREADS), args, (size_t)smem, g_stream));
            return;
        }
#ifdef IG_TMA_HAS_MAP_Z
        void* args[] = {&ma, &mb, &mc, &mz, &c, &ws, &bias, &sh};
#else
        void* args[] = {&ma, &mb, &mc, &c, &ws, &bias, &sh};
#endif
        CK(cudaLaunchKernel(f, dim3(grid), dim3(ig::TMA_THREADS), args, (size_t)smem, g_stream));
    }
};

template <int BN>
static Launch make(const void* f, const ig::TmaDesc& ma, const ig::TmaDesc& mb, T* c, float* ws, const T* bias,
                   int m, int n, int k, const float* stats, const float* w, const float* b) {
    Launch l;
    l.f = f;
    l.ma = ma;
    l.mb = mb;
    l.mc = tma_map(c, n, m, 64);
    // z (the bias argument of a GSUMS launch) has C's shape and map (map Z, where the kernels take one).
    if (bias != nullptr) {
        l.mz = tma_map(bias, n, m, 64);
    } else {
        std::memset(&l.mz, 0, sizeof(l.mz));
    }
    l.c = c;
    l.ws = ws;
    l.bias = bias;
    std::memset(&l.sh, 0, sizeof(l.sh));
    l.sh.M = m;
    l.sh.N = n;
    l.sh.K = k;
    l.sh.lda = k;
    l.sh.ldb = k;
    l.sh.ldc = n;
    l.sh.k_split = (k + ig::TMA_KD - 1) / ig::TMA_KD * ig::TMA_KD;
    l.sh.tma_c = 1;
    l.sh.bn_stats = stats;
    l.sh.bn_weight = w;
    l.sh.bn_bias = b;
    const long long units = (long long)((m + ig::TMA_BM - 1) / ig::TMA_BM) * ((n + BN - 1) / BN);
    l.grid = (int)std::min<long long>(units, g_sms);
    // What the trainer passes for every kernel of the tile (crates/kernels/src/variants.rs): the largest need of
    // its kernels, the plain ones' or the z-ring (GSUMS, JOIN) ones'.
    l.smem = ig::TmaLaunch<BN>::SMEM_BYTES;
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem));
    return l;
}

// make<BN> for the tile width bn (256, 128 or 64).
template <typename... A>
static Launch make_bn(int bn, A... a) {
    return bn == 256 ? make<256>(a...) : bn == 128 ? make<128>(a...) : make<64>(a...);
}

int main(int argc, char** argv) {
    const long long batch = argc > 1 ? std::atoll(argv[1]) : 256;
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&g_encode), 12000,
                                        cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || g_encode == nullptr) {
        std::fprintf(stderr, "tmabench: no cuTensorMapEncodeTiled in the driver\n");
        return 1;
    }
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeIm2col", reinterpret_cast<void**>(&g_encode_im2col),
                                        12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || g_encode_im2col == nullptr) {
        std::fprintf(stderr, "tmabench: no cuTensorMapEncodeIm2col in the driver\n");
        return 1;
    }
    std::printf("tmabench: %s, %d SMs, batch %lld, bf16, no split-K\n", prop.name, g_sms, batch);
    // An optional second argument runs one table only: main, gsumsw, join (with the join sums), bnin or 3x3.
    const char* only = argc > 2 ? argv[2] : nullptr;
    if (only != nullptr) {
        const char* tables[] = {"main", "gsumsw", "join", "bnin", "3x3"};
        if (std::none_of(std::begin(tables), std::end(tables), [&](const char* t) { return std::strcmp(t, only) == 0; })) {
            std::fprintf(stderr, "tmabench: unknown table '%s' (main, gsumsw, join, bnin or 3x3)\n", only);
            return 2;
        }
    }
    auto run = [&](const char* table) { return only == nullptr || std::strcmp(only, table) == 0; };

    // ResNet-152's bottleneck 1x1 convolutions (conv1: 4c -> c, conv3: c -> 4c; the first block of each stage
    // has conv1 from the previous stage's width, counted with the rest here, and the downsample convolutions are
    // left out), launches in one step: an approximation, for the epilogues' relative cost.
    const Shape1x1 shapes[] = {
        {"l1 conv1 256->64", batch * 3136, 256, 64, 3},      {"l1 conv3 64->256", batch * 3136, 64, 256, 3},
        {"l2 conv1 512->128", batch * 784, 512, 128, 8},     {"l2 conv3 128->512", batch * 784, 128, 512, 8},
        {"l3 conv1 1024->256", batch * 196, 1024, 256, 36}, {"l3 conv3 256->1024", batch * 196, 256, 1024, 36},
        {"l4 conv1 2048->512", batch * 49, 2048, 512, 3},   {"l4 conv3 512->2048", batch * 49, 512, 2048, 3},
    };
    size_t max_mk = 0, max_mn = 0, max_nk = 0;
    int max_n = 0;
    for (const Shape1x1& s : shapes) {
        max_mk = std::max(max_mk, (size_t)s.m * s.cin);
        max_mn = std::max(max_mn, (size_t)s.m * s.cout);
        max_nk = std::max(max_nk, (size_t)s.cin * s.cout);
        max_n = std::max(max_n, std::max(s.cin, s.cout));
    }
    T *x, *wt, *y, *dy, *dx, *z;
    CK(cudaMalloc(&x, max_mk * sizeof(T)));
    CK(cudaMalloc(&wt, max_nk * sizeof(T)));
    CK(cudaMalloc(&y, max_mn * sizeof(T)));
    CK(cudaMalloc(&dy, max_mn * sizeof(T)));
    CK(cudaMalloc(&dx, max_mk * sizeof(T)));
    CK(cudaMalloc(&z, max_mk * sizeof(T)));
    fill_rand<<<1024, 256, 0, g_stream>>>(x, max_mk, 1u, 1.0f, 0.0f);
    fill_rand<<<1024, 256, 0, g_stream>>>(wt, max_nk, 2u, 0.05f, 0.0f);
    fill_rand<<<1024, 256, 0, g_stream>>>(dy, max_mn, 3u, 1.0f, 0.0f);
    fill_rand<<<1024, 256, 0, g_stream>>>(z, max_mk, 4u, 1.0f, 0.1f);
    // The grad-input's BatchNorm (that of the conv's input, whose gradient dx is): statistics (3, c) = [mean, var,
    // invstd] (rows of c: the kernel reads invstd at 2 N + col, so set_bn lays them out for each launch's N),
    // weight, bias.
    float *stats, *bw, *bb, *part;
    CK(cudaMalloc(&stats, 3 * max_n * sizeof(float)));
    CK(cudaMalloc(&bw, max_n * sizeof(float)));
    CK(cudaMalloc(&bb, max_n * sizeof(float)));
    std::vector<float> hs, hw(max_n), hb(max_n);
    auto set_bn = [&](int n) {
        hs.assign(3 * n, 0.f);
        for (int i = 0; i < n; ++i) {
            hs[i] = 0.1f + 0.01f * (i % 7) - 0.03f;
            const float var = 1.0f + 0.002f * (i % 13);
            hs[n + i] = var;
            hs[2 * n + i] = 1.0f / std::sqrt(var + 1e-5f);
        }
        CK(cudaMemcpy(stats, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    };
    for (int i = 0; i < max_n; ++i) {
        hw[i] = 0.5f + 0.001f * i;
        hb[i] = 0.01f * (i % 17) - 0.05f;
    }
    CK(cudaMemcpy(bw, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(bb, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
    size_t max_part = 0;
    for (const Shape1x1& s : shapes) {
        const size_t rows = (s.m + ig::TMA_BM - 1) / ig::TMA_BM;
        max_part = std::max(max_part, (2 * rows + 1) * (size_t)std::max(s.cin, s.cout));
    }
    CK(cudaMalloc(&part, max_part * sizeof(float)));
    CK(cudaDeviceSynchronize());

    struct Kernels {
        int bn;
        const void *nt, *nt_stats, *nn, *nn_gsums;
    };
    const Kernels tiles[] = {
        {256, (const void*)gemm_nt_x256_vec_bf16, (const void*)gemm_nt_stats_x256_vec_bf16,
         (const void*)gemm_nn_x256_vec_bf16, (const void*)gemm_nn_gsums_x256_vec_bf16},
        {128, (const void*)gemm_nt_x128_vec_bf16, (const void*)gemm_nt_stats_x128_vec_bf16,
         (const void*)gemm_nn_x128_vec_bf16, (const void*)gemm_nn_gsums_x128_vec_bf16},
        {64, (const void*)gemm_nt_x64_vec_bf16, (const void*)gemm_nt_stats_x64_vec_bf16,
         (const void*)gemm_nn_x64_vec_bf16, (const void*)gemm_nn_gsums_x64_vec_bf16},
    };
    constexpr int NT = sizeof(tiles) / sizeof(tiles[0]);
    double step[NT][4] = {{0}};
    int fails = 0;
    std::printf("%-20s %4s | %9s %9s %7s | %9s %9s %7s | hashes: fwd C, stats, bwd C, sums\n", "shape", "tile",
                "fwd", "+stats", "+%", "bgrad", "+sums", "+%");
    for (const Shape1x1& s : shapes) {
        if (!run("main")) break;
        const int m = (int)s.m;
        for (int ti = 0; ti < NT; ++ti) {
            const Kernels& kt = tiles[ti];
            // Forward: y (m x cout) = x (m x cin) . W^T, W (cout x cin), K-major both.
            const ig::TmaDesc fa = tma_map(x, s.cin, m, 128), fb = tma_map(wt, s.cin, s.cout, kt.bn);
            // Grad-input: dx (m x cin) = dy (m x cout) . W, W (cout x cin) read as K x N = cout x cin, N-major.
            const ig::TmaDesc ga = tma_map(dy, s.cout, m, 128), gb = tma_map(wt, s.cin, s.cout, 64);
            Launch fwd = make_bn(kt.bn, kt.nt, fa, fb, y, part, nullptr, m, s.cout, s.cin, nullptr, nullptr,
                                       nullptr);
            Launch fwd_s = make_bn(kt.bn, kt.nt_stats, fa, fb, y, part, nullptr, m, s.cout, s.cin, nullptr,
                                         nullptr, nullptr);
            Launch bwd = make_bn(kt.bn, kt.nn, ga, gb, dx, part, nullptr, m, s.cin, s.cout, nullptr, nullptr,
                                       nullptr);
            Launch bwd_s = make_bn(kt.bn, kt.nn_gsums, ga, gb, dx, part, z, m, s.cin, s.cout, stats, bw, bb);
            // Hashes of one launch each (the partials: the stats kernel's, then the sums kernel's).
            set_bn(s.cin);
            fwd_s();
            CK(cudaStreamSynchronize(g_stream));
            const size_t rows = (s.m + ig::TMA_BM - 1) / ig::TMA_BM;
            const unsigned long long h_y = fnv(y, (size_t)m * s.cout * sizeof(T));
            const unsigned long long h_st = fnv(part, (2 * rows + 1) * s.cout * sizeof(float));
            bwd_s();
            CK(cudaStreamSynchronize(g_stream));
            const unsigned long long h_dx = fnv(dx, (size_t)m * s.cin * sizeof(T));
            const unsigned long long h_su = fnv(part, 2 * rows * s.cin * sizeof(float));
            // The host check on the shapes small enough to copy and sum quickly (l3, l4): the sums' partials are
            // still in part; the statistics' are recomputed by a second launch.
            const bool check = (size_t)m * std::max(s.cin, s.cout) <= ((size_t)64 << 20);
            double e_g = 0, e_gx = 0, e_s = 0, e_m2 = 0;
            if (check) {
                check_sums(dx, z, part, m, s.cin, hs, s.cin, hw, hb, e_g, e_gx);
                fwd_s();
                CK(cudaStreamSynchronize(g_stream));
                check_stats(y, part, m, s.cout, e_s, e_m2);
            }
            const double t[4] = {time_us(fwd), time_us(fwd_s), time_us(bwd), time_us(bwd_s)};
            std::printf("%-20s x%-3d | %9.1f %9.1f %+6.1f%% | %9.1f %9.1f %+6.1f%% | %016llx %016llx %016llx %016llx\n",
                        s.name, kt.bn, t[0], t[1], 100.0 * (t[1] / t[0] - 1.0), t[2], t[3],
                        100.0 * (t[3] / t[2] - 1.0), h_y, h_st, h_dx, h_su);
            if (check) {
                const bool ok = e_s < 1e-5 && e_m2 < 1e-5 && e_g < 1e-5 && e_gx < 1e-5;
                std::printf("  check against FP64 on the host: stats S %.1e M2 %.1e, sums g %.1e g xhat %.1e: %s\n", e_s,
                            e_m2, e_g, e_gx, ok ? "ok" : "FAIL");
                fails += !ok;
            }
            for (int k = 0; k < 4; ++k) step[ti][k] += t[k] * s.launches;
        }
    }
    std::printf("per ResNet-152 step (these 1x1 shapes, launches weighted), ms: fwd / +stats / bgrad / +sums\n");
    for (int ti = 0; ti < NT; ++ti)
        std::printf("  x%-3d %8.3f %8.3f %8.3f %8.3f\n", tiles[ti].bn, step[ti][0] / 1e3, step[ti][1] / 1e3,
                    step[ti][2] / 1e3, step[ti][3] / 1e3);

#ifdef IG_TMA_KERNEL_GSUMS_W
    if (run("gsumsw")) {
        // The 1x1 grad-inputs with the backward sums taken by the statistics warps (gsumsw), against the sums in
        // the consumers' epilogue (gsums) and the plain kernel, x128 and x64; the partials checked against FP64
        // on the l3 / l4 shapes, as above.
        struct WTile {
            int bn;
            const void *nn, *nn_gsums, *nn_gsumsw;
        };
        const WTile wt_tiles[] = {
            {128, (const void*)gemm_nn_x128_vec_bf16, (const void*)gemm_nn_gsums_x128_vec_bf16,
             (const void*)gemm_nn_gsumsw_x128_vec_bf16},
            {64, (const void*)gemm_nn_x64_vec_bf16, (const void*)gemm_nn_gsums_x64_vec_bf16,
             (const void*)gemm_nn_gsumsw_x64_vec_bf16},
        };
        double wstep[2][3] = {{0}};
        std::printf("%-20s %4s | %9s %9s %9s %7s | hash: sums (warps)\n", "grad-input sums", "tile", "bgrad", "+sums",
                    "+warps", "+%");
        for (const Shape1x1& s : shapes) {
            const int m = (int)s.m;
            for (int ti = 0; ti < 2; ++ti) {
                const WTile& kt = wt_tiles[ti];
                const ig::TmaDesc ga = tma_map(dy, s.cout, m, 128), gb = tma_map(wt, s.cin, s.cout, 64);
                Launch bwd = make_bn(kt.bn, kt.nn, ga, gb, dx, part, nullptr, m, s.cin, s.cout, nullptr, nullptr,
                                     nullptr);
                Launch bwd_s = make_bn(kt.bn, kt.nn_gsums, ga, gb, dx, part, z, m, s.cin, s.cout, stats, bw, bb);
                Launch bwd_w = make_bn(kt.bn, kt.nn_gsumsw, ga, gb, dx, part, z, m, s.cin, s.cout, stats, bw, bb);
                set_bn(s.cin);
                bwd_w();
                CK(cudaStreamSynchronize(g_stream));
                const size_t rows = (s.m + ig::TMA_BM - 1) / ig::TMA_BM;
                const unsigned long long h_su = fnv(part, 2 * rows * s.cin * sizeof(float));
                const bool check = (size_t)m * s.cin <= ((size_t)64 << 20);
                double e_g = 0, e_gx = 0;
                if (check) check_sums(dx, z, part, m, s.cin, hs, s.cin, hw, hb, e_g, e_gx);
                const double t[3] = {time_us(bwd), time_us(bwd_s), time_us(bwd_w)};
                std::printf("%-20s x%-3d | %9.1f %9.1f %9.1f %+6.1f%% | %016llx\n", s.name, kt.bn, t[0], t[1], t[2],
                            100.0 * (t[2] / t[0] - 1.0), h_su);
                if (check) {
                    const bool ok = e_g < 1e-5 && e_gx < 1e-5;
                    std::printf("  check against FP64 on the host: sums g %.1e g xhat %.1e: %s\n", e_g, e_gx,
                                ok ? "ok" : "FAIL");
                    fails += !ok;
                }
                for (int k = 0; k < 3; ++k) wstep[ti][k] += t[k] * s.launches;
            }
        }
        std::printf("per ResNet-152 step (these 1x1 grad-inputs, launches weighted), ms: bgrad / +sums / +warps\n");
        for (int ti = 0; ti < 2; ++ti)
            std::printf("  x%-3d %8.3f %8.3f %8.3f\n", wt_tiles[ti].bn, wstep[ti][0] / 1e3, wstep[ti][1] / 1e3,
                        wstep[ti][2] / 1e3);
    }
#endif

#ifdef IG_TMA_KERNEL_JOIN
    if (run("join")) {
        // b (the shortcut gradient, dx-shaped) in z's buffer; the mask (1 bit an element, element i at bit i % 32
        // of word i / 32) in a buffer of its own, filled with the bits of pseudo-random bf16 values (both 0s and 1s
        // in every word, not uniformly: enough for the check and the timing).
        uint32_t* mask;
        CK(cudaMalloc(&mask, max_mk / 8 + 16));
        fill_rand<<<1024, 256, 0, g_stream>>>(reinterpret_cast<T*>(mask), (long long)(max_mk / 16), 6u, 1.0f, 0.0f);
        T* dxj;
        CK(cudaMalloc(&dxj, max_mk * sizeof(T)));
        const void* joins[NT] = {(const void*)gemm_nn_join_x256_vec_bf16, (const void*)gemm_nn_join_x128_vec_bf16,
                                 (const void*)gemm_nn_join_x64_vec_bf16};
        double jstep[NT][2] = {{0}};
        std::printf("%-20s %4s | %9s %9s %7s | hash: joined C\n", "conv1 grad-input", "tile", "bgrad", "+join", "+%");
        for (const Shape1x1& s : shapes) {
            if (s.cin < s.cout) continue;  // conv1 (4c -> c): its grad-input is the joined one
            const int m = (int)s.m, n = s.cin;
            for (int ti = 0; ti < NT; ++ti) {
                const int bn = tiles[ti].bn;
                const ig::TmaDesc ga = tma_map(dy, s.cout, m, 128), gb = tma_map(wt, s.cin, s.cout, 64);
                Launch bwd = make_bn(bn, tiles[ti].nn, ga, gb, dx, part, nullptr, m, n, s.cout, nullptr, nullptr,
                                     nullptr);
                Launch bwd_j = make_bn(bn, joins[ti], ga, gb, dxj, reinterpret_cast<float*>(mask), nullptr, m, n,
                                       s.cout, nullptr, nullptr, nullptr);
                bwd_j.mz = tma_map(z, n, m, 64);  // b through map Z
                bwd();
                bwd_j();
                CK(cudaStreamSynchronize(g_stream));
                const unsigned long long h_j = fnv(dxj, (size_t)m * n * sizeof(T));
                const bool check = (size_t)m * n <= ((size_t)64 << 20);
                size_t bad = 0;
                if (check) {
                    const std::vector<T> a = host(dx, (size_t)m * n), b = host(z, (size_t)m * n),
                                         g = host(dxj, (size_t)m * n);
                    const std::vector<uint32_t> mk = host(mask, (size_t)m * n / 32);
                    for (size_t i = 0; i < (size_t)m * n; ++i) {
                        const bool on = (mk[i / 32] >> (i % 32)) & 1u;
                        const T want = __float2bfloat16_rn(on ? bf(a[i]) + bf(b[i]) : 0.f);
                        bad += std::memcmp(&want, &g[i], sizeof(T)) != 0;
                    }
                }
                const double t[2] = {time_us(bwd), time_us(bwd_j)};
                std::printf("%-20s x%-3d | %9.1f %9.1f %+6.1f%% | %016llx\n", s.name, bn, t[0], t[1],
                            100.0 * (t[1] / t[0] - 1.0), h_j);
                if (check) {
                    std::printf("  check against the join of the plain output on the host: %zu of %zu differ: %s\n",
                                bad, (size_t)m * n, bad ? "FAIL" : "ok");
                    fails += bad != 0;
                }
                jstep[ti][0] += t[0] * s.launches;
                jstep[ti][1] += t[1] * s.launches;
            }
        }
        std::printf("per ResNet-152 step (the conv1 grad-inputs, launches weighted), ms: bgrad / +join\n");
        for (int ti = 0; ti < NT; ++ti)
            std::printf("  x%-3d %8.3f %8.3f\n", tiles[ti].bn, jstep[ti][0] / 1e3, jstep[ti][1] / 1e3);
#ifdef IG_TMA_KERNEL_JOIN_SUMS
        {
            // z3 (the block before's last BatchNorm input, dx-shaped) in its own buffer; its statistics as set_bn
            // lays them out. The joined values must be the join kernel's bit for bit.
            T *z3, *dxs;
            CK(cudaMalloc(&z3, max_mk * sizeof(T)));
            CK(cudaMalloc(&dxs, max_mk * sizeof(T)));
            fill_rand<<<1024, 256, 0, g_stream>>>(z3, (long long)max_mk, 7u, 1.0f, 0.05f);
            const void* jsw[NT] = {(const void*)gemm_nn_joinsw_x256_vec_bf16, (const void*)gemm_nn_joinsw_x128_vec_bf16,
                                   (const void*)gemm_nn_joinsw_x64_vec_bf16};
            double sstep[NT][2] = {{0}};
            std::printf("%-20s %4s | %9s %9s %7s | hash: sums\n", "conv1 join + sums", "tile", "+join", "+sums", "+%");
            for (const Shape1x1& s : shapes) {
                if (s.cin < s.cout) continue;
                const int m = (int)s.m, n = s.cin;
                set_bn(n);
                for (int ti = 0; ti < NT; ++ti) {
                    const int bn = tiles[ti].bn;
                    const ig::TmaDesc ga = tma_map(dy, s.cout, m, 128), gb = tma_map(wt, s.cin, s.cout, 64);
                    Launch bwd_j = make_bn(bn, joins[ti], ga, gb, dxj, reinterpret_cast<float*>(mask), nullptr, m, n,
                                           s.cout, nullptr, nullptr, nullptr);
                    bwd_j.mz = tma_map(z, n, m, 64);
                    Launch bwd_s = make_bn(bn, jsw[ti], ga, gb, dxs, reinterpret_cast<float*>(mask), nullptr, m, n,
                                           s.cout, stats, bw, bb);
                    bwd_s.mz = tma_map(z, n, m, 64);
                    bwd_s.mz3 = tma_map(z3, n, m, 64);
                    bwd_s.part = part;
                    bwd_s.js = true;
                    bwd_j();
                    bwd_s();
                    CK(cudaStreamSynchronize(g_stream));
                    const size_t rows = (m + ig::TMA_BM - 1) / ig::TMA_BM;
                    const unsigned long long h_su = fnv(part, 2 * rows * n * sizeof(float));
                    const bool same = fnv(dxj, (size_t)m * n * sizeof(T)) == fnv(dxs, (size_t)m * n * sizeof(T));
                    const bool check = (size_t)m * n <= ((size_t)64 << 20);
                    double e_g = 0, e_gx = 0;
                    if (check) check_sums(dxs, z3, part, m, n, hs, n, hw, hb, e_g, e_gx, false);
                    const double t[2] = {time_us(bwd_j), time_us(bwd_s)};
                    std::printf("%-20s x%-3d | %9.1f %9.1f %+6.1f%% | %016llx\n", s.name, bn, t[0], t[1],
                                100.0 * (t[1] / t[0] - 1.0), h_su);
                    if (!same) std::printf("  the joined output differs from the join kernel's: FAIL\n");
                    fails += !same;
                    if (check) {
                        const bool ok = e_g < 1e-5 && e_gx < 1e-5;
                        std::printf("  check against FP64 on the host: sums g %.1e g xhat %.1e: %s\n", e_g, e_gx,
                                    ok ? "ok" : "FAIL");
                        fails += !ok;
                    }
                    sstep[ti][0] += t[0] * s.launches;
                    sstep[ti][1] += t[1] * s.launches;
                }
            }
            std::printf("per ResNet-152 step (the joined conv1 grad-inputs, launches weighted), ms: +join / +sums\n");
            for (int ti = 0; ti < NT; ++ti)
                std::printf("  x%-3d %8.3f %8.3f\n", tiles[ti].bn, sstep[ti][0] / 1e3, sstep[ti][1] / 1e3);
            CK(cudaFree(z3));
            CK(cudaFree(dxs));
        }
#endif
        CK(cudaFree(mask));
        CK(cudaFree(dxj));
    }
#endif

#ifdef IG_TMA_KERNEL_SX
    if (run("bnin")) {
        // The conv3 forwards with their input relu(bn2(z)) normalised in the kernel (kernels.bn_apply_in_conv):
        // gemm_nt_bnin_x* (producer warps 1-3 normalise each stage, ig::tma_xf_warps) against gemm_nt_x* over the
        // materialised input, and gemm_nt_bnin_stats_x* (the consumers normalise, the statistics warps take the
        // moments) against gemm_nt_stats_x*; each pair's C (and partials) must hash alike (bit for bit).
        struct BTile {
            int bn;
            const void *nt, *nt_bnin, *nt_stats, *nt_bnin_stats;
        };
        const BTile btiles[] = {
            {256, (const void*)gemm_nt_x256_vec_bf16, (const void*)gemm_nt_bnin_x256_vec_bf16,
             (const void*)gemm_nt_stats_x256_vec_bf16, (const void*)gemm_nt_bnin_stats_x256_vec_bf16},
            {128, (const void*)gemm_nt_x128_vec_bf16, (const void*)gemm_nt_bnin_x128_vec_bf16,
             (const void*)gemm_nt_stats_x128_vec_bf16, (const void*)gemm_nt_bnin_stats_x128_vec_bf16},
            {64, (const void*)gemm_nt_x64_vec_bf16, (const void*)gemm_nt_bnin_x64_vec_bf16,
             (const void*)gemm_nt_stats_x64_vec_bf16, (const void*)gemm_nt_bnin_stats_x64_vec_bf16},
        };
        constexpr int NB = sizeof(btiles) / sizeof(btiles[0]);
        double bstep[NB][4] = {{0}};
        T* xm;
        CK(cudaMalloc(&xm, max_mk * sizeof(T)));
        std::printf("\n%-20s %4s | %9s %9s %7s | %9s %9s %7s | same bits: fwd, +stats (C, partials)\n",
                    "conv3 bnin", "tile", "fwd", "bnin", "+%", "+stats", "bnin+st", "+%");
        for (const Shape1x1& s : shapes) {
            if (s.cout != 4 * s.cin) continue;  // the conv3 shapes
            const int m = (int)s.m;
            set_bn(s.cin);
            bn_relu_ref<<<1024, 256, 0, g_stream>>>(z, xm, (long long)m * s.cin, s.cin, stats, bw, bb);
            for (int ti = 0; ti < NB; ++ti) {
                const BTile& kt = btiles[ti];
                const ig::TmaDesc fx = tma_map(xm, s.cin, m, 128), fz = tma_map(z, s.cin, m, 128);
                const ig::TmaDesc fb = tma_map(wt, s.cin, s.cout, kt.bn);
                Launch l[4] = {
                    make_bn(kt.bn, kt.nt, fx, fb, y, part, nullptr, m, s.cout, s.cin, nullptr, nullptr, nullptr),
                    make_bn(kt.bn, kt.nt_bnin, fz, fb, y, part, nullptr, m, s.cout, s.cin, stats, bw, bb),
                    make_bn(kt.bn, kt.nt_stats, fx, fb, y, part, nullptr, m, s.cout, s.cin, nullptr, nullptr,
                            nullptr),
                    make_bn(kt.bn, kt.nt_bnin_stats, fz, fb, y, part, nullptr, m, s.cout, s.cin, stats, bw, bb),
                };
                const size_t rows = (s.m + ig::TMA_BM - 1) / ig::TMA_BM;
                unsigned long long h[4], hp[4] = {0, 0, 0, 0};
                for (int v = 0; v < 4; ++v) {
                    l[v]();
                    CK(cudaStreamSynchronize(g_stream));
                    h[v] = fnv(y, (size_t)m * s.cout * sizeof(T));
                    if (v >= 2) hp[v] = fnv(part, 2 * rows * s.cout * sizeof(float));
                }
                const bool same_f = h[0] == h[1], same_s = h[2] == h[3] && hp[2] == hp[3];
                fails += !same_f + !same_s;
                double t[4];
                for (int v = 0; v < 4; ++v) t[v] = time_us(l[v]);
                std::printf("%-20s x%-3d | %9.1f %9.1f %+6.1f%% | %9.1f %9.1f %+6.1f%% | %s, %s\n", s.name, kt.bn,
                            t[0], t[1], 100.0 * (t[1] / t[0] - 1.0), t[2], t[3], 100.0 * (t[3] / t[2] - 1.0),
                            same_f ? "yes" : "NO", same_s ? "yes" : "NO");
                for (int v = 0; v < 4; ++v) bstep[ti][v] += t[v] * s.launches;
            }
        }
        std::printf("per ResNet-152 step (the conv3 forwards, launches weighted), ms: fwd / bnin / +stats / bnin+stats\n");
        for (int ti = 0; ti < NB; ++ti)
            std::printf("  x%-3d %8.3f %8.3f %8.3f %8.3f\n", btiles[ti].bn, bstep[ti][0] / 1e3, bstep[ti][1] / 1e3,
                        bstep[ti][2] / 1e3, bstep[ti][3] / 1e3);
        CK(cudaFree(xm));
    }
#endif

    // The stride-1 3x3 grad-input (pad 1, c -> c): dx (n h w x c) = im2col(dy, corners of padding r - 1 - pad = 1)
    // . w read as K x N = (tap, ko) x c; z (the BatchNorm + ReLU's input before this conv) is dx-shaped.
    struct Conv3x3 {
        const char* name;
        int hw, c;
        int launches;  // stride-1 conv2s of this stage in one ResNet-152 step
    };
    const Conv3x3 convs[] = {
        {"l1 conv2 3x3 64", 56, 64, 3},
        {"l2 conv2 3x3 128", 28, 128, 7},
        {"l3 conv2 3x3 256", 14, 256, 35},
        {"l4 conv2 3x3 512", 7, 512, 2},
    };
    T* wc;
    CK(cudaMalloc(&wc, (size_t)9 * 512 * 512 * sizeof(T)));
    fill_rand<<<1024, 256, 0, g_stream>>>(wc, (long long)9 * 512 * 512, 5u, 0.02f, 0.0f);
    struct ConvKernels {
        int bn;
        const void *dgrad, *dgrad_gsums;
    };
    const ConvKernels ctiles[] = {
        {256, (const void*)conv_dgrad_x256_tma_bf16, (const void*)conv_dgrad_gsums_x256_tma_bf16},
        {128, (const void*)conv_dgrad_x128_tma_bf16, (const void*)conv_dgrad_gsums_x128_tma_bf16},
        {64, (const void*)conv_dgrad_x64_tma_bf16, (const void*)conv_dgrad_gsums_x64_tma_bf16},
    };
    constexpr int NC = sizeof(ctiles) / sizeof(ctiles[0]);
    double cstep[NC][2] = {{0}};
    std::printf("%-20s %4s | %9s %9s %7s | hashes: bwd C, sums\n", "shape", "tile", "bgrad", "+sums", "+%");
    for (const Conv3x3& cv : convs) {
        if (!run("3x3")) break;
        const int m = (int)(batch * cv.hw * cv.hw), c = cv.c, k = 9 * c;
        if ((size_t)m * c > max_mk || (size_t)m * c > max_mn) {
            std::fprintf(stderr, "tmabench: %s does not fit the buffers\n", cv.name);
            return 1;
        }
        for (int ti = 0; ti < NC; ++ti) {
            const ConvKernels& kt = ctiles[ti];
            const ig::TmaDesc ga = im2col_map(dy, (int)batch, cv.hw, cv.hw, c, -1, -1, 128);
            const ig::TmaDesc gb = tma_map(wc, k, c, 64);
            Launch bwd = make_bn(kt.bn, kt.dgrad, ga, gb, dx, part, nullptr, m, c, k, nullptr, nullptr, nullptr);
            Launch bwd_s = make_bn(kt.bn, kt.dgrad_gsums, ga, gb, dx, part, z, m, c, k, stats, bw, bb);
            for (Launch* l : {&bwd, &bwd_s}) {
                ig::Shape& sh = l->sh;
                sh.n = (int)batch;
                sh.h = sh.w = sh.p = sh.q = cv.hw;
                sh.c = sh.ko = c;
                sh.r = sh.s = 3;
                sh.stride = sh.pad = 1;
            }
            set_bn(c);
            bwd_s();
            CK(cudaStreamSynchronize(g_stream));
            const size_t rows = (m + ig::TMA_BM - 1) / ig::TMA_BM;
            const unsigned long long h_dx = fnv(dx, (size_t)m * c * sizeof(T));
            const unsigned long long h_su = fnv(part, 2 * rows * c * sizeof(float));
            const bool check = (size_t)m * c <= ((size_t)64 << 20);
            double e_g = 0, e_gx = 0;
            if (check) check_sums(dx, z, part, m, c, hs, c, hw, hb, e_g, e_gx);
            const double t[2] = {time_us(bwd), time_us(bwd_s)};
            std::printf("%-20s x%-3d | %9.1f %9.1f %+6.1f%% | %016llx %016llx\n", cv.name, kt.bn, t[0], t[1],
                        100.0 * (t[1] / t[0] - 1.0), h_dx, h_su);
            if (check) {
                const bool ok = e_g < 1e-5 && e_gx < 1e-5;
                std::printf("  check against FP64 on the host: sums g %.1e g xhat %.1e: %s\n", e_g, e_gx,
                            ok ? "ok" : "FAIL");
                fails += !ok;
            }
            cstep[ti][0] += t[0] * cv.launches;
            cstep[ti][1] += t[1] * cv.launches;
        }
    }
    std::printf("per ResNet-152 step (these 3x3 grad-inputs, launches weighted), ms: bgrad / +sums\n");
    for (int ti = 0; ti < NC; ++ti)
        std::printf("  x%-3d %8.3f %8.3f\n", ctiles[ti].bn, cstep[ti][0] / 1e3, cstep[ti][1] / 1e3);
    if (fails) std::printf("tmabench: %d host check(s) FAILED\n", fails);
    return fails ? 1 : 0;
}
