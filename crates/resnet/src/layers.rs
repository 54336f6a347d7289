//! Layers with torchvision's names and initialisation: Conv2d (no bias), BatchNorm2d (train/eval), Linear.

use crate::autocast::{finish, operand};
use crate::store::{Param, ParamKind, ParamStore};
use candle_core::{DType, Result, Tensor, D};
use kernels::KernelPolicy;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Creates named, initialised tensors in a [`ParamStore`]; `pp` descends one name level (`layer1.0.conv1`).
pub struct Builder<'a> {
    store: &'a ParamStore,
    rng: std::rc::Rc<std::cell::RefCell<ChaCha8Rng>>,
    prefix: String,
}

impl<'a> Builder<'a> {
    pub fn new(store: &'a ParamStore, seed: u64) -> Self {
        Self {
            store,
            rng: std::rc::Rc::new(std::cell::RefCell::new(ChaCha8Rng::seed_from_u64(seed))),
            prefix: String::new(),
        }
    }
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Self { store: self.store, rng: self.rng.clone(), prefix }
    }
    fn name(&self, leaf: &str) -> String {
        if self.prefix.is_empty() {
            leaf.to_string()
        } else {
            format!("{}.{leaf}", self.prefix)
        }
    }
    fn host(&self, shape: &[usize], data: Vec<f32>, leaf: &str, kind: ParamKind) -> Result<Param> {
        let t = Tensor::from_vec(data, shape, self.store.device())?;
        self.store.insert(&self.name(leaf), t, kind)
    }
    fn normal(&self, shape: &[usize], std: f32, leaf: &str) -> Result<Param> {
        let n: usize = shape.iter().product();
        let dist = Normal::new(0f32, std).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut rng = self.rng.borrow_mut();
        let data = (0..n).map(|_| dist.sample(&mut *rng)).collect();
        drop(rng);
        self.host(shape, data, leaf, ParamKind::Param)
    }
    fn uniform(&self, shape: &[usize], bound: f32, leaf: &str) -> Result<Param> {
        let n: usize = shape.iter().product();
        let dist = Uniform::new_inclusive(-bound, bound).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut rng = self.rng.borrow_mut();
        let data = (0..n).map(|_| rng.sample(dist)).collect();
        drop(rng);
        self.host(shape, data, leaf, ParamKind::Param)
    }
    fn constant(&self, shape: &[usize], v: f32, leaf: &str, kind: ParamKind) -> Result<Param> {
        let n: usize = shape.iter().product();
        self.host(shape, vec![v; n], leaf, kind)
    }
    fn counter(&self, leaf: &str) -> Result<Param> {
        let t = Tensor::new(0i64, self.store.device())?;
        self.store.insert(&self.name(leaf), t, ParamKind::Buffer)
    }
}

/// Per-forward settings: training mode, the low-precision dtype of convs/matmuls and activations, and the kernel
/// policy, which also fixes the activation layout.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub train: bool,
    pub act: DType,
    pub kernels: KernelPolicy,
}

impl Ctx {
    /// NCHW activations, candle's kernels.
    pub fn new(train: bool, act: DType) -> Self {
        Self { train, act, kernels: KernelPolicy::default() }
    }

    /// Activations are channels-last (n, h, w, c) instead of (n, c, h, w) (the custom convolutions): convs run
    /// [`kernels::conv2d_nhwc`] and BatchNorm normalises over dims (0, 1, 2).
    pub fn channels_last(&self) -> bool {
        self.kernels.channels_last()
    }
}

/// 2D convolution without bias (every ResNet conv feeds a BatchNorm). Weight: (out, in, k, k), FP32 master.
#[derive(Debug, Clone)]
pub struct Conv2d {
    pub weight: Param,
    pub stride: usize,
    pub padding: usize,
}

impl Conv2d {
    /// Kaiming-normal init, mode fan_out, ReLU gain (torchvision's ResNet init).
    pub fn new(b: &Builder, c_in: usize, c_out: usize, k: usize, stride: usize, padding: usize) -> Result<Self> {
        let std = (2.0 / (c_out * k * k) as f32).sqrt();
        Ok(Self { weight: b.normal(&[c_out, c_in, k, k], std, "weight")?, stride, padding })
    }

    // x: [n, c_in, h, w] in ctx.act -> [n, c_out, h', w'] in ctx.act
    // (channels-last: x [n, h, w, c_in] -> [n, h', w', c_out]; the low-precision copy of the (out, in, k, k)
    // master weight is permuted to (out, k, k, in))
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let w = operand(&self.weight.tensor(), ctx.act)?;
        let x = operand(x, ctx.act)?;
        let y = if ctx.channels_last() {
            let w = w.permute((0, 2, 3, 1))?.contiguous()?;
            kernels::conv2d_nhwc(&x, &w, self.stride, self.padding, &ctx.kernels)?
        } else {
            kernels::conv2d(&x, &w, self.stride, self.padding, ctx.kernels.conv)?
        };
        finish(&y, ctx.act)
    }
}

/// BatchNorm2d: batch statistics and running-stat updates in training mode, running statistics in eval mode.
/// Statistics and normalisation are computed in FP32 whatever the activation dtype; the result is returned in
/// the activation dtype. Running variance is updated with the unbiased batch variance, as PyTorch does.
/// Channels-last training with batch statistics on CUDA runs the fused [`kernels::batch_norm_nhwc_train`] op (ReLU
/// fused too through [`BatchNorm2d::forward_relu`]); NCHW, eval mode, frozen statistics and the CPU compose candle
/// ops exactly as the NCHW model does (unless [`KernelPolicy::fused_batchnorm_on_cpu`], a testing aid: with batch-2
/// inputs the 1x1 maps of layer4 have two values per channel, and such BatchNorms amplify any rounding difference
/// far beyond f32 noise, so the composed CPU path keeps the channels-last CPU model bitwise equal to the NCHW one).
#[derive(Debug, Clone)]
pub struct BatchNorm2d {
    pub weight: Param,
    pub bias: Param,
    pub running_mean: Param,
    pub running_var: Param,
    pub num_batches_tracked: Param,
    pub momentum: f64,
    pub eps: f64,
    /// When set, the layer uses its running statistics even in training mode and never updates them.
    pub stats_frozen: Arc<AtomicBool>,
}

impl BatchNorm2d {
    pub fn new(b: &Builder, c: usize, zero_weight: bool) -> Result<Self> {
        Ok(Self {
            weight: b.constant(&[c], if zero_weight { 0.0 } else { 1.0 }, "weight", ParamKind::Param)?,
            bias: b.constant(&[c], 0.0, "bias", ParamKind::Param)?,
            running_mean: b.constant(&[c], 0.0, "running_mean", ParamKind::Buffer)?,
            running_var: b.constant(&[c], 1.0, "running_var", ParamKind::Buffer)?,
            num_batches_tracked: b.counter("num_batches_tracked")?,
            momentum: 0.1,
            eps: 1e-5,
            stats_frozen: Arc::new(AtomicBool::new(false)),
        })
    }

    // x: [n, c, h, w] in ctx.act -> same shape and dtype (channels-last: [n, h, w, c])
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        self.forward_act(x, ctx, false)
    }

    /// `relu(self.forward(x, ctx))`; channels-last training with batch statistics fuses the ReLU into the
    /// BatchNorm kernel.
    pub fn forward_relu(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        self.forward_act(x, ctx, true)
    }

    fn forward_act(&self, x: &Tensor, ctx: &Ctx, relu: bool) -> Result<Tensor> {
        let use_batch = ctx.train && !self.stats_frozen.load(Ordering::Relaxed);
        let fused_here = x.device().is_cuda() || ctx.kernels.fused_batchnorm_on_cpu;
        if ctx.channels_last() && use_batch && fused_here {
            return self.forward_nhwc_train(x, relu);
        }
        let y = self.forward_composed(x, ctx)?;
        if relu {
            y.relu()
        } else {
            Ok(y)
        }
    }

    /// Channels-last training mode: one fused op ([`kernels::batch_norm_nhwc_train`]: FP32 batch statistics,
    /// normalisation and optional ReLU, no FP32 copy of the activation kept for backward).
    fn forward_nhwc_train(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        let (n, h, w, _) = x.dims4()?;
        let count = n * h * w;
        if count < 2 {
            candle_core::bail!(
                "BatchNorm2d in training mode needs more than one value per channel, got input {:?}",
                x.dims()
            );
        }
        let (y, mean, var) =
            kernels::batch_norm_nhwc_train(x, &self.weight.tensor(), &self.bias.tensor(), self.eps, relu)?;
        self.update_running(&mean, &var, count)?;
        Ok(y)
    }

    /// The BatchNorm as a composition of candle ops in FP32 (NCHW, eval mode, frozen statistics, the CPU).
    fn forward_composed(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let out_dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let (n, d1, d2, d3) = x.dims4()?;
        // Channel dim, the dims statistics reduce over, and the broadcast shape of per-channel tensors.
        let (c, reduce, count) =
            if ctx.channels_last() { (d3, [0, 1, 2], n * d1 * d2) } else { (d1, [0, 2, 3], n * d2 * d3) };
        let pshape = if ctx.channels_last() { (1, 1, 1, c) } else { (1, c, 1, 1) };
        let w = self.weight.tensor().reshape(pshape)?;
        let b = self.bias.tensor().reshape(pshape)?;
        let use_batch = ctx.train && !self.stats_frozen.load(Ordering::Relaxed);
        let y = if use_batch {
            if count < 2 {
                candle_core::bail!(
                    "BatchNorm2d in training mode needs more than one value per channel, got input {:?}",
                    x.dims()
                );
            }
            // Per-channel mean and biased variance over (n, h, w).
            let mean = x.mean_keepdim(reduce)?; // per-channel, broadcastable
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(reduce)?;
            let inv = (var.clone() + self.eps)?.sqrt()?.recip()?;
            self.update_running(&mean.detach(), &var.detach(), count)?;
            xc.broadcast_mul(&inv)?.broadcast_mul(&w)?.broadcast_add(&b)?
        } else {
            let mean = self.running_mean.tensor().reshape(pshape)?;
            let var = self.running_var.tensor().reshape(pshape)?;
            let scale = (var + self.eps)?.sqrt()?.recip()?.broadcast_mul(&w)?;
            x.broadcast_sub(&mean)?.broadcast_mul(&scale)?.broadcast_add(&b)?
        };
        y.to_dtype(out_dtype)
    }

    /// The running statistics with their momentum, as the kernels' BatchNorm ops take them.
    pub fn running(&self) -> kernels::ops::batchnorm::Running<'_> {
        kernels::ops::batchnorm::Running {
            mean: self.running_mean.var(),
            var: self.running_var.var(),
            num_batches_tracked: self.num_batches_tracked.var(),
            momentum: self.momentum,
        }
    }

    pub(crate) fn update_running(&self, mean: &Tensor, var: &Tensor, count: usize) -> Result<()> {
        kernels::ops::batchnorm::update_running(&self.running(), mean, var, count)
    }
}

/// Fully connected layer, PyTorch's default init (uniform in ±1/sqrt(fan_in) for weight and bias).
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Param,
    pub bias: Param,
}

impl Linear {
    pub fn new(b: &Builder, c_in: usize, c_out: usize) -> Result<Self> {
        let bound = 1.0 / (c_in as f32).sqrt();
        Ok(Self { weight: b.uniform(&[c_out, c_in], bound, "weight")?, bias: b.uniform(&[c_out], bound, "bias")? })
    }

    // x: [n, c_in] -> [n, c_out] in ctx.act (the loss casts logits to FP32); the same in both layouts
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let w = operand(&self.weight.tensor(), ctx.act)?;
        let x = operand(x, ctx.act)?;
        let b = operand(&self.bias.tensor(), ctx.act)?;
        finish(&kernels::linear(&x, &w, &b, &ctx.kernels)?, ctx.act)
    }
}

/// Global average pool over (h, w) with FP32 accumulation. x: [n, c, h, w] -> [n, c] in x's dtype.
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    let dt = x.dtype();
    x.to_dtype(DType::F32)?.flatten_from(2)?.mean(D::Minus1)?.to_dtype(dt)
}

/// [`global_avg_pool`] in the layout of `ctx`: channels-last x [n, h, w, c] goes through
/// [`kernels::global_avg_pool_nhwc`] (FP32 accumulation, output in x's dtype).
pub fn global_avg_pool_ctx(x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
    if ctx.channels_last() {
        kernels::global_avg_pool_nhwc(x)
    } else {
        global_avg_pool(x)
    }
}

/// 2D max-pool with backward in the layout of `ctx` ([`kernels::max_pool2d`] or [`kernels::max_pool2d_nhwc`]).
pub fn max_pool2d(x: &Tensor, ctx: &Ctx, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    if ctx.channels_last() {
        kernels::max_pool2d_nhwc(x, kernel, stride, padding)
    } else {
        kernels::max_pool2d(x, kernel, stride, padding)
    }
}
