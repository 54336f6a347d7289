// Hopper (sm_90a) core of the GEMM / implicit-GEMM convolution kernels: warpgroup MMA (wgmma.mma_async) reading
// both operands straight from shared memory, instead of ldmatrix + mma.sync (gemm_body in igemm.cuh).
//
// - Block tile BM x BN x 64, BM / 64 warpgroups; warpgroup g owns rows [64 g, 64 g + 64) and all BN columns, as
//   BN / 128 wgmma.m64n128k16 per 16-deep k-step (4 k-steps per stage).
// - The same loaders fill the same STAGES-deep cp.async ring as gemm_body; their shared layouts are wgmma's
//   128-byte-swizzle canonical layouts: K-major tiles are the KD = 64 layout of igemm.cuh (128-byte rows, chunk
//   c ^ (row & 7), 8-row atoms of 1024 bytes), MN-major tiles the panelled layout (off_mnpanel: 64-element panels of
//   64 k-rows, chunk c ^ (k & 7)). Every stage starts on a 1024-byte boundary.
// - Descriptors (PTX ISA, "matrix descriptor"): K-major: stride byte offset (next 8 rows) 1024, leading byte
//   offset unused (16); a 16-deep k-step is +32 bytes of the start address (the swizzle is applied to the final
//   address). MN-major: leading byte offset = panel stride (KD * 128 bytes), stride byte offset (next 8 k-rows)
//   1024; a k-step is +16 k-rows = 2048 bytes.
// - Pipeline: prefetch distance STAGES - 2. Iteration kt waits for its stage, fences the cp.async writes to the
//   async proxy, syncs, issues the copies of tile kt + STAGES - 2 into the stage of tile kt - 2 (free: every
//   warpgroup waited for wgmma group kt - 2 before this barrier), issues the wgmmas of tile kt, and waits until at
//   most one wgmma group (this one) is in flight. So the tensor cores always have the next group queued while the
//   threads wait for memory.
// - Accumulators use the mma.sync fragment layout per 16-row warp slice, so `epilogue` of igemm.cuh writes them.
#pragma once
#include "gemm/igemm.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma kernels must be compiled for sm_90a (build.rs: files named *wgmma*)"
#endif

namespace ig {

// Matrix descriptor: start address, leading / stride byte offsets (all in 16-byte units, 14 bits), 128-byte
// swizzle (layout type 1, bits 62-63).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's completed cp.async (generic proxy) writes visible to wgmma's reads (async proxy).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across a wgmma issue / wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D[64][128] += A[64][16] B[16][128]; TA / TB = 1: A / B MN-major in shared memory (0: K-major). One overload per
// operand type (CTYPE: C++ type, PTYPE: its PTX name).
#define IG_WGMMA_N128(CTYPE, PTYPE) \
    template <int TA, int TB> \
    __device__ __forceinline__ void wgmma_n128(float(&d)[64], uint64_t da, uint64_t db, CTYPE) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTYPE "." PTYPE " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
            "%64, %65, p, 1, 1, %67, %68;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB)); \
    }
IG_WGMMA_N128(__nv_bfloat16, "bf16")
IG_WGMMA_N128(__half, "f16")
#undef IG_WGMMA_N128

// D[64][64] += A[64][16] B[16][64] (the TMA kernel's 64-wide tile x64).
#define IG_WGMMA_N64(CTYPE, PTYPE) \
    template <int TA, int TB> \
    __device__ __forceinline__ void wgmma_n64(float(&d)[32], uint64_t da, uint64_t db, CTYPE) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTYPE "." PTYPE " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
            "%32, %33, p, 1, 1, %35, %36;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB)); \
    }
IG_WGMMA_N64(__nv_bfloat16, "bf16")
IG_WGMMA_N64(__half, "f16")
#undef IG_WGMMA_N64

// Dynamic shared memory rounded up to the next 1024-byte boundary (the launch reserves 1 KiB extra).
template <typename T>
__device__ __forceinline__ T* align1k(unsigned char* p) {
    uint32_t a = smem_u32(p);
    return reinterpret_cast<T*>(p + (((a + 1023u) & ~1023u) - a));
}

template <typename T, int BM, int BN, int STAGES, bool A_KMAJOR, bool B_KMAJOR, bool OUT_SPLIT, typename LA,
          typename LB, bool ROWMAP = false>
__device__ __forceinline__ void wgmma_body(LA& la, LB& lb, const Shape& sh, int k_begin, int k_end, T* C, float* ws,
                                           const T* bias, T* smem) {
    constexpr int KD = 64;
    constexpr int THREADS = BM / 64 * 128;
    constexpr int NC = BN / 128;  // wgmma.n128 per k-step
    constexpr int NI = BN / 8;    // n8 fragments per thread (epilogue layout)
    constexpr int A_ELEMS = BM * KD, B_ELEMS = BN * KD, STAGE = A_ELEMS + B_ELEMS;
    static_assert(BM % 64 == 0 && BN % 128 == 0, "wgmma tile: BM multiple of 64, BN multiple of 128");
    static_assert(STAGES >= 3, "prefetch distance STAGES - 2 must be at least 1");
    static_assert((STAGE * 2) % 1024 == 0 && (A_ELEMS * 2) % 1024 == 0, "stages must stay 1024-byte aligned");
    static_assert(BM * (BN + 8) <= STAGES * STAGE, "epilogue tile must fit in the pipeline's shared memory");

    const int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5;
    const int wm0 = wg * 64 + (warp & 3) * 16;

    float acc[1][NI][4];
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][j][e] = 0.f;
    float(&flat)[NI * 4] = *reinterpret_cast<float(*)[NI * 4]>(&acc[0][0][0]);

    const int ktiles = k_end > k_begin ? (k_end - k_begin + KD - 1) / KD : 0;
#pragma unroll
    for (int st = 0; st < STAGES - 2; ++st) {
        if (st < ktiles) {
            la.load(smem + st * STAGE);
            lb.load(smem + st * STAGE + A_ELEMS);
        }
        cp_async_commit();
    }

    const uint32_t s0 = smem_u32(smem);
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 3>();
        fence_async_smem();
        __syncthreads();
        {
            int nt = kt + STAGES - 2;
            if (nt < ktiles) {
                T* st = smem + (nt % STAGES) * STAGE;
                la.load(st);
                lb.load(st + A_ELEMS);
            }
            cp_async_commit();
        }
        const uint32_t sa = s0 + (kt % STAGES) * STAGE * 2, sb = sa + A_ELEMS * 2;
        fence_regs(flat);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KD / 16; ++kk) {
            const uint64_t da = A_KMAJOR ? wg_desc(sa + wg * 64 * KD * 2 + kk * 32, 16, 1024)
                                         : wg_desc(sa + wg * KD * 128 + kk * 2048, KD * 128, 1024);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const uint64_t db = B_KMAJOR ? wg_desc(sb + c * 128 * KD * 2 + kk * 32, 16, 1024)
                                             : wg_desc(sb + c * 2 * KD * 128 + kk * 2048, KD * 128, 1024);
                wgmma_n128<A_KMAJOR ? 0 : 1, B_KMAJOR ? 0 : 1>(
                    *reinterpret_cast<float(*)[64]>(&acc[0][c * 16][0]), da, db, T());
            }
        }
        wg_commit();
        wg_wait<1>();
        fence_regs(flat);
    }
    wg_wait<0>();
    fence_regs(flat);
    cp_async_wait<0>();
    epilogue<T, BM, BN, 1, NI, THREADS, OUT_SPLIT, ROWMAP>(acc, wm0, 0, sh, C, ws, bias, smem);
}

template <int BM, int BN, int STAGES>
constexpr int wgmma_smem_bytes() { return STAGES * (BM + BN) * 64 * 2 + 1024; }

}  // namespace ig
