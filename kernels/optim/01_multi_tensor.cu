// Multi-tensor FP32 kernels for the end of a training step: one launch over all ~465 parameter tensors instead of
// several candle ops per tensor (each its own launch and allocation).
//
// Tables (built on the host, crates/kernels/src/cuda/optim.rs): per tensor i, tab[4 i + 0] = device
// address of the tensor's FP32 data, tab[4 i + 1] = its offset in the flat buffer, tab[4 i + 2] = its length,
// tab[4 i + 3] = two f32 (low: weight decay, high: lr multiplier). Per block b, chunks[b] = (tensor, first element):
// every block handles up to CHUNK consecutive elements of one tensor.
//
// mt_gather_f32: flat[off + j] = src[j] * scale / div[0] (div: a device scalar, the loss scale; may be null),
//   and partial[b] = sum of the squares this block wrote (summed in a fixed order by the caller: deterministic).
//   The flat buffer is the unscaled gradient of the whole model.
//
// The update kernels decide on the device, so the host never waits for the gradient norm (no host
// synchronisation inside a training step): norm_sq = the sum of squares of the unscaled gradient (device scalar);
// when it is not finite (an inf/NaN gradient, fp16 overflow) the step is skipped and nothing is written; else
// coef = clip > 0 && sqrt(norm_sq) > clip ? clip / (sqrt(norm_sq) + 1e-6) : 1 (global-norm clipping).
// mt_sgd_f32: PyTorch's SGD on each tensor, in place: g = flat_grad * coef (+ wd * p); momentum buffer (flat, zero
//   before the first step, so its first value is g as PyTorch starts it) buf = momentum * buf + g;
//   d = nesterov ? g + momentum * buf : buf (or g without momentum); p -= lr * lr_mult * d. The learning rate is
//   read from device memory (lr_p, one float), so that a captured CUDA graph replays with each step's rate.
// mt_adamw_f32: PyTorch's AdamW on each tensor, in place: lr' = lr * lr_mult; p *= 1 - lr' * wd (decoupled decay);
//   g = flat_grad * coef; m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2 (flat state buffers);
//   p -= lr' * (m / bc1) / (sqrt(v / bc2) + eps), bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, t = ctl[2] + 1 (the steps
//   taken so far, kept on the device by amp_update_f32), the corrections from omb = 1 - beta given by the host.
//
// amp_update_f32 (one thread, after the update): torch.amp.GradScaler's update on the device state
//   ctl = [scale, growth tracker, optimizer steps taken]: inf/NaN -> scale *= backoff, tracker = 0; else steps += 1,
//   tracker += 1 and at the growth interval scale *= growth, tracker = 0 (scale clamped to [min, max] where those
//   are > 0; with scaling disabled only the step count moves). out = [scale used, found inf (0/1), scale, tracker,
//   steps after]: the step's report, read by the host whenever it is ready.
//
// Both update kernels can also write the low-precision copy that the convolutions read (lowp, not null): for a
//   tensor i with ltab[2 i] != ~0 (a convolution weight), element j's new value, rounded to bf16 (lowp_f16 == 0)
//   or fp16, is stored at lowp[ltab[2 i] + krsc_of(j)] (ltab[2 i + 1] = c | (r * s) << 32), the element
//   mt_weights_krsc would write from the updated master. The step's weights are then made by the update that
//   changes them (no per-step cast and permute); a skipped step writes neither.
//
// mt_weights_krsc_{bf16,f16}: the convolution weights for a training step, FP32 (k, c, r, s) -> the activation
//   dtype in the kernels' (k, r, s, c) layout, all of them in one launch (instead of a cast and a permuting copy
//   per weight); tab[4 i + 3] = c | (r * s) << 32, tab[4 i + 1] = the output offset in elements.
// mt_grads_kcrs_{bf16,f16}: the reverse for the grad-weights of a step: (k, r, s, c) in the activation dtype at
//   tab[4 i] -> FP32 (k, c, r, s) at offset tab[4 i + 1] of one flat output.
#include "common.cuh"

#define CHUNK 16384

__device__ __forceinline__ float lo_f(unsigned long long v) { return __uint_as_float((unsigned)(v & 0xffffffffu)); }
__device__ __forceinline__ float hi_f(unsigned long long v) { return __uint_as_float((unsigned)(v >> 32)); }

extern "C" __global__ void __launch_bounds__(256) mt_gather_f32(const unsigned long long* __restrict__ tab,
                                                                 const int2* __restrict__ chunks,
                                                                 float* __restrict__ flat, float scale,
                                                                 const float* __restrict__ div,
                                                                 float* __restrict__ partial) {
    if (div != nullptr) scale = scale / div[0];
    const int2 ch = chunks[blockIdx.x];
    const float* src = reinterpret_cast<const float*>(tab[4 * ch.x]);
    const long long off = (long long)tab[4 * ch.x + 1], len = (long long)tab[4 * ch.x + 2];
    const long long end = min(len, (long long)ch.y + CHUNK);
    float sq = 0.f;
    for (long long j = ch.y + threadIdx.x; j < end; j += blockDim.x) {
        const float v = src[j] * scale;
        flat[off + j] = v;
        sq += v * v;
    }
    __shared__ float red[8];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += red[w];
        partial[blockIdx.x] = t;
    }
}

// The (k, r, s, c) index of element j = (k * c + ci) * rs + t of a (k, c, r, s) tensor: (k * rs + t) * c + ci. In
// 32-bit arithmetic (the launcher checks that every tensor has fewer than 2^31 elements): the two 64-bit integer
// divisions an element it replaces are each a long instruction sequence, a likely reason why the relayouts ran at
// about a third of copy speed (ResNet-152's 60M weights: 218 / 228 us each way on the H200, ktrace 2026-12-05).
__device__ __forceinline__ int krsc_of(int j, int c, int rs) {
    const int kc = j / rs;
    const int t = j - kc * rs;
    const int k = kc / c;
    const int ci = kc - k * c;
    return (k * rs + t) * c + ci;
}

// False when the step is skipped (norm_sq not finite); else the clipping coefficient in *coef.
__device__ __forceinline__ bool clip_coef(const float* __restrict__ norm_sq, float clip, float* coef) {
    const float nsq = norm_sq[0];
    if (!isfinite(nsq)) return false;
    const float norm = sqrtf(nsq);
    *coef = (clip > 0.f && norm > clip) ? clip / (norm + 1e-6f) : 1.f;
    return true;
}

// The low-precision copy of the chunk's tensor (ltab, see the top): its offset in lowp (NO_LOWP: none) and its
// (c, r * s); lowp_store writes element j's new value v there.
#define NO_LOWP 0xffffffffffffffffull
struct LowpDst {
    unsigned long long off;
    int c, rs;
};

__device__ __forceinline__ LowpDst lowp_dst(const void* lowp, const unsigned long long* __restrict__ ltab, int i) {
    LowpDst d{NO_LOWP, 1, 1};
    if (lowp != nullptr) {
        d.off = ltab[2 * i];
        d.c = (int)(ltab[2 * i + 1] & 0xffffffffu);
        d.rs = (int)(ltab[2 * i + 1] >> 32);
    }
    return d;
}

__device__ __forceinline__ void lowp_store(void* lowp, int lowp_f16, const LowpDst& d, long long j, float v) {
    if (d.off == NO_LOWP) return;
    const long long o = (long long)d.off + krsc_of((int)j, d.c, d.rs);
    if (lowp_f16) {
        static_cast<__half*>(lowp)[o] = from_f32<__half>(v);
    } else {
        static_cast<__nv_bfloat16*>(lowp)[o] = from_f32<__nv_bfloat16>(v);
    }
}

// One SGD element (the rule at the top): the new value of parameter pj from its raw gradient g0, with the momentum
// buffer *buf read and written when momentum != 0.
__device__ __forceinline__ float sgd_elem(float pj, float g0, float* buf, float coef, float wd, float lrm,
                                          float momentum, int nesterov) {
    float g = g0 * coef;
    if (wd != 0.f) g += wd * pj;
    float d = g;
    if (momentum != 0.f) {
        const float b = momentum * *buf + g;
        *buf = b;
        d = nesterov ? g + momentum * b : b;
    }
    return pj - lrm * d;
}

// Each thread moves 16-byte vectors of p, the gradient and the momentum buffer where all three are 16-byte aligned
// at the chunk (the chunks start at multiples of 4 elements), so that four times the bytes are in flight a load;
// the chunk's last (len % 4) elements, and tensors at an unaligned flat offset, go element by element. The same
// arithmetic per element either way.
extern "C" __global__ void __launch_bounds__(256) mt_sgd_f32(const unsigned long long* __restrict__ tab,
                                                              const int2* __restrict__ chunks,
                                                              const float* __restrict__ grad,
                                                              float* __restrict__ mom,
                                                              const float* __restrict__ norm_sq, float clip,
                                                              const float* __restrict__ lr_p, float momentum,
                                                              int nesterov, void* lowp,
                                                              const unsigned long long* __restrict__ ltab,
                                                              int lowp_f16) {
    float coef;
    if (!clip_coef(norm_sq, clip, &coef)) return;
    const float lr = *lr_p;
    const int2 ch = chunks[blockIdx.x];
    float* p = reinterpret_cast<float*>(tab[4 * ch.x]);
    const long long off = (long long)tab[4 * ch.x + 1], len = (long long)tab[4 * ch.x + 2];
    const float wd = lo_f(tab[4 * ch.x + 3]), lrm = hi_f(tab[4 * ch.x + 3]) * lr;
    const LowpDst ld = lowp_dst(lowp, ltab, ch.x);
    const long long end = min(len, (long long)ch.y + CHUNK);
    long long tail = ch.y;
    const unsigned long long addrs = (unsigned long long)(p + ch.y) | (unsigned long long)(grad + off + ch.y) |
                                     (unsigned long long)(mom + off + ch.y);
    if ((addrs & 15) == 0) {
        const long long n4 = (end - ch.y) >> 2;
        for (long long q = threadIdx.x; q < n4; q += blockDim.x) {
            const long long j = ch.y + 4 * q;
            const float4 pv = *reinterpret_cast<const float4*>(p + j);
            const float4 gv = *reinterpret_cast<const float4*>(grad + off + j);
            float4 mv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (momentum != 0.f) mv = *reinterpret_cast<const float4*>(mom + off + j);
            float4 pn;
            pn.x = sgd_elem(pv.x, gv.x, &mv.x, coef, wd, lrm, momentum, nesterov);
            pn.y = sgd_elem(pv.y, gv.y, &mv.y, coef, wd, lrm, momentum, nesterov);
            pn.z = sgd_elem(pv.z, gv.z, &mv.z, coef, wd, lrm, momentum, nesterov);
            pn.w = sgd_elem(pv.w, gv.w, &mv.w, coef, wd, lrm, momentum, nesterov);
            *reinterpret_cast<float4*>(p + j) = pn;
            if (momentum != 0.f) *reinterpret_cast<float4*>(mom + off + j) = mv;
            lowp_store(lowp, lowp_f16, ld, j, pn.x);
            lowp_store(lowp, lowp_f16, ld, j + 1, pn.y);
            lowp_store(lowp, lowp_f16, ld, j + 2, pn.z);
            lowp_store(lowp, lowp_f16, ld, j + 3, pn.w);
        }
        tail = ch.y + 4 * n4;
    }
    for (long long j = tail + threadIdx.x; j < end; j += blockDim.x) {
        float m = momentum != 0.f ? mom[off + j] : 0.f;
        const float pn = sgd_elem(p[j], grad[off + j], &m, coef, wd, lrm, momentum, nesterov);
        if (momentum != 0.f) mom[off + j] = m;
        p[j] = pn;
        lowp_store(lowp, lowp_f16, ld, j, pn);
    }
}

// Layout copy with a dtype conversion over the chunks of the table: (k, c, r, s) S -> (k, r, s, c) D when TO_KRSC
// (reading in order), else (k, r, s, c) S -> (k, c, r, s) D (writing in order: coalesced stores).
template <typename S, typename D, bool TO_KRSC>
__device__ void mt_relayout(const unsigned long long* __restrict__ tab, const int2* __restrict__ chunks,
                            D* __restrict__ out) {
    const int2 ch = chunks[blockIdx.x];
    const S* src = reinterpret_cast<const S*>(tab[4 * ch.x]);
    const long long off = (long long)tab[4 * ch.x + 1], len = (long long)tab[4 * ch.x + 2];
    const int c = (int)(tab[4 * ch.x + 3] & 0xffffffffu), rs = (int)(tab[4 * ch.x + 3] >> 32);
    const long long end = min(len, (long long)ch.y + CHUNK);
    for (long long j = ch.y + threadIdx.x; j < end; j += blockDim.x) {
        if (TO_KRSC) {
            out[off + krsc_of((int)j, c, rs)] = from_f32<D>(to_f32(src[j]));
        } else {
            out[off + j] = from_f32<D>(to_f32(src[krsc_of((int)j, c, rs)]));
        }
    }
}

// One export of mt_relayout: NAME(tab, chunks, out) from S to D, to (k, r, s, c) when TO_KRSC.
#define MT_RELAYOUT_EXPORT(NAME, S, D, TO_KRSC)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                               \
        NAME(const unsigned long long* __restrict__ tab, const int2* __restrict__ chunks, D* __restrict__ out) {    \
        mt_relayout<S, D, TO_KRSC>(tab, chunks, out);                                                               \
    }

MT_RELAYOUT_EXPORT(mt_weights_krsc_bf16, float, __nv_bfloat16, true)
MT_RELAYOUT_EXPORT(mt_weights_krsc_f16, float, __half, true)
MT_RELAYOUT_EXPORT(mt_grads_kcrs_bf16, __nv_bfloat16, float, false)
MT_RELAYOUT_EXPORT(mt_grads_kcrs_f16, __half, float, false)

extern "C" __global__ void __launch_bounds__(256) mt_adamw_f32(const unsigned long long* __restrict__ tab,
                                                                const int2* __restrict__ chunks,
                                                                const float* __restrict__ grad,
                                                                float* __restrict__ exp_avg,
                                                                float* __restrict__ exp_avg_sq,
                                                                const float* __restrict__ norm_sq, float clip,
                                                                const float* __restrict__ ctl,
                                                                const float* __restrict__ lr_p, float beta1,
                                                                float beta2, float eps, float omb1, float omb2,
                                                                void* lowp, const unsigned long long* __restrict__ ltab,
                                                                int lowp_f16) {
    float coef;
    if (!clip_coef(norm_sq, clip, &coef)) return;
    const float lr = *lr_p;
    // 1 - beta^t from 1 - beta (omb, exact from the host's double): 1 - powf(beta, t) would cancel away the
    // digits of an f32 beta close to 1 (0.999f is 0.99900001, 1.3e-5 off in 1 - beta2 at t = 1).
    const float t = ctl[2] + 1.f;
    const float bc1 = -expm1f(t * log1pf(-omb1)), bc2 = -expm1f(t * log1pf(-omb2));
    const int2 ch = chunks[blockIdx.x];
    float* p = reinterpret_cast<float*>(tab[4 * ch.x]);
    const long long off = (long long)tab[4 * ch.x + 1], len = (long long)tab[4 * ch.x + 2];
    const float wd = lo_f(tab[4 * ch.x + 3]), lrm = hi_f(tab[4 * ch.x + 3]) * lr;
    const LowpDst ld = lowp_dst(lowp, ltab, ch.x);
    const long long end = min(len, (long long)ch.y + CHUNK);
    for (long long j = ch.y + threadIdx.x; j < end; j += blockDim.x) {
        float pj = p[j];
        if (wd != 0.f) pj = pj * (1.f - lrm * wd);
        const float g = grad[off + j] * coef;
        // 1 - beta from the host's double (omb): 1.f - 0.999f is 0.00099998713, 1.3e-5 off, which v / bc2 would
        // carry into every update (bc2 is made from omb2).
        const float m = beta1 * exp_avg[off + j] + omb1 * g;
        const float v = beta2 * exp_avg_sq[off + j] + omb2 * (g * g);
        exp_avg[off + j] = m;
        exp_avg_sq[off + j] = v;
        const float pn = pj - lrm * ((m / bc1) / (sqrtf(v / bc2) + eps));
        p[j] = pn;
        lowp_store(lowp, lowp_f16, ld, j, pn);
    }
}

extern "C" __global__ void amp_update_f32(float* __restrict__ ctl, const float* __restrict__ norm_sq,
                                          float* __restrict__ out, float growth, float backoff, int interval,
                                          float min_scale, float max_scale, int enabled) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const bool inf = !isfinite(norm_sq[0]);
    float scale = ctl[0], tracker = ctl[1], steps = ctl[2];
    out[0] = scale;
    out[1] = inf ? 1.f : 0.f;
    if (!inf) steps += 1.f;
    if (enabled) {
        if (inf) {
            scale *= backoff;
            tracker = 0.f;
        } else {
            tracker += 1.f;
            if (tracker >= (float)interval) {
                scale *= growth;
                tracker = 0.f;
            }
        }
        if (min_scale > 0.f) scale = fmaxf(scale, min_scale);
        if (max_scale > 0.f) scale = fminf(scale, max_scale);
    }
    ctl[0] = scale;
    ctl[1] = tracker;
    ctl[2] = steps;
    out[2] = scale;
    out[3] = tracker;
    out[4] = steps;
}
