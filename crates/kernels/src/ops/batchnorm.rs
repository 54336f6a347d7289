//! Training-mode BatchNorm (+ optional fused ReLU) over channels-last tensors, as candle custom ops.
//!
//! x (.., c) contiguous is viewed as (rows, c), rows = n * h * w for an (n, h, w, c) activation. Per channel:
//! mean = sum(x) / rows, var = sum((x - mean)^2) / rows (biased, two passes), invstd = 1 / sqrt(var + eps), and
//! y = (x - mean) * (invstd * weight) + bias, then max(y, 0) when `relu`. Statistics are FP32 (the CPU reference
//! accumulates in FP64) whatever x's dtype; y is rounded once to x's dtype.
//!
//! Backward (xhat = (x - mean) * invstd; g = dy, with `relu` zeroed where the pre-activation is negative; M =
//! rows): dbias = sum(g), dweight = sum(g * xhat), dx = weight * invstd * (g - dbias / M - xhat * dweight / M).
//! The ReLU mask is recomputed from x with the forward's exact expression and passes the gradient at a
//! pre-activation of exactly 0, as candle's `relu` (and so the NCHW path) does (PyTorch masks it: y > 0); exact
//! zeros do occur (an element equal to its channel's mean with zero bias). The backward reads x and dy only and
//! keeps x in its own dtype plus the (3, c) FP32 statistics: no FP32 copy of the activation.
//!
//! Ops: [`BnStats`] (x -> (3, c) = [mean, var, invstd]), [`BnApply`] (x, weight, bias -> y, differentiable),
//! [`BnGrad`] (x, dy -> (2, c) = [dbias, dweight], then x, dy -> dx). The per-channel tensors an op needs besides
//! its arguments are fields of the op. [`batch_stats`] is [`BnStats`] with the BatchNorm's running statistics
//! updated too (on CUDA inside the statistics' finaliser). The CUDA kernels are in `kernels/batchnorm/01_nhwc.cu`
//! and `02_nhwc_vec.cu` (launchers in `cuda/bn.rs`).

use super::maxpool::{MaxPool2d, MaxPool2dNhwc, MaxPool2dNhwcOffsets};
use super::round_f32;
use crate::dispatch::contiguous;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, Var, WithDType};

/// Training-mode BatchNorm of a channels-last tensor with batch statistics, optionally followed by ReLU.
///
/// `x`: (.., c) (e.g. (n, h, w, c)) in f32/bf16/f16, `weight`, `bias`: (c) f32. Returns (y in x's shape and dtype,
/// batch mean (c) f32, biased batch variance (c) f32); mean and variance are not differentiable. y is
/// differentiable w.r.t. x, weight and bias (FP32 gradients for weight and bias).
pub fn batch_norm_nhwc_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (_, c) = rows_c(x.dims())?;
    for (t, what) in [(weight, "weight"), (bias, "bias")] {
        if t.dims() != [c] || t.dtype() != DType::F32 {
            candle_core::bail!("batch_norm_nhwc_train: {what} must be ({c}) f32, got {:?} {:?}", t.dims(), t.dtype());
        }
    }
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        candle_core::bail!("batch_norm_nhwc_train: unsupported dtype {:?} (f32, bf16, f16 only)", x.dtype());
    }
    let x = x.contiguous()?;
    let stats = x.apply_op1_no_bwd(&BnStats { eps })?;
    let y = x.apply_op3(&weight.contiguous()?, &bias.contiguous()?, BnApply { relu, stats: stats.clone() })?;
    Ok((y, stats.get(0)?, stats.get(1)?))
}

/// (rows, c) of a (.., c) shape with rows, c >= 1.
fn rows_c(dims: &[usize]) -> Result<(usize, usize)> {
    match dims.split_last() {
        Some((&c, lead)) if c > 0 && !lead.is_empty() && lead.iter().product::<usize>() > 0 => {
            Ok((lead.iter().product(), c))
        }
        _ => candle_core::bail!(
            "batch_norm_nhwc: expects a (.., c) tensor with at least one row and channel, got {dims:?}"
        ),
    }
}

/// The values of a per-channel f32 tensor held by an op (CPU path).
fn host_f32(t: &Tensor, op: &str) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        candle_core::bail!("{op}: per-channel tensor must be f32, got {:?}", t.dtype());
    }
    t.flatten_all()?.to_vec1::<f32>()
}

fn f32_of<T: WithDType>(v: T) -> f32 {
    v.to_f64() as f32
}

/// [mean, var, invstd] (3 * c) of x (rows, c), accumulated in f64.
fn stats_t<T: WithDType>(x: &[T], c: usize, eps: f64) -> Vec<f32> {
    let rows = x.len() / c;
    let mut sum = vec![0f64; c];
    for row in x.chunks_exact(c) {
        for (s, &v) in sum.iter_mut().zip(row) {
            *s += v.to_f64();
        }
    }
    let mean: Vec<f32> = sum.iter().map(|s| (s / rows as f64) as f32).collect();
    let mut sq = vec![0f64; c];
    for row in x.chunks_exact(c) {
        for ((s, &v), &m) in sq.iter_mut().zip(row).zip(&mean) {
            let d = v.to_f64() - m as f64;
            *s += d * d;
        }
    }
    let var: Vec<f32> = sq.iter().map(|s| (s / rows as f64) as f32).collect();
    let invstd = var.iter().map(|&v| (1.0 / (v as f64 + eps).sqrt()) as f32);
    let mut out = mean.clone();
    out.extend_from_slice(&var);
    out.extend(invstd);
    out
}

/// The pre-activation (x - mean) * scale + b in f32, scale = invstd * weight: the forward and both backward
/// passes evaluate this same expression, so the backward's ReLU mask is exactly the forward's.
#[inline]
fn pre(x: f32, mean: f32, scale: f32, b: f32) -> f32 {
    (x - mean) * scale + b
}

/// Per-channel constants of x (rows, c): (mean, invstd, scale = invstd * weight).
fn channel_consts<'a>(stats: &'a [f32], w: &[f32]) -> (&'a [f32], &'a [f32], Vec<f32>) {
    let c = w.len();
    let (mean, invstd) = (&stats[..c], &stats[2 * c..]);
    (mean, invstd, invstd.iter().zip(w).map(|(i, w)| i * w).collect())
}

/// y = (x - mean) * (invstd * w) + b [relu], in f32, rounded once.
fn apply_t<T: WithDType>(x: &[T], stats: &[f32], w: &[f32], b: &[f32], relu: bool) -> Vec<T> {
    let c = w.len();
    let (mean, _, scale) = channel_consts(stats, w);
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(c) {
        for ch in 0..c {
            let mut v = pre(f32_of(row[ch]), mean[ch], scale[ch], b[ch]);
            if relu {
                v = if v > 0.0 { v } else { 0.0 };
            }
            out.push(round_f32::<T>(v));
        }
    }
    out
}

/// Per-channel inputs of the backward passes: statistics (3 * c), weight and bias (c).
struct Params<'a> {
    stats: &'a [f32],
    w: &'a [f32],
    b: &'a [f32],
    relu: bool,
}

/// Visits every element as `f(channel, g, xhat)`: g = dy, zeroed where the pre-activation is < 0 (or NaN) with
/// ReLU (candle's and the NCHW path's ReLU gradient: it passes at exactly 0), xhat = (x - mean) * invstd.
fn for_each_grad<T: WithDType>(x: &[T], dy: &[T], p: &Params, mut f: impl FnMut(usize, f32, f32)) {
    let c = p.w.len();
    let (mean, invstd, scale) = channel_consts(p.stats, p.w);
    for (xr, gr) in x.chunks_exact(c).zip(dy.chunks_exact(c)) {
        for ch in 0..c {
            let xv = f32_of(xr[ch]);
            // `>= 0` is false for NaN: a NaN pre-activation blocks the gradient, as candle's relu does.
            let passes = !p.relu || pre(xv, mean[ch], scale[ch], p.b[ch]) >= 0.0;
            let g = if passes { f32_of(gr[ch]) } else { 0.0 };
            f(ch, g, (xv - mean[ch]) * invstd[ch]);
        }
    }
}

/// [sum g, sum g * xhat] (2 * c), accumulated in f64.
fn grad_sums_t<T: WithDType>(x: &[T], dy: &[T], p: &Params) -> Vec<f32> {
    let c = p.w.len();
    let (mut sg, mut sgx) = (vec![0f64; c], vec![0f64; c]);
    for_each_grad(x, dy, p, |ch, g, xhat| {
        sg[ch] += g as f64;
        sgx[ch] += g as f64 * xhat as f64;
    });
    sg.iter().chain(&sgx).map(|&s| s as f32).collect()
}

/// dx = w * invstd * (g - sum_g / M - xhat * sum_gxhat / M), in f32, rounded once.
fn grad_input_t<T: WithDType>(x: &[T], dy: &[T], p: &Params, sums: &[f32]) -> Vec<T> {
    let c = p.w.len();
    let count = (x.len() / c) as f32;
    let a: Vec<f32> = p.w.iter().zip(&p.stats[2 * c..]).map(|(w, i)| w * i).collect();
    let k1: Vec<f32> = sums[..c].iter().map(|s| s / count).collect();
    let k2: Vec<f32> = sums[c..].iter().map(|s| s / count).collect();
    let mut out = Vec::with_capacity(x.len());
    for_each_grad(x, dy, p, |ch, g, xhat| out.push(round_f32::<T>(a[ch] * (g - k1[ch] - xhat * k2[ch]))));
    out
}

/// Per-channel batch statistics of x (.., c): (3, c) f32 = [mean, biased var, 1 / sqrt(var + eps)]. No backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BnStats {
    pub eps: f64,
}

impl CustomOp1 for BnStats {
    fn name(&self) -> &'static str {
        "batch_norm_nhwc_stats"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = rows_c(l.dims())?;
        let op = self.name();
        let out = cpu_float!(op, s, [F32, BF16, F16], |v| stats_t(contiguous(v, l, op, "x")?, c, self.eps));
        Ok((CpuStorage::F32(out), Shape::from((3, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = rows_c(l.dims())?;
        Ok((crate::cuda::bn::stats(s, l, rows, c, self.eps, None)?, Shape::from((3, c))))
    }
}

/// A BatchNorm's running statistics (PyTorch's buffers): running_mean and running_var (c) f32,
/// num_batches_tracked a scalar i64, and the momentum of their update.
#[derive(Debug, Clone, Copy)]
pub struct Running<'a> {
    pub mean: &'a Var,
    pub var: &'a Var,
    pub num_batches_tracked: &'a Var,
    pub momentum: f64,
}

/// The device addresses of `running`'s buffers (c channels), for the launches that update them in place.
#[cfg(feature = "cuda")]
fn running_addrs(running: &Running, c: usize) -> Result<crate::cuda::bn::RunningAddrs> {
    use crate::cuda::addr_of;
    Ok(crate::cuda::bn::RunningAddrs {
        mean: addr_of::<f32>(running.mean.as_tensor(), c, "running_mean")?,
        var: addr_of::<f32>(running.var.as_tensor(), c, "running_var")?,
        num_batches_tracked: addr_of::<i64>(running.num_batches_tracked.as_tensor(), 1, "num_batches_tracked")?,
        momentum: running.momentum as f32,
    })
}

/// Runs `f` over the CUDA storages and layouts of `ts` (their guards held meanwhile); an operand elsewhere is an
/// error naming `op`.
#[cfg(feature = "cuda")]
fn with_cuda<R>(
    ts: &[&Tensor],
    op: &str,
    f: impl FnOnce(&[(&candle_core::CudaStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut args = Vec::with_capacity(guards.len());
    for (st, l) in &guards {
        match &**st {
            candle_core::Storage::Cuda(cs) => args.push((cs, *l)),
            _ => candle_core::bail!("{op}: every operand must be on the CUDA device"),
        }
    }
    f(&args)
}

/// A tensor over the fresh CUDA storage `s` (contiguous, no backward).
#[cfg(feature = "cuda")]
fn from_cuda(s: candle_core::CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(candle_core::Storage::Cuda(s), shape, candle_core::op::BackpropOp::none(), false)
}

/// PyTorch's running update from a batch's per-channel mean and biased variance over `count` values each:
/// running = (1 - momentum) running + momentum batch, with the variance made unbiased (count / (count - 1)), and
/// num_batches_tracked + 1. Composed of candle ops (the autograd path and the CPU).
pub fn update_running(r: &Running, mean: &Tensor, var: &Tensor, count: usize) -> Result<()> {
    let m = r.momentum;
    let mean = mean.flatten_all()?;
    let unbiased = (var.flatten_all()? * (count as f64 / (count - 1) as f64))?;
    r.mean.set(&((r.mean.as_tensor().detach() * (1.0 - m))? + (mean * m)?)?)?;
    r.var.set(&((r.var.as_tensor().detach() * (1.0 - m))? + (unbiased * m)?)?)?;
    r.num_batches_tracked.set(&(r.num_batches_tracked.as_tensor().detach() + 1.0)?)?;
    Ok(())
}

/// [`BnStats`] of x (.., c) with `running` updated from them ([`update_running`]). On CUDA the update is written
/// in place by the statistics' finaliser (no further launch on the 8-channel path); elsewhere it runs as
/// [`update_running`]. x needs more than one row (the unbiased variance divides by rows - 1).
pub fn batch_stats(x: &Tensor, eps: f64, running: &Running) -> Result<Tensor> {
    let (rows, _) = rows_c(x.dims())?;
    if rows < 2 {
        candle_core::bail!(
            "BatchNorm2d in training mode needs more than one value per channel, got input {:?}",
            x.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let c = x.dims()[x.rank() - 1];
        let addrs = running_addrs(running, c)?;
        return x.apply_op1_no_bwd(&BnStatsRunning { eps, running: addrs });
    }
    let stats = x.apply_op1_no_bwd(&BnStats { eps })?;
    update_running(running, &stats.get(0)?, &stats.get(1)?, rows)?;
    Ok(stats)
}

/// A training-mode BatchNorm as the one-launch ops take it: weight and bias (c) f32, eps, running statistics.
#[derive(Clone)]
pub struct TrainBn<'a> {
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
    pub running: Running<'a>,
}

/// A training-mode BatchNorm `bn` forward of x (.., c): (stats (3, c) f32 = [mean, biased var, invstd], y = bn(x) in
/// x's dtype, then ReLU when `relu`), with its running statistics updated from the batch ([`batch_stats`]'s
/// update). On CUDA, where the 8-channel kernels apply, in one cooperative launch (`bn_nhwc_train_v8_*`: the
/// moments, their finaliser and the normalisation between grid-wide barriers) instead of three, with the same
/// results bit for bit; elsewhere [`batch_stats`] then [`BnApply`].
pub fn batch_norm_train(x: &Tensor, bn: &TrainBn, relu: bool) -> Result<(Tensor, Tensor)> {
    batch_norm_train_with(x, None, None, bn, relu)
}

/// [`batch_norm_train`] of a residual block's last BatchNorm with the identity shortcut `res` (like x):
/// (stats, y = relu(bn(x) + res)), in one launch on CUDA, else [`batch_stats`] then [`crate::bn_add_relu`]; the
/// same values bit for bit.
pub fn batch_norm_train_add_relu(x: &Tensor, res: &Tensor, bn: &TrainBn) -> Result<(Tensor, Tensor)> {
    batch_norm_train_with(x, Some(res), None, bn, true)
}

/// [`batch_norm_train`] (with `res`: [`batch_norm_train_add_relu`], which always applies the ReLU), optionally
/// from the moments a convolution's epilogue already computed (`moments`: the partials of
/// [`crate::conv2d_nhwc_forward_stats`]): on CUDA one cooperative launch without the moments pass, else
/// [`batch_stats_from_partials`] then the normalisation; the same values as those two bit for bit.
pub fn batch_norm_train_with(
    x: &Tensor,
    res: Option<&Tensor>,
    moments: Option<&Tensor>,
    bn: &TrainBn,
    relu: bool,
) -> Result<(Tensor, Tensor)> {
    let (stats, y, _) = train_with(x, res, moments, bn, relu, false)?;
    Ok((stats, y))
}

/// [`batch_norm_train_with`] of a block output (identity shortcut `res`, then the ReLU) that with `mask` also
/// returns the output's ReLU mask ([`relu_mask`]'s layout), for [`join_grad_backward`] to read instead of the
/// output: (stats, y, mask). On CUDA the cooperative launch writes the mask with y (rows * c / 8 more bytes); where
/// it does not run, the mask is None on CUDA and made from y elsewhere (the CPU tests' path). Without `mask`: None,
/// and [`batch_norm_train_with`]'s launch.
pub fn batch_norm_train_add_relu_masked(
    x: &Tensor,
    res: &Tensor,
    moments: Option<&Tensor>,
    bn: &TrainBn,
    mask: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    train_with(x, Some(res), moments, bn, true, mask)
}

/// The ReLU mask of a block output y (.., c), c % 8 == 0: u8 (rows, c / 8), bit j of byte (row, group) set where
/// y[row, 8 group + j] > 0, what the cooperative forward kernels write with y (`relu_bits8`). Made on the host:
/// the CPU path and the tests.
pub fn relu_mask(y: &Tensor) -> Result<Tensor> {
    let (rows, c) = rows_c(y.dims())?;
    if c % 8 != 0 {
        candle_core::bail!("relu_mask: {c} channels is not a multiple of 8");
    }
    let v = y.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let bits: Vec<u8> =
        v.chunks_exact(8).map(|g| g.iter().enumerate().fold(0u8, |m, (j, &e)| m | (u8::from(e > 0.0) << j))).collect();
    Tensor::from_vec(bits, (rows, c / 8), y.device())
}

/// A tensor like `like` that is 1 where `mask` ([`relu_mask`]'s layout) has its bit set and 0 elsewhere: the gate
/// [`crate::relu_grad`] / [`crate::add_relu_grad`] test as y > 0, so that a gradient gated by it equals one gated
/// by the output the mask was made from. Made on the host (the fallback of [`join_grad_backward`]).
fn gate_from_mask(mask: &Tensor, like: &Tensor) -> Result<Tensor> {
    let (rows, c) = rows_c(like.dims())?;
    if mask.dims() != [rows, c / 8] || c % 8 != 0 || mask.dtype() != DType::U8 {
        candle_core::bail!(
            "ReLU mask {:?} {:?} does not fit an output of {:?}",
            mask.dtype(),
            mask.dims(),
            like.dims()
        );
    }
    let bits = mask.flatten_all()?.to_vec1::<u8>()?;
    let v: Vec<f32> = bits.iter().flat_map(|&m| (0..8).map(move |j| f32::from((m >> j) & 1))).collect();
    Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(like.dtype())
}

/// The block-output join of a main-path gradient `a` and a shortcut gradient `b` (same shape) under a ReLU
/// `mask` ([`relu_mask`]'s layout): mask ? a + b : 0 per element, in FP32 rounded once, as [`crate::add_relu_grad`]
/// gates by the output the mask was made from (and the cooperative join kernels compute it). The gate is made on
/// the host: the CPU path of [`crate::ops::conv_nhwc::conv2d_nhwc_grad_input_join`].
pub fn join_masked(a: &Tensor, b: &Tensor, mask: &Tensor) -> Result<Tensor> {
    crate::add_relu_grad(a, b, &gate_from_mask(mask, a)?)
}

/// [`batch_norm_train_with`], with y's ReLU mask when `mask` (a block output: `res` given).
fn train_with(
    x: &Tensor,
    res: Option<&Tensor>,
    moments: Option<&Tensor>,
    bn: &TrainBn,
    relu: bool,
    mask: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    if let Some(r) = res {
        if r.dims() != x.dims() {
            candle_core::bail!("batch_norm_train: residual {:?} and x {:?} differ", r.dims(), x.dims());
        }
    }
    let (rows, c) = rows_c(x.dims())?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && rows >= 2 {
        let addrs = running_addrs(&bn.running, c)?;
        // x, weight, bias, then the moments and the residual where given.
        let ts: Vec<&Tensor> =
            [Some(x), Some(&bn.weight), Some(&bn.bias), moments, res].into_iter().flatten().collect();
        let out = with_cuda(&ts, "batch_norm_train", |a| {
            let m = moments.map(|_| a[3]);
            let r = res.map(|_| a[3 + usize::from(moments.is_some())]);
            crate::cuda::bn::train((a[0], r, m), a[1], a[2], rows, c, bn.eps, relu, Some(addrs), mask)
        })?;
        if let Some((stats, y, m)) = out {
            let m = m.map(|m| from_cuda(m, (rows, c / 8)));
            return Ok((from_cuda(stats, (3, c)), from_cuda(y, x.shape().clone()), m));
        }
    }
    let _ = (rows, c);
    let stats = match moments {
        Some(m) => batch_stats_from_partials(m, rows, c, bn.eps, &bn.running)?,
        None => batch_stats(x, bn.eps, &bn.running)?,
    };
    let y = match res {
        Some(r) => crate::ops::residual::bn_add_relu(x, r, &bn.params(&stats), None)?,
        None => x.apply_op3_no_bwd(&bn.weight, &bn.bias, &BnApply { relu, stats: stats.clone() })?,
    };
    let m = host_mask(&y, mask && res.is_some())?;
    Ok((stats, y, m))
}

/// y's ReLU mask where asked for and the kernels did not write it: made on the host off CUDA (None on CUDA, whose
/// fallback path keeps gating by y; and where c is not a multiple of 8).
fn host_mask(y: &Tensor, want: bool) -> Result<Option<Tensor>> {
    let c = y.dims().last().copied().unwrap_or(0);
    if !want || y.device().is_cuda() || c % 8 != 0 {
        return Ok(None);
    }
    relu_mask(y).map(Some)
}

/// Whether the explicit step runs the ImageNet stem's BatchNorm + ReLU + max-pool forward as
/// [`batch_norm_train_relu_max_pool`] (one launch on CUDA): [`crate::KernelPolicy::stem_pool_fused`]'s default, on
/// unless `KERNELS_STEM_POOL_FUSED=0` in the environment (scripts/gpu-step.sh's `fused-nostempool`).
pub fn stem_pool_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KERNELS_STEM_POOL_FUSED").is_none_or(|v| v != "0"))
}

/// Whether the explicit step runs the stem pool's backward inside the stem BatchNorm's backward as
/// [`batch_norm_train_relu_max_pool_backward`] (one launch on CUDA): [`crate::KernelPolicy::stem_pool_bwd_fused`]'s
/// default, off unless `KERNELS_STEM_POOL_BWD_FUSED=1` in the environment (scripts/gpu-step.sh's
/// `fused-stempoolbwd`): timed slower than the two launches it replaces.
pub fn stem_pool_bwd_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KERNELS_STEM_POOL_BWD_FUSED").is_some_and(|v| v == "1"))
}

/// Whether the explicit step's block outputs keep their ReLU mask ([`crate::KernelPolicy::join_relu_mask`]'s
/// default): on unless `KERNELS_JOIN_MASK=0` in the environment (scripts/gpu-step.sh's `fused-nomask`). The
/// ResNet-152 step ran 1.6% faster with it on an H100 (2026-12-06, alternating A/B), for 0.28 GiB more peak memory.
pub fn join_relu_mask() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KERNELS_JOIN_MASK").is_none_or(|v| v != "0"))
}

/// Whether the explicit step keeps stride-2 downsamples' grad-inputs on their own grid
/// ([`crate::KernelPolicy::compact_shortcut_grad`]'s default): on unless `KERNELS_COMPACT_SHORTCUT=0` in the
/// environment (scripts/gpu-step.sh's `fused-nocompact`). The ResNet-152 step ran 0.4% faster with it on an H100
/// (2026-12-06, alternating A/B).
pub fn compact_shortcut_grad() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KERNELS_COMPACT_SHORTCUT").is_none_or(|v| v != "0"))
}

/// `KERNELS_JOIN_IN_CONV` in the environment: `Some(false)` for 0, `Some(true)` for 1, `None` when unset or
/// anything else (the config decides).
pub fn join_in_conv_env() -> Option<bool> {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("KERNELS_JOIN_IN_CONV").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    })
}

/// Whether the explicit step folds the block-output joins into the conv1 grad-inputs
/// ([`crate::KernelPolicy::join_in_conv`]'s default): on unless `KERNELS_JOIN_IN_CONV=0` is in the environment
/// (the default since 2026-12-07: ResNet-152 1.8% faster in bf16 and 2.2% in fp16 on an H100).
pub fn join_in_conv() -> bool {
    join_in_conv_env().unwrap_or(true)
}

/// Whether a joining conv1 grad-input also takes the sums of the BatchNorm before
/// ([`crate::KernelPolicy::join_sums_in_conv`]'s default): on unless `KERNELS_JOIN_SUMS=0` is in the environment.
pub fn join_sums_in_conv() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KERNELS_JOIN_SUMS").is_none_or(|v| v != "0"))
}

/// Where the explicit step normalises a bottleneck's conv3 input ([`crate::KernelPolicy::bn_apply_in_conv`]'s
/// default): `KERNELS_BN_APPLY_IN_CONV=backward` in the grad-weight, `both` (or 1) in the conv and its
/// grad-weight; off otherwise (scripts/gpu-step.sh's `fused-bnin`, `fused-bninbwd`).
pub fn bn_apply_in_conv() -> crate::BnApplyInConv {
    static ON: std::sync::OnceLock<crate::BnApplyInConv> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("KERNELS_BN_APPLY_IN_CONV").as_deref() {
        Ok("backward") => crate::BnApplyInConv::Backward,
        Ok("both" | "1") => crate::BnApplyInConv::Both,
        _ => crate::BnApplyInConv::Off,
    })
}

/// The batch statistics of x (.., c) for a training-mode BatchNorm `bn` whose normalisation runs elsewhere (inside
/// the next convolution: [`crate::conv2d_nhwc_forward_bn_relu`]), with its running statistics updated:
/// [`batch_norm_train_with`]'s statistics without its y. On CUDA, where the 8-channel kernels apply, one
/// cooperative launch (`bn_nhwc_train_v8_*` with y null: the moments and the finaliser only); elsewhere
/// [`batch_stats`] (or [`batch_stats_from_partials`] of `moments`). The same values bit for bit.
pub fn batch_norm_train_stats(x: &Tensor, moments: Option<&Tensor>, bn: &TrainBn) -> Result<Tensor> {
    let (rows, c) = rows_c(x.dims())?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && rows >= 2 {
        let addrs = running_addrs(&bn.running, c)?;
        let ts: Vec<&Tensor> = [Some(x), Some(&bn.weight), Some(&bn.bias), moments].into_iter().flatten().collect();
        let out = with_cuda(&ts, "batch_norm_train_stats", |a| {
            let m = moments.map(|_| a[3]);
            crate::cuda::bn::train_stats((a[0], m), a[1], a[2], rows, c, bn.eps, Some(addrs))
        })?;
        if let Some(stats) = out {
            return Ok(from_cuda(stats, (3, c)));
        }
    }
    let _ = (rows, c);
    match moments {
        Some(m) => batch_stats_from_partials(m, rows, c, bn.eps, &bn.running),
        None => batch_stats(x, bn.eps, &bn.running),
    }
}

/// The ImageNet stem after its convolution: training-mode BatchNorm of x (n, h, w, c) with its batch statistics
/// (running statistics updated), ReLU, and the max-pool `pool` with its windows' argmax offsets: (stats (3, c),
/// y (n, oh, ow, c), offsets (n, oh, ow, c) u8), what [`batch_norm_train_with`] (relu) followed by
/// [`MaxPool2dNhwc`] and [`MaxPool2dNhwcOffsets`] on its output give, bit for bit. On CUDA, for the stem's pool
/// (kernel 3, stride 2, padding 1) where the 8-channel kernels apply, in one cooperative launch
/// (`bn_nhwc_train_pool_v8_*`) that never writes relu(bn(x)) at full resolution; elsewhere those three ops.
/// With `moments` as [`batch_norm_train_with`].
pub fn batch_norm_train_relu_max_pool(
    x: &Tensor,
    moments: Option<&Tensor>,
    bn: &TrainBn,
    pool: MaxPool2d,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, h, w, c) = pool.check_nhwc(x.dims())?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && x.is_contiguous()
        && n * h * w >= 2
        && (pool.kernel, pool.stride, pool.padding) == (3, 2, 1)
    {
        let addrs = running_addrs(&bn.running, c)?;
        let ts: Vec<&Tensor> = [Some(x), Some(&bn.weight), Some(&bn.bias), moments].into_iter().flatten().collect();
        let out = with_cuda(&ts, "batch_norm_train_relu_max_pool", |a| {
            let m = moments.map(|_| a[3]);
            crate::cuda::bn::train_pool((a[0], m), (a[1], a[2]), (n, h, w, c), bn.eps, Some(addrs))
        })?;
        if let Some((stats, y, off)) = out {
            let out = pool.out_shape_nhwc((n, h, w, c));
            return Ok((from_cuda(stats, (3, c)), from_cuda(y, out), from_cuda(off, out)));
        }
    }
    let _ = (n, h, w, c);
    let (stats, a) = batch_norm_train_with(x, None, moments, bn, true)?;
    let y = a.apply_op1_no_bwd(&MaxPool2dNhwc(pool))?;
    let off = a.apply_op1_no_bwd(&MaxPool2dNhwcOffsets(pool))?;
    Ok((stats, y, off))
}

impl TrainBn<'_> {
    /// The normalisation's parameters with the batch statistics `stats`.
    fn params(&self, stats: &Tensor) -> crate::ops::residual::BnParams {
        crate::ops::residual::BnParams { stats: stats.clone(), weight: self.weight.clone(), bias: self.bias.clone() }
    }
}

/// A downsample block's output: the batch statistics of its last conv output `x` and of the downsample conv
/// output `r` (each BatchNorm's running statistics updated), and y = relu(bn(x) + bn_r(r)): (stats, stats_r, y).
/// On CUDA, where the 8-channel kernels apply, in one cooperative launch (`bn_nhwc_train2_v8_*`) instead of five;
/// elsewhere two [`batch_stats`] and [`crate::ops::residual::bn_add_relu`]. The same values bit for bit.
/// With `moments` (both convolutions' epilogue partials, x's then r's) without the moments pass, as
/// [`batch_norm_train_with`]. With `mask` also y's ReLU mask, as [`batch_norm_train_add_relu_masked`] gives it
/// (None where it does not: the 4th output).
pub fn batch_norm_train2_add_relu(
    x: &Tensor,
    r: &Tensor,
    bn: &TrainBn,
    bn_r: &TrainBn,
    moments: Option<(&Tensor, &Tensor)>,
    mask: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    if r.dims() != x.dims() {
        candle_core::bail!("batch_norm_train2_add_relu: x {:?} and the shortcut {:?} differ", x.dims(), r.dims());
    }
    let (rows, c) = rows_c(x.dims())?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && rows >= 2 {
        let (ra, rb) = (running_addrs(&bn.running, c)?, running_addrs(&bn_r.running, c)?);
        let mut ts = vec![x, r, &bn.weight, &bn.bias, &bn_r.weight, &bn_r.bias];
        ts.extend(moments.iter().flat_map(|(m, mr)| [*m, *mr]));
        let out = with_cuda(&ts, "batch_norm_train2_add_relu", |a| {
            let one = crate::cuda::bn::TrainBn { weight: a[2], bias: a[3], eps: bn.eps, running: Some(ra) };
            let two = crate::cuda::bn::TrainBn { weight: a[4], bias: a[5], eps: bn_r.eps, running: Some(rb) };
            let m = moments.map(|_| (a[6], a[7]));
            crate::cuda::bn::train2((a[0], a[1]), one, two, m, rows, c, mask)
        })?;
        if let Some((s1, s2, y, m)) = out {
            let m = m.map(|m| from_cuda(m, (rows, c / 8)));
            return Ok((from_cuda(s1, (3, c)), from_cuda(s2, (3, c)), from_cuda(y, x.shape().clone()), m));
        }
    }
    let _ = (rows, c);
    let (s1, s2) = match moments {
        Some((m, mr)) => (
            batch_stats_from_partials(m, rows, c, bn.eps, &bn.running)?,
            batch_stats_from_partials(mr, rows, c, bn_r.eps, &bn_r.running)?,
        ),
        None => (batch_stats(x, bn.eps, &bn.running)?, batch_stats(r, bn_r.eps, &bn_r.running)?),
    };
    let y = crate::ops::residual::bn_add_relu(x, r, &bn.params(&s1), Some(&bn_r.params(&s2)))?;
    let m = host_mask(&y, mask)?;
    Ok((s1, s2, y, m))
}

/// The backward of a training-mode BatchNorm (+ ReLU when `grad.relu`) over (x, dy) from `grad`'s statistics,
/// weight and bias (`grad.sums` None): (sums (2, c) f32 = [dbias, dweight], dx in x's dtype). On CUDA, where the
/// 8-channel kernels apply, in one cooperative launch (`bn_nhwc_train_bwd_v8_*`) instead of three, with the same
/// results bit for bit; elsewhere [`BnGrad`] without, then with, the sums.
pub fn batch_norm_train_backward(x: &Tensor, dy: &Tensor, grad: &BnGrad) -> Result<(Tensor, Tensor)> {
    train_backward_with(x, dy, grad, None)
}

/// [`batch_norm_train_backward`] with the backward sums' partials that the grad-input's epilogue wrote for dy
/// (`part`, [`crate::conv2d_nhwc_grad_input_sums`]'s [`crate::BwdSums::Partials`]): on CUDA, where the 8-channel
/// kernels apply, one cooperative launch that reduces them and makes dx (`bn_nhwc_train_bwd_v8_*` with
/// `have_sums`) instead of two; elsewhere [`grad_sums_from_partials`] then [`BnGrad`] with the sums. The same
/// values bit for bit either way. CUDA only, as the partials are.
pub fn batch_norm_train_backward_from_partials(
    x: &Tensor,
    dy: &Tensor,
    grad: &BnGrad,
    part: &Tensor,
) -> Result<(Tensor, Tensor)> {
    train_backward_with(x, dy, grad, Some(part))
}

fn train_backward_with(x: &Tensor, dy: &Tensor, grad: &BnGrad, part: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    if grad.sums.is_some() {
        candle_core::bail!("batch_norm_train_backward: computes the sums itself (BnGrad::sums must be None)");
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dims() == dy.dims() {
        let (rows, c) = rows_c(x.dims())?;
        let args = crate::cuda::bn::GradArgs {
            relu: grad.relu,
            stats: &grad.stats,
            weight: &grad.weight,
            bias: &grad.bias,
            sums: None,
        };
        let ts: Vec<&Tensor> = [x, dy].into_iter().chain(part).collect();
        let out = with_cuda(&ts, "batch_norm_train_backward", |a| {
            crate::cuda::bn::train_backward(a[0], a[1], &args, a.get(2).copied(), rows, c)
        })?;
        if let Some((sums, dx)) = out {
            return Ok((from_cuda(sums, (2, c)), from_cuda(dx, x.shape().clone())));
        }
    }
    let sums = match part {
        Some(part) => {
            let (rows, c) = rows_c(x.dims())?;
            grad_sums_from_partials(part, rows, c)?
        }
        None => x.apply_op2_no_bwd(dy, grad)?,
    };
    let dx = x.apply_op2_no_bwd(dy, &BnGrad { sums: Some(sums.clone()), ..grad.clone() })?;
    Ok((sums, dx))
}

/// The backward of [`batch_norm_train_relu_max_pool`] for the gradient g1 (+ g2: the ResNet stem's gradient is the
/// first block's main path plus its shortcut) of its pooled output: the max-pool's backward from the offsets
/// `off`, then the BatchNorm + ReLU backward over x (`grad`: relu, the forward's statistics, sums None):
/// (sums (2, c) f32 = [dbias, dweight], dx like x), bit for bit [`max_pool2d_nhwc_backward_offsets_sum`] (or the
/// one-gradient backward) followed by [`batch_norm_train_backward`]. On CUDA, for the stem's pool (kernel 3,
/// stride 2, padding 1) where the 8-channel kernels apply, in one cooperative launch
/// (`bn_nhwc_train_bwd_pool_v8_*`) that gathers each cell's gradient from the pooled ones as it needs it, so the
/// full-resolution gradient is never written; elsewhere those ops.
///
/// [`max_pool2d_nhwc_backward_offsets_sum`]: crate::ops::maxpool::max_pool2d_nhwc_backward_offsets_sum
pub fn batch_norm_train_relu_max_pool_backward(
    x: &Tensor,
    off: &Tensor,
    (g1, g2): (&Tensor, Option<&Tensor>),
    grad: &BnGrad,
    pool: MaxPool2d,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "batch_norm_train_relu_max_pool_backward";
    if grad.sums.is_some() || !grad.relu {
        candle_core::bail!("{OP}: the BatchNorm + ReLU backward from its statistics (BnGrad relu, sums None)");
    }
    let (n, h, w, c) = pool.check_nhwc(x.dims())?;
    let out = pool.out_shape_nhwc((n, h, w, c));
    for (t, what) in [(off, "offsets"), (g1, "grad")].into_iter().chain(g2.map(|g| (g, "second grad"))) {
        if t.dims() != [out.0, out.1, out.2, out.3] {
            let dims = t.dims();
            return Err(candle_core::Error::Msg(format!(
                "{OP}: {what} of shape {dims:?}, expected the pooled {out:?}"
            )));
        }
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.is_contiguous() && (pool.kernel, pool.stride, pool.padding) == (3, 2, 1) {
        let args = crate::cuda::bn::GradArgs {
            relu: true,
            stats: &grad.stats,
            weight: &grad.weight,
            bias: &grad.bias,
            sums: None,
        };
        let (off, g1) = (off.contiguous()?, super::aligned(g1)?);
        let g2 = g2.map(super::aligned).transpose()?;
        let ts: Vec<&Tensor> = [Some(x), Some(&off), Some(&g1), g2.as_ref()].into_iter().flatten().collect();
        let res = with_cuda(&ts, OP, |a| {
            crate::cuda::bn::train_backward_pool((a[0], a[1], a[2], a.get(3).copied()), &args, (n, h, w, c))
        })?;
        if let Some((sums, dx)) = res {
            return Ok((from_cuda(sums, (2, c)), from_cuda(dx, x.shape().clone())));
        }
    }
    let bwd = super::maxpool::MaxPool2dNhwcBackwardOffsets { pool, in_hw: (h, w) };
    let g = match g2 {
        Some(g2) => super::maxpool::max_pool2d_nhwc_backward_offsets_sum(off, g1, g2, bwd)?,
        None => off.apply_op2_no_bwd(g1, &bwd)?,
    };
    batch_norm_train_backward(x, &g, grad)
}

/// A residual block's output gradient joined with its last BatchNorm's whole backward: g = `a` (+ `b`) where the
/// block's ReLU output `y` is positive ([`join_grad_sums`]'s g), then that BatchNorm's (`p`, over its input `z`, no
/// ReLU of its own) sums (2, c) and grad-input: (g, sums, dz). On CUDA, where the 8-channel kernels apply, in one
/// cooperative launch (`bn_nhwc_train_join_bwd_*`) instead of four (the ReLU gradient, the sums, their finaliser,
/// dz); elsewhere [`join_grad_sums`] then [`BnGrad`] with the sums. The same values bit for bit. The ReLU's
/// gate is the block output or its mask ([`ReluGate`]): the same g either way.
pub fn join_grad_backward(
    a: &Tensor,
    b: Option<ShortcutGrad>,
    gate: ReluGate,
    z: &Tensor,
    p: &crate::ops::residual::BnParams,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (gt, is_mask) = match gate {
        ReluGate::Output(y) => (y, false),
        ReluGate::Mask(m) => (m, true),
    };
    MASKED_JOINS.with(|n| n.set(n.get() + u64::from(is_mask)));
    let (bt, strided) = match b {
        Some(ShortcutGrad::Full(t)) => (Some(t), false),
        Some(ShortcutGrad::Stride2(t)) => (Some(t), true),
        None => (None, false),
    };
    STRIDED_JOINS.with(|n| n.set(n.get() + u64::from(strided)));
    #[cfg(feature = "cuda")]
    if a.device().is_cuda()
        && [Some(a), Some(z)].iter().flatten().all(|t| t.dims() == a.dims() && t.is_contiguous())
        && (is_mask || gt.dims() == a.dims())
        && gt.is_contiguous()
        && bt.is_none_or(|t| t.is_contiguous() && (strided || t.dims() == a.dims()))
    {
        let (rows, c) = rows_c(a.dims())?;
        let hw = if strided { Some(stride2_fits(a, bt.expect("a strided b"))?) } else { None };
        let args =
            crate::cuda::bn::GradArgs { relu: false, stats: &p.stats, weight: &p.weight, bias: &p.bias, sums: None };
        let ts: Vec<&Tensor> = [Some(a), Some(gt), Some(z), bt].into_iter().flatten().collect();
        let out = with_cuda(&ts, "join_grad_backward", |t| {
            let gate = if is_mask { crate::cuda::bn::Gate::Mask(t[1]) } else { crate::cuda::bn::Gate::Output(t[1]) };
            let b = t.get(3).map(|&g| match hw {
                Some((h, w)) => crate::cuda::bn::ShortcutArg::Stride2 { g, h, w },
                None => crate::cuda::bn::ShortcutArg::Full(g),
            });
            crate::cuda::bn::train_join_backward((t[0], b, gate, t[2]), &args, rows, c)
        })?;
        if let Some((g, sums, dz)) = out {
            let shape = a.shape().clone();
            return Ok((from_cuda(g, shape.clone()), from_cuda(sums, (2, c)), from_cuda(dz, shape)));
        }
    }
    let _ = bt;
    let expanded;
    let y = if is_mask {
        expanded = gate_from_mask(gt, a)?;
        &expanded
    } else {
        gt
    };
    let full = match b {
        Some(b) => Some(b.full(a)?),
        None => None,
    };
    let (g, sums) = join_grad_sums(a, full.as_ref(), y, z, p)?;
    let op = BnGrad {
        relu: false,
        stats: p.stats.clone(),
        weight: p.weight.clone(),
        bias: p.bias.clone(),
        sums: Some(sums.clone()),
    };
    let dz = z.apply_op2_no_bwd(&g, &op)?;
    Ok((g, sums, dz))
}

/// The gradient of a block output's shortcut that [`join_grad_backward`] adds: like the output, or the grad-input
/// of a 1x1 stride-2 downsample on that conv's own grid (n, ceil(h / 2), ceil(w / 2), c) for an output of (n, h, w,
/// c): the full-size grad-input is zero off the even (y, x) cells, so the cooperative join reads only these
/// (`bn_nhwc_train_join_bwd_2s_v8`) and neither the full-size tensor nor its memset is made.
#[derive(Clone, Copy, Debug)]
pub enum ShortcutGrad<'a> {
    Full(&'a Tensor),
    Stride2(&'a Tensor),
}

impl ShortcutGrad<'_> {
    /// The gradient at the full size of `like` (the block output's gradient): the strided one spread over the even
    /// cells with +0 elsewhere ([`expand_stride2`]).
    pub fn full(&self, like: &Tensor) -> Result<Tensor> {
        match *self {
            Self::Full(t) => Ok(t.clone()),
            Self::Stride2(t) => {
                let (h, w) = stride2_fits(like, t)?;
                expand_stride2(t, h, w)
            }
        }
    }
}

/// (h, w) of `like` (n, h, w, c) when `g` is (n, ceil(h / 2), ceil(w / 2), c), else an error naming both.
fn stride2_fits(like: &Tensor, g: &Tensor) -> Result<(usize, usize)> {
    let (n, h, w, c) = like.dims4()?;
    if g.dims() != [n, h.div_ceil(2), w.div_ceil(2), c] || g.dtype() != like.dtype() {
        candle_core::bail!("a stride-2 shortcut gradient {:?} does not fit an output {:?}", g.dims(), like.dims());
    }
    Ok((h, w))
}

/// A stride-2 grid's values g (n, ceil(h / 2), ceil(w / 2), c) spread over (n, h, w, c): g at the even (y, x)
/// cells, +0 elsewhere, what a 1x1 stride-2 conv's grad-input holds. Composed of candle ops (any device).
pub fn expand_stride2(g: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    let (n, oh, ow, c) = g.dims4()?;
    if oh != h.div_ceil(2) || ow != w.div_ceil(2) {
        candle_core::bail!("expand_stride2: {:?} is not the stride-2 grid of {h} x {w}", g.dims());
    }
    let cols = g.unsqueeze(3)?.pad_with_zeros(3, 0, 1)?.reshape((n, oh, 2 * ow, c))?;
    let rows = cols.unsqueeze(2)?.pad_with_zeros(2, 0, 1)?.reshape((n, 2 * oh, 2 * ow, c))?;
    rows.narrow(1, 0, h)?.narrow(2, 0, w)?.contiguous()
}

thread_local! {
    /// [`join_grad_backward`] calls given a stride-2 shortcut gradient so far on this thread (tests check it ran).
    static STRIDED_JOINS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// [`join_grad_backward`] calls gated by a ReLU mask so far on this thread (tests check the mask path ran).
    static MASKED_JOINS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many [`join_grad_backward`] calls this thread has made with [`ShortcutGrad::Stride2`].
pub fn strided_joins() -> u64 {
    STRIDED_JOINS.with(std::cell::Cell::get)
}

/// How many [`join_grad_backward`] calls this thread has made with [`ReluGate::Mask`].
pub fn masked_joins() -> u64 {
    MASKED_JOINS.with(std::cell::Cell::get)
}

/// What gates a block output's gradient (its ReLU's backward): the output y itself, whose positive elements pass
/// it, or y's ReLU mask ([`relu_mask`]'s layout, which [`batch_norm_train_add_relu_masked`] and
/// [`batch_norm_train2_add_relu`] return), read instead of y by the cooperative join (1/16 of y's bytes in bf16).
#[derive(Clone, Copy, Debug)]
pub enum ReluGate<'a> {
    Output(&'a Tensor),
    Mask(&'a Tensor),
}

/// The gradient at a residual block's output and its last BatchNorm's backward sums, as one pass where it can:
/// g = `a` (+ `b`) where the block's ReLU output `y` is positive (what [`crate::relu_grad`] /
/// [`crate::add_relu_grad`] give) and the sums (2, c) = [sum g, sum g * xhat] of the BatchNorm `p` that made the
/// block's last pre-activation `z` (what [`BnGrad`] without sums gives). On CUDA, where the 8-channel path
/// applies, one kernel reads g's inputs once and the sums come out bit for bit as the separate pass gives them
/// (`bn_nhwc_join_sum_*`); elsewhere the two ops run. Returns (g, sums).
pub fn join_grad_sums(
    a: &Tensor,
    b: Option<&Tensor>,
    y: &Tensor,
    z: &Tensor,
    p: &crate::BnParams,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if a.device().is_cuda() && joinable(a, b, y, z, p) {
        let (_, c) = rows_c(z.dims())?;
        let sums = crate::cuda::empty_f32(a, 2 * c)?.reshape((2, c))?;
        let addr = crate::cuda::addr_of::<f32>(&sums, 2 * c, "backward sums")?;
        let op = JoinGradSums {
            two: b.is_some(),
            z: z.clone(),
            stats: p.stats.clone(),
            weight: p.weight.clone(),
            bias: p.bias.clone(),
            sums: addr,
        };
        let g = a.apply_op3_no_bwd(b.unwrap_or(a), y, &op)?;
        return Ok((g, sums));
    }
    let g = match b {
        Some(b) => crate::add_relu_grad(a, b, y)?,
        None => crate::relu_grad(a, y)?,
    };
    let op = BnGrad { relu: false, stats: p.stats.clone(), weight: p.weight.clone(), bias: p.bias.clone(), sums: None };
    let sums = z.apply_op2_no_bwd(&g, &op)?;
    Ok((g, sums))
}

/// Whether [`join_grad_sums`] runs as one kernel: one shape and dtype (f32, bf16, f16), contiguous, and the
/// 8-channel path's channel count and alignment.
#[cfg(feature = "cuda")]
fn joinable(a: &Tensor, b: Option<&Tensor>, y: &Tensor, z: &Tensor, p: &crate::BnParams) -> bool {
    let elems: Vec<&Tensor> = [Some(a), b, Some(y), Some(z)].into_iter().flatten().collect();
    let Some(&c) = z.dims().last() else { return false };
    let same = elems.iter().all(|t| t.dims() == z.dims() && t.dtype() == z.dtype() && t.is_contiguous());
    let chans = [&p.stats, &p.weight, &p.bias];
    let f32s = chans.iter().all(|t| t.dtype() == DType::F32 && t.is_contiguous());
    let layouts: Vec<&Layout> = elems.iter().map(|t| t.layout()).collect();
    let chan_layouts: Vec<&Layout> = chans.iter().map(|t| t.layout()).collect();
    same && f32s
        && matches!(z.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && p.stats.elem_count() == 3 * c
        && crate::cuda::bn::v8_applies(c, &layouts, &chan_layouts)
}

/// [`join_grad_sums`] as a candle op over (a, b, y) (b = a and `two` false for the one-operand gradient).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
struct JoinGradSums {
    two: bool,
    z: Tensor,
    stats: Tensor,
    weight: Tensor,
    bias: Tensor,
    /// Device address of the (2, c) FP32 sums the op writes.
    sums: u64,
}

#[cfg(feature = "cuda")]
impl CustomOp3 for JoinGradSums {
    fn name(&self) -> &'static str {
        "batch_norm_nhwc_join_grad_sums"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("{}: CUDA only (join_grad_sums runs the two ops elsewhere)", self.name())
    }

    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = rows_c(l1.dims())?;
        let args = crate::cuda::bn::GradArgs {
            relu: false,
            stats: &self.stats,
            weight: &self.weight,
            bias: &self.bias,
            sums: None,
        };
        let b = self.two.then_some((s2, l2));
        let g = crate::cuda::bn::join_sums(((s1, l1), b, (s3, l3)), &self.z, &args, rows, c, self.sums)?;
        Ok((g, l1.shape().clone()))
    }
}

/// The backward sums (2, c) of a BatchNorm from the partials a grad-input's epilogue wrote
/// ([`crate::conv2d_nhwc_grad_input_sums`], [`crate::conv2d_nhwc_grad_input_join_sums`]; on the CPU the partials of
/// [`grad_sums_partials`]): the (2, chunks, c) partials, chunks of 128 rows, summed over the chunks.
pub fn grad_sums_from_partials(part: &Tensor, rows: usize, c: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if part.device().is_cuda() {
        return part.apply_op1_no_bwd(&SumsFromPartials { rows, c });
    }
    let chunks = rows.div_ceil(PARTIAL_ROWS);
    if part.elem_count() != 2 * chunks * c {
        candle_core::bail!("grad_sums_from_partials: {} partials for {rows} rows x {c}", part.elem_count());
    }
    part.reshape((2, chunks, c))?.sum(1)
}

/// Rows per chunk of the BatchNorm partials, on the CPU and in the CUDA kernels' epilogues (their 128-row tiles:
/// `cuda::tma::STATS_ROWS`).
pub const PARTIAL_ROWS: usize = 128;

/// The partials of the backward sums of a BatchNorm without ReLU (sum g and sum g xhat per channel, xhat =
/// (z - mean) invstd with `stats` (3, c) = [mean, var, invstd]) over chunks of 128 rows of z and g (rows, c), in
/// the layout the joined grad-input's epilogue writes on CUDA ((2, chunks, c) f32, flat): the CPU's
/// [`crate::conv2d_nhwc_grad_input_join_sums`], so that the step takes the same path on either device.
pub fn grad_sums_partials(z: &Tensor, g: &Tensor, stats: &Tensor) -> Result<Tensor> {
    let c = z.dims().last().copied().unwrap_or(1).max(1);
    let rows = z.elem_count() / c;
    if g.dims() != z.dims() || stats.elem_count() != 3 * c {
        candle_core::bail!("grad_sums_partials: z {:?}, g {:?}, statistics {:?}", z.dims(), g.dims(), stats.dims());
    }
    let chunks = rows.div_ceil(PARTIAL_ROWS);
    let stats = stats.to_dtype(DType::F32)?.reshape((3, c))?;
    let (mean, invstd) = (stats.get(0)?, stats.get(2)?);
    let g = g.to_dtype(DType::F32)?.reshape((rows, c))?;
    let xhat = z.to_dtype(DType::F32)?.reshape((rows, c))?.broadcast_sub(&mean)?.broadcast_mul(&invstd)?;
    let gx = (&g * xhat)?;
    let pad = chunks * PARTIAL_ROWS - rows;
    let per_chunk =
        |t: Tensor| -> Result<Tensor> { t.pad_with_zeros(0, 0, pad)?.reshape((chunks, PARTIAL_ROWS, c))?.sum(1) };
    Tensor::stack(&[per_chunk(g)?, per_chunk(gx)?], 0)?.flatten_all()
}

/// [`grad_sums_from_partials`] as a candle op over the partials.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy)]
struct SumsFromPartials {
    rows: usize,
    c: usize,
}

#[cfg(feature = "cuda")]
impl CustomOp1 for SumsFromPartials {
    fn name(&self) -> &'static str {
        "batch_norm_nhwc_sums_from_partials"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("{}: CUDA only", self.name())
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::bn::sums_from_partials(s, l, self.rows, self.c)?, Shape::from((2, self.c))))
    }
}

/// [`batch_stats`] of a (rows, c) convolution output from the moments its epilogue wrote
/// ([`crate::conv2d_nhwc_forward_stats`]), with `running` updated in the same launch (CUDA only).
pub fn batch_stats_from_partials(part: &Tensor, rows: usize, c: usize, eps: f64, running: &Running) -> Result<Tensor> {
    if rows < 2 {
        candle_core::bail!("BatchNorm2d in training mode needs more than one value per channel, got {rows} rows");
    }
    #[cfg(feature = "cuda")]
    if part.device().is_cuda() {
        let addrs = running_addrs(running, c)?;
        return part.apply_op1_no_bwd(&BnStatsFromPartials { rows, c, eps, running: Some(addrs) });
    }
    let _ = (part, eps, running);
    candle_core::bail!("batch_stats_from_partials: the epilogue statistics exist on CUDA only ({rows} x {c})")
}

/// [`batch_stats_from_partials`] with no running statistics to update: the same launch, for timing it
/// ([`crate::cuda::autotune::epilogue_pays`]).
#[cfg(feature = "cuda")]
pub(crate) fn batch_stats_from_partials_unrecorded(part: &Tensor, rows: usize, c: usize, eps: f64) -> Result<Tensor> {
    part.apply_op1_no_bwd(&BnStatsFromPartials { rows, c, eps, running: None })
}

/// [`batch_stats_from_partials`] as a candle op over the partials.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy)]
struct BnStatsFromPartials {
    rows: usize,
    c: usize,
    eps: f64,
    running: Option<crate::cuda::bn::RunningAddrs>,
}

#[cfg(feature = "cuda")]
impl CustomOp1 for BnStatsFromPartials {
    fn name(&self) -> &'static str {
        "batch_norm_nhwc_stats_from_partials"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("{}: CUDA only", self.name())
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let st = crate::cuda::bn::stats_from_partials(s, l, self.rows, self.c, self.eps, self.running)?;
        Ok((st, Shape::from((3, self.c))))
    }
}

/// [`BnStats`] whose launch also updates the running statistics at `running` in place (CUDA only).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy)]
struct BnStatsRunning {
    eps: f64,
    running: crate::cuda::bn::RunningAddrs,
}

#[cfg(feature = "cuda")]
impl CustomOp1 for BnStatsRunning {
    fn name(&self) -> &'static str {
        "batch_norm_nhwc_stats_running"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("{}: CUDA only (batch_stats runs BnStats + update_running on the CPU)", self.name())
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = rows_c(l.dims())?;
        Ok((crate::cuda::bn::stats(s, l, rows, c, self.eps, Some(self.running))?, Shape::from((3, c))))
    }
}

/// y = BatchNorm(x) with the statistics `stats` ((3, c) from [`BnStats`]), then ReLU when `relu`; arguments
/// (x, weight, bias). Its backward runs [`BnGrad`] twice (sums, then dx).
#[derive(Debug, Clone)]
pub struct BnApply {
    pub relu: bool,
    pub stats: Tensor,
}

impl CustomOp3 for BnApply {
    fn name(&self) -> &'static str {
        "batch_norm_nhwc"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, c) = rows_c(l1.dims())?;
        let stats = host_f32(&self.stats, op)?;
        let (CpuStorage::F32(w), CpuStorage::F32(b)) = (s2, s3) else {
            candle_core::bail!("{op}: weight and bias must be f32");
        };
        let (w, b) = (contiguous(w, l2, op, "weight")?, contiguous(b, l3, op, "bias")?);
        if w.len() != c || b.len() != c || stats.len() != 3 * c {
            candle_core::bail!("{op}: per-channel tensors do not have {c} channels");
        }
        let out = cpu_float!(op, s1, [F32, BF16, F16], |v, wrap| {
            wrap(apply_t(contiguous(v, l1, op, "x")?, &stats, w, b, self.relu))
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = rows_c(l1.dims())?;
        let y = crate::cuda::bn::apply(s1, l1, s2, l2, s3, l3, &self.stats, rows, c, self.relu)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let x = x.contiguous()?;
        let grad = BnGrad {
            relu: self.relu,
            stats: self.stats.clone(),
            weight: weight.detach(),
            bias: bias.detach(),
            sums: None,
        };
        let sums = x.apply_op2_no_bwd(&dy, &grad)?;
        let dx = x.apply_op2_no_bwd(&dy, &BnGrad { sums: Some(sums.clone()), ..grad })?;
        Ok((Some(dx), Some(sums.get(1)?), Some(sums.get(0)?)))
    }
}

fn check_same(l1: &Layout, l2: &Layout, op: &str) -> Result<(usize, usize)> {
    if l1.dims() != l2.dims() {
        candle_core::bail!("{op}: x and dy shapes differ: {:?} {:?}", l1.dims(), l2.dims());
    }
    rows_c(l1.dims())
}

/// The backward passes of [`BnApply`] on (x, dy), from the forward's statistics, weight and bias (the ReLU mask
/// is recomputed from x: y is not read). Without `sums`: the per-channel gradient sums (2, c) f32 = [dbias =
/// sum g, dweight = sum g * xhat]; with `sums` (that output): dx in x's dtype.
#[derive(Debug, Clone)]
pub struct BnGrad {
    pub relu: bool,
    pub stats: Tensor,
    pub weight: Tensor,
    pub bias: Tensor,
    pub sums: Option<Tensor>,
}

impl BnGrad {
    fn run_cpu<T: WithDType>(&self, x: &[T], dy: &[T], c: usize) -> Result<(Vec<f32>, Option<Vec<T>>)> {
        let op = self.name();
        let (stats, w, b) = (host_f32(&self.stats, op)?, host_f32(&self.weight, op)?, host_f32(&self.bias, op)?);
        if stats.len() != 3 * c || w.len() != c || b.len() != c {
            candle_core::bail!("{op}: per-channel tensors do not have {c} channels");
        }
        let p = Params { stats: &stats, w: &w, b: &b, relu: self.relu };
        Ok(match &self.sums {
            None => (grad_sums_t(x, dy, &p), None),
            Some(s) => {
                let sums = host_f32(s, op)?;
                if sums.len() != 2 * c {
                    candle_core::bail!("{op}: sums do not have 2 x {c} values");
                }
                (Vec::new(), Some(grad_input_t(x, dy, &p, &sums)))
            }
        })
    }
}

impl CustomOp2 for BnGrad {
    fn name(&self) -> &'static str {
        if self.sums.is_none() {
            "batch_norm_nhwc_grad_sums"
        } else {
            "batch_norm_nhwc_grad_input"
        }
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, c) = check_same(l1, l2, op)?;
        let (sums, dx) = cpu_float2!(op, (s1, s2), [F32, BF16, F16], |x, g, wrap| {
            let (s, dx) = self.run_cpu(contiguous(x, l1, op, "x")?, contiguous(g, l2, op, "dy")?, c)?;
            (s, dx.map(wrap))
        });
        Ok(match dx {
            Some(dx) => (dx, l1.shape().clone()),
            None => (CpuStorage::F32(sums), Shape::from((2, c))),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = check_same(l1, l2, self.name())?;
        let args = crate::cuda::bn::GradArgs {
            relu: self.relu,
            stats: &self.stats,
            weight: &self.weight,
            bias: &self.bias,
            sums: self.sums.as_ref(),
        };
        let out = crate::cuda::bn::grad((s1, l1), (s2, l2), &args, rows, c)?;
        Ok((out, if self.sums.is_some() { l1.shape().clone() } else { Shape::from((2, c)) }))
    }
}
