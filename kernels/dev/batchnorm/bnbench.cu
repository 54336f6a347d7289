// bnbench: a standalone timing harness for the cooperative channels-last BatchNorm kernels of
// kernels/batchnorm/02_nhwc_vec.cu, on ResNet-152's BatchNorm shapes (bf16; fp16 built with -DBNBENCH_F16),
// outside the trainer, so that a kernel change is timed and checked in seconds on the GPU machine (nvcc there; no
// Rust build):
//   nvcc -O3 -std=c++17 -arch=sm_90 -I kernels -o bnbench kernels/dev/batchnorm/bnbench.cu
//   ./bnbench [batch (256)] [chunks a SM (3)]
// (scripts/bn-dev-bench.sh runs two such builds, one from another revision of 02_nhwc_vec.cu, alternating, and
// compares their hashes). Each figure is the mean of a CUDA graph of 20 back-to-back launches replayed 10 times (no host gaps).
// The phases are separated by running the same kernel with parts switched off: y null (phases 1-2: moments,
// grid barrier, finaliser, barrier), have_moments (the finaliser and its barrier alone, or with the element-wise
// pass; over the partials the full launch left: the time is the point there, not the statistics), and an empty
// cooperative kernel of the same grid with 0 / 1 / 2 grid barriers. Every variant prints an FNV-1a hash of its
// outputs, so two builds of the kernels can be compared bit for bit. The last lines weight each shape by its
// launches in one ResNet-152 step: milliseconds a step.
#include "batchnorm/02_nhwc_vec.cu"

#define DEV_HARNESS "bnbench"
#include "dev/devbench.cuh"

#include <string>

#ifdef BNBENCH_F16
typedef __half T;
#define BNB_K(name) name##_f16
static const char* const kDtype = "fp16";
#else
typedef __nv_bfloat16 T;
#define BNB_K(name) name##_bf16
static const char* const kDtype = "bf16";
#endif

extern "C" __global__ void __launch_bounds__(VB, 4) bnbench_empty_coop(int syncs) {
    cg::grid_group grid = cg::this_grid();
    for (int i = 0; i < syncs; ++i) grid.sync();
}

// Phase 1's access pattern alone: each block reads its chunks of rows (as bnv_moments: chunk k = rows k rpc ..
// (k + 1) rpc, thread t at rows r0 + t / G stepping by 256 / G, 4 rows in flight) and adds them up; TWO reads a
// second tensor at the same places (the backward's x and dy). STRIDED instead takes row groups of 256 / G rows
// (4 KB, the block's 256 threads once) k, k + chunks, k + 2 chunks, ...: at each step the grid reads one
// contiguous window, as the element-wise passes do. Each thread's sum goes to out (so that nothing is dropped).
template <bool STRIDED, bool TWO, int U = 4>
__global__ void __launch_bounds__(VB, 4) probe_read(const T* __restrict__ x, const T* __restrict__ x2, long long rows,
                                                   int c, long long rpc, int chunks, float* out) {
    const int G = c >> 3, t = threadIdx.x, rstep = VB / G, ch0 = (t % G) * 8;
    float acc = 0.0f;
    auto row = [&](long long r) {
        const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(x + r * c + ch0);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc += to_f32(v.v[j]);
        if (TWO) {
            const Vec8<T> w = *reinterpret_cast<const Vec8<T>*>(x2 + r * c + ch0);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc += to_f32(w.v[j]);
        }
    };
    for (int k = blockIdx.x; k < chunks; k += gridDim.x) {
        if (STRIDED) {
            const long long groups = (rows + rstep - 1) / rstep;
#pragma unroll(U)
            for (long long gi = k; gi < groups; gi += chunks) {
                const long long r = gi * rstep + t / G;
                if (r < rows) row(r);
            }
        } else {
            const long long r0 = (long long)k * rpc, r1 = min(rows, r0 + rpc);
#pragma unroll(U)
            for (long long r = r0 + t / G; r < r1; r += rstep) row(r);
        }
    }
    out[blockIdx.x * VB + t] = acc;
}

// Deterministic pseudo-random values in [-2, 2) (plus `offset`), a hash of the index and seed.
__global__ void fill_rand(T* p, long long n, unsigned seed, float offset) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        p[i] = from_f32<T>(hash_unit(i, seed) + offset);
    }
}

struct Shape {
    const char* name;
    long long rows;
    int c;
    bool res;     // a block output: + shortcut, ReLU, mask; its backward is the join
    int fwd, bwd; // launches in one ResNet-152 step (forward train_v8 / train2 counted as train_v8; backward)
};

static int g_sms = 0;

static void coop(const void* f, int grid, void** args) {
    CK(cudaLaunchCooperativeKernel(f, dim3(grid), dim3(VB), args, 0, g_stream));
}

// The launchers' row split (cuda/bn.rs, Split::v8): 132 x per_sm chunks, at least 16 rows a thread; the chunk
// count, and rpc its rows a chunk.
static int split(long long rows, int rstep, int per_sm, long long& rpc) {
    long long chunks = std::min<long long>(132LL * per_sm, std::max<long long>(1, (rows + 16LL * rstep - 1) / (16LL * rstep)));
    rpc = (rows + chunks - 1) / chunks;
    return (int)((rows + rpc - 1) / rpc);
}

static int resident(const void* f) {
    int per = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, f, VB, 0));
    return per * g_sms;
}

int main(int argc, char** argv) {
    const long long n = argc > 1 ? std::atoll(argv[1]) : 256;
    const int per_sm = argc > 2 ? std::atoi(argv[2]) : 3;
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    std::printf("bnbench: %s, %d SMs, batch %lld, %s, chunks target 132 x %d\n", prop.name, g_sms, n, kDtype, per_sm);

    const Shape shapes[] = {
        {"l1 inner 56x56x64", n * 3136, 64, false, 6, 6},     {"l1 out 56x56x256", n * 3136, 256, true, 3, 3},
        {"l2 inner 28x28x128", n * 784, 128, false, 16, 16},  {"l2 out 28x28x512", n * 784, 512, true, 8, 8},
        {"l3 inner 14x14x256", n * 196, 256, false, 72, 72},  {"l3 out 14x14x1024", n * 196, 1024, true, 36, 36},
        {"l4 inner 7x7x512", n * 49, 512, false, 6, 6},       {"l4 out 7x7x2048", n * 49, 2048, true, 3, 3},
    };
    size_t maxe = 0;
    for (const Shape& s : shapes) maxe = std::max(maxe, (size_t)(s.rows * s.c));
    T *x, *r, *y, *dy, *a, *b, *g, *dx;
    uint8_t* mask;
    CK(cudaMalloc(&x, maxe * sizeof(T)));
    CK(cudaMalloc(&r, maxe * sizeof(T)));
    CK(cudaMalloc(&y, maxe * sizeof(T)));
    CK(cudaMalloc(&dy, maxe * sizeof(T)));
    CK(cudaMalloc(&a, maxe * sizeof(T)));
    CK(cudaMalloc(&b, maxe * sizeof(T)));
    CK(cudaMalloc(&g, maxe * sizeof(T)));
    CK(cudaMalloc(&dx, maxe * sizeof(T)));
    CK(cudaMalloc(&mask, maxe / 8));
    fill_rand<<<1024, 256, 0, g_stream>>>(x, maxe, 1u, 0.5f);
    fill_rand<<<1024, 256, 0, g_stream>>>(r, maxe, 2u, 0.0f);
    fill_rand<<<1024, 256, 0, g_stream>>>(dy, maxe, 3u, 0.0f);
    fill_rand<<<1024, 256, 0, g_stream>>>(a, maxe, 4u, 0.0f);
    fill_rand<<<1024, 256, 0, g_stream>>>(b, maxe, 5u, 0.0f);
    float *part, *stats, *w, *bias, *rm, *rv, *sums;
    long long* nbt;
    const size_t maxpart = (2 * 1056 + 1) * 2048;
    CK(cudaMalloc(&part, maxpart * sizeof(float)));
    CK(cudaMalloc(&stats, 3 * 2048 * sizeof(float)));
    CK(cudaMalloc(&sums, 2 * 2048 * sizeof(float)));
    CK(cudaMalloc(&w, 2048 * sizeof(float)));
    CK(cudaMalloc(&bias, 2048 * sizeof(float)));
    CK(cudaMalloc(&rm, 2048 * sizeof(float)));
    CK(cudaMalloc(&rv, 2048 * sizeof(float)));
    CK(cudaMalloc(&nbt, sizeof(long long)));
    {
        std::vector<float> hw(2048), hb(2048), one(2048, 1.0f), zero(2048, 0.0f);
        for (int i = 0; i < 2048; ++i) {
            hw[i] = 0.5f + 0.001f * i;
            hb[i] = 0.01f * (i % 17) - 0.05f;
        }
        CK(cudaMemcpy(w, hw.data(), 2048 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(bias, hb.data(), 2048 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(rm, zero.data(), 2048 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(rv, one.data(), 2048 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(nbt, 0, 8));
    }
    CK(cudaDeviceSynchronize());

    const void* f_train = (const void*)BNB_K(bn_nhwc_train_v8);
    const void* f_bwd = (const void*)BNB_K(bn_nhwc_train_bwd_v8);
    const void* f_join = (const void*)BNB_K(bn_nhwc_train_join_bwd_2_v8);
    const void* f_empty = (const void*)bnbench_empty_coop;

    // Per step totals (us), per column.
    const char* cols[] = {"full", "y null", "final", "final+apply", "empty0", "empty1", "empty2", "bwd/join"};
    double step[8] = {0};
    std::printf("%-20s %7s %5s %5s | %8s %8s %8s %11s %7s %7s %7s | %8s | hashes\n", "shape", "MB", "chnk", "grid",
                "full", "y null", "final", "final+apply", "empty0", "empty1", "empty2", "bwd");
    for (const Shape& s : shapes) {
        const long long rows = s.rows;
        int c = s.c;
        const int G = c / 8, rstep = VB / G;
        long long rpc;
        int ichunks = split(rows, rstep, per_sm, rpc);
        const int grid = std::min<int>(resident(f_train), ichunks);
        const int gridb = std::min<int>(resident(s.res ? f_join : f_bwd), ichunks);
        const double mb = rows * c * sizeof(T) / 1e6;
        float eps = 1e-5f, mom = 0.1f, count = (float)rows;
        int relu = s.res ? 0 : 1, have = 0, rev = 1;
        const T* resp = s.res ? r : nullptr;
        uint8_t* maskp = s.res ? mask : nullptr;
        T* yp = y;
        T* ynull = nullptr;
        void* args_full[] = {&x, &resp, &part, &stats, &w, &bias, &yp, &maskp, (void*)&rows, &c, &rpc, &ichunks, &eps,
                             &rm, &rv, &nbt, &mom, &relu, &have, &rev};
        auto full = [&] { coop(f_train, grid, args_full); };
        // Hashes of one launch from fresh running statistics.
        full();
        CK(cudaStreamSynchronize(g_stream));
        unsigned long long h_stats = fnv(stats, 3 * c * 4), h_y = fnv(y, rows * c * sizeof(T));
        unsigned long long h_mask = s.res ? fnv(mask, rows * c / 8) : 0;
        const double t_full = time_us(full);
        void* args_stats[] = {&x, &resp, &part, &stats, &w, &bias, &ynull, &maskp, (void*)&rows, &c, &rpc, &ichunks,
                              &eps, &rm, &rv, &nbt, &mom, &relu, &have, &rev};
        const double t_stats = time_us([&] { coop(f_train, grid, args_stats); });
        int have1 = 1;
        void* args_fin[] = {&x, &resp, &part, &stats, &w, &bias, &ynull, &maskp, (void*)&rows, &c, &rpc, &ichunks,
                            &eps, &rm, &rv, &nbt, &mom, &relu, &have1, &rev};
        const double t_fin = time_us([&] { coop(f_train, grid, args_fin); });
        void* args_finapply[] = {&x, &resp, &part, &stats, &w, &bias, &yp, &maskp, (void*)&rows, &c, &rpc, &ichunks,
                                 &eps, &rm, &rv, &nbt, &mom, &relu, &have1, &rev};
        const double t_finapply = time_us([&] { coop(f_train, grid, args_finapply); });
        double t_empty[3];
        for (int k = 0; k < 3; ++k) {
            int syncs = k;
            void* args_e[] = {&syncs};
            t_empty[k] = time_us([&] { coop(f_empty, grid, args_e); });
        }
        // The backward: inner BatchNorm + ReLU, or the block output's join (a + b through the mask).
        double t_bwd;
        unsigned long long h_b1, h_b2;
        if (s.res) {
            full();  // the mask of this shape
            void* args_j[] = {&a, &b, &ynull, &mask, &g, &x, &stats, &w, &bias, &part, &sums, &dx, (void*)&rows, &c,
                              &rpc, &ichunks, &count, &rev};
            auto join = [&] { coop(f_join, gridb, args_j); };
            join();
            CK(cudaStreamSynchronize(g_stream));
            h_b1 = fnv(dx, rows * c * sizeof(T)) ^ fnv(g, rows * c * sizeof(T));
            h_b2 = fnv(sums, 2 * c * 4);
            t_bwd = time_us(join);
        } else {
            void* args_b[] = {&x, &dy, &stats, &w, &bias, &part, &sums, &dx, (void*)&rows, &c, &rpc, &ichunks, &count,
                              &relu, &rev, &have};
            auto bwd = [&] { coop(f_bwd, gridb, args_b); };
            bwd();
            CK(cudaStreamSynchronize(g_stream));
            h_b1 = fnv(dx, rows * c * sizeof(T));
            h_b2 = fnv(sums, 2 * c * 4);
            t_bwd = time_us(bwd);
        }
        std::printf("%-20s %7.1f %5d %5d | %8.1f %8.1f %8.1f %11.1f %7.1f %7.1f %7.1f | %8.1f | %016llx %016llx %016llx "
                    "%016llx %016llx\n",
                    s.name, mb, ichunks, grid, t_full, t_stats, t_fin, t_finapply, t_empty[0], t_empty[1], t_empty[2],
                    t_bwd, h_stats, h_y, h_mask, h_b1, h_b2);
        const double v[7] = {t_full, t_stats, t_fin, t_finapply, t_empty[0], t_empty[1], t_empty[2]};
        for (int k = 0; k < 7; ++k) step[k] += v[k] * s.fwd;
        step[7] += t_bwd * s.bwd;
    }
    std::printf("phase 1's reads alone (probe_read, TB/s): contiguous chunks / strided row groups, 4 rows in flight a "
                "thread; x, then x + dy; then x alone with 8 rows in flight (contiguous / strided)\n");
    float* pout;
    CK(cudaMalloc(&pout, 2048 * VB * sizeof(float)));
    for (const Shape& s : shapes) {
        long long rows = s.rows;
        int c = s.c;
        const int G = c / 8, rstep = VB / G;
        long long rpc;
        int ichunks = split(rows, rstep, per_sm, rpc);
        const int grid = std::min<int>(resident((const void*)probe_read<false, false>), ichunks);
        const double bytes = rows * c * sizeof(T);
        double tb[6];
        void* args[] = {&x, &dy, (void*)&rows, &c, &rpc, &ichunks, &pout};
        const void* fs[6] = {(const void*)probe_read<false, false>,   (const void*)probe_read<true, false>,
                             (const void*)probe_read<false, true>,    (const void*)probe_read<true, true>,
                             (const void*)probe_read<false, false, 8>, (const void*)probe_read<true, false, 8>};
        for (int k = 0; k < 6; ++k) {
            const double us = time_us([&] { CK(cudaLaunchKernel(fs[k], dim3(grid), dim3(VB), args, 0, g_stream)); });
            tb[k] = bytes * (k == 2 || k == 3 ? 2 : 1) / us / 1e6;
        }
        std::printf("  %-20s  x: %5.2f / %5.2f   x + dy: %5.2f / %5.2f   x, 8 in flight: %5.2f / %5.2f\n", s.name,
                    tb[0], tb[1], tb[2], tb[3], tb[4], tb[5]);
    }
    std::printf("per ResNet-152 step (these shapes, launches weighted; the stem and train2 not separate), ms:\n");
    for (int k = 0; k < 8; ++k) std::printf("  %-12s %8.3f\n", cols[k], step[k] / 1e3);
    return 0;
}
