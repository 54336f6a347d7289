//! Channels-last (NHWC) convolution: implicit-GEMM tensor-core kernels on CUDA for BF16/FP16 (forward,
//! grad-input and grad-weight, launchers in [`crate::cuda::conv`]), candle's convolution through permutes
//! elsewhere (CPU, FP32): that path is also the reference the kernels are tested against.
//!
//! Layouts: activations x (n, h, w, c), weights (k, r, s, c) ("KRSC": output channel, kernel row, kernel column,
//! input channel), outputs (n, p, q, k). The model keeps its FP32 master weights in torchvision's (k, c, r, s)
//! order and permutes the low-precision copy it makes each step.

use super::conv::conv2d;
#[cfg(feature = "cuda")]
use super::conv::{conv2d_grad_input, Conv2dParams};
#[cfg(feature = "cuda")]
use crate::geom::ConvGeom;
use crate::policy::{ConvImpl, KernelPolicy};
use candle_core::{DType, Result, Tensor};

fn check_nhwc(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<()> {
    let (_, h, wd, c) = x.dims4()?;
    let (_, r, s, wc) = w.dims4()?;
    if wc != c || r != s {
        candle_core::bail!(
            "conv2d_nhwc: weight {:?} does not match input {:?} (expected (k, r, r, {c}))",
            w.dims(),
            x.dims()
        );
    }
    if stride == 0 || h + 2 * padding < r || wd + 2 * padding < s {
        candle_core::bail!(
            "conv2d_nhwc: input {:?} too small for a {r}x{s} kernel (stride {stride}, padding {padding})",
            x.dims()
        );
    }
    if x.dtype() != w.dtype() {
        candle_core::bail!("conv2d_nhwc: input is {:?} but weight is {:?}", x.dtype(), w.dtype());
    }
    Ok(())
}

/// Whether our kernels run this input (CUDA, BF16/FP16).
pub fn kernels_apply(x: &Tensor) -> bool {
    x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16)
}

/// Convolution over channels-last tensors with backward. x: (n, h, w, c), w: (k, r, r, c) -> (n, p, q, k).
/// Our kernels on CUDA in BF16/FP16 (tiles as `policy.tuning` picks), the reference elsewhere.
pub fn conv2d_nhwc(x: &Tensor, w: &Tensor, stride: usize, padding: usize, policy: &KernelPolicy) -> Result<Tensor> {
    check_nhwc(x, w, stride, padding)?;
    #[cfg(feature = "cuda")]
    if kernels_apply(x) {
        return cuda_ops::conv2d_nhwc(x, w, stride, padding, policy);
    }
    let _ = policy;
    conv2d_nhwc_reference(x, w, stride, padding)
}

/// The same convolution through candle's NCHW conv2d and permutes (differentiable): the CPU path and the
/// reference the CUDA kernels are tested against.
pub fn conv2d_nhwc_reference(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    let xn = x.permute((0, 3, 1, 2))?.contiguous()?;
    let wn = w.permute((0, 3, 1, 2))?.contiguous()?;
    conv2d(&xn, &wn, stride, padding, ConvImpl::FwdConv)?.permute((0, 2, 3, 1))?.contiguous()
}

/// Forward pass without an autograd graph (the explicit training step): our kernels on CUDA in BF16/FP16, the
/// reference elsewhere. x: (n, h, w, c), w: (k, r, r, c) -> (n, p, q, k).
pub fn conv2d_nhwc_forward(x: &Tensor, w: &Tensor, stride: usize, pad: usize, policy: &KernelPolicy) -> Result<Tensor> {
    check_nhwc(x, w, stride, pad)?;
    #[cfg(feature = "cuda")]
    if kernels_apply(x) {
        return cuda_ops::conv_nhwc_fwd(x, w, stride, pad, policy);
    }
    let _ = policy;
    conv2d_nhwc_reference(&x.detach(), &w.detach(), stride, pad)
}

/// [`conv2d_nhwc_forward`] and, on CUDA when the convolution runs on a TMA tile, the moments of its output for the
/// BatchNorm that follows, computed in the convolution's epilogue instead of by a pass over the output
/// ([`crate::ops::batchnorm::batch_stats_from_partials`] turns them into the statistics); None elsewhere (the
/// caller computes the statistics from the output).
pub fn conv2d_nhwc_forward_stats(
    x: &Tensor,
    w: &Tensor,
    stride: usize,
    pad: usize,
    policy: &KernelPolicy,
) -> Result<(Tensor, Option<Tensor>)> {
    check_nhwc(x, w, stride, pad)?;
    #[cfg(feature = "cuda")]
    if kernels_apply(x) {
        return cuda_ops::conv_nhwc_fwd_stats(x, w, stride, pad, policy);
    }
    Ok((conv2d_nhwc_forward(x, w, stride, pad, policy)?, None))
}

/// Grad-input of [`conv2d_nhwc_forward`]: dy (n, p, q, k), w (k, r, r, c) -> dx (n, h, w, c) for an input of
/// `in_hw`. Our kernels on CUDA in BF16/FP16; elsewhere candle's forward convolutions
/// ([`super::conv::conv2d_grad_input`]) through permutes.
pub fn conv2d_nhwc_grad_input(
    dy: &Tensor,
    w: &Tensor,
    stride: usize,
    pad: usize,
    in_hw: (usize, usize),
    policy: &KernelPolicy,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if kernels_apply(dy) {
        return cuda_ops::conv_nhwc_dgrad(dy, w, stride, pad, in_hw, policy);
    }
    let _ = policy;
    let dyn_ = dy.detach().permute((0, 3, 1, 2))?.contiguous()?;
    let wn = w.detach().permute((0, 3, 1, 2))?.contiguous()?;
    let p = super::conv::Conv2dParams { stride, padding: pad };
    super::conv::conv2d_grad_input(&dyn_, &wn, p, in_hw)?.permute((0, 2, 3, 1))?.contiguous()
}

/// [`conv2d_nhwc_grad_input`] where dx is the gradient at the output of a training-mode BatchNorm `p` + ReLU over
/// `z` (same shape as dx), with that BatchNorm's backward sums (2, c) = [sum g, sum g * xhat] (g: dx masked by the
/// ReLU, as [`crate::ops::batchnorm::BnGrad`] with `relu` computes them): on CUDA from the grad-input's epilogue
/// when it runs on a TMA tile (plain or stride-1 passes), else by the sums pass over (z, dx).
pub fn conv2d_nhwc_grad_input_sums(
    dy: &Tensor,
    w: &Tensor,
    geom: (usize, usize, (usize, usize)),
    policy: &KernelPolicy,
    z: &Tensor,
    p: &crate::BnParams,
) -> Result<(Tensor, Tensor)> {
    let (dx, sums) = conv2d_nhwc_grad_input_bwd_sums(dy, w, geom, policy, z, p)?;
    let sums = match sums {
        BwdSums::Sums(sums) => sums,
        BwdSums::Partials(part) => {
            let (rows, c) = (dx.elem_count() / z.dim(3)?, z.dim(3)?);
            crate::ops::batchnorm::grad_sums_from_partials(&part, rows, c)?
        }
    };
    Ok((dx, sums))
}

/// A BatchNorm's backward sums as [`conv2d_nhwc_grad_input_bwd_sums`] leaves them.
#[derive(Debug, Clone)]
pub enum BwdSums {
    /// The sums (2, c) = [sum g, sum g * xhat] (the sums pass's).
    Sums(Tensor),
    /// The partials the grad-input's epilogue wrote (CUDA; [`crate::cuda::tma::grad_sums_partials_len`] floats,
    /// 128-row chunks), which [`crate::ops::batchnorm::batch_norm_train_backward_from_partials`] reduces in the
    /// same launch as dx, or [`crate::ops::batchnorm::grad_sums_from_partials`] on its own.
    Partials(Tensor),
}

/// [`conv2d_nhwc_grad_input_sums`] with the epilogue's sums left as its partials ([`BwdSums::Partials`]), so that
/// the BatchNorm backward reduces them in its own launch; the sums pass's sums where the epilogue did not run.
pub fn conv2d_nhwc_grad_input_bwd_sums(
    dy: &Tensor,
    w: &Tensor,
    (stride, pad, in_hw): (usize, usize, (usize, usize)),
    policy: &KernelPolicy,
    z: &Tensor,
    p: &crate::BnParams,
) -> Result<(Tensor, BwdSums)> {
    #[cfg(feature = "cuda")]
    if kernels_apply(dy) {
        let (dx, part) = cuda_ops::conv_nhwc_dgrad_partials(dy, w, stride, pad, in_hw, policy, z, p)?;
        if let Some(part) = part {
            return Ok((dx, BwdSums::Partials(part)));
        }
        let sums = sums_pass(z, &dx, p)?;
        return Ok((dx, BwdSums::Sums(sums)));
    }
    let dx = conv2d_nhwc_grad_input(dy, w, stride, pad, in_hw, policy)?;
    let sums = sums_pass(z, &dx, p)?;
    Ok((dx, BwdSums::Sums(sums)))
}

/// [`conv2d_nhwc_grad_input`] of a 1x1 stride-1 convolution whose input is a residual block's output y = relu(s),
/// joined with that block's shortcut gradient `b` (dx's shape) under y's ReLU `mask` (u8 (rows, c / 8),
/// [`crate::ops::batchnorm::relu_mask`]'s layout): g = the gradient at s, mask ? dx + b : 0 per element (dx rounded
/// to its dtype first, the sum in FP32 rounded once: the block-output join's values bit for bit). Returns (g, true)
/// when it joined: on CUDA in the grad-input's epilogue on a TMA tile (`gemm_nn_join_*`), on the CPU as a pass
/// after the grad-input; (dx, false) on CUDA where that epilogue does not run (FP32, no TMA tile, channels not a
/// multiple of 32, a misaligned operand, or so few tiles that the plain pass could split K and sum in another
/// order), so that the caller joins as before, without a host synchronisation.
pub fn conv2d_nhwc_grad_input_join(
    dy: &Tensor,
    w: &Tensor,
    in_hw: (usize, usize),
    policy: &KernelPolicy,
    b: &Tensor,
    mask: &Tensor,
) -> Result<(Tensor, bool)> {
    let (g, joined, _) = conv2d_nhwc_grad_input_join_sums(dy, w, in_hw, policy, b, mask, None)?;
    Ok((g, joined))
}

/// [`conv2d_nhwc_grad_input_join`], and with `bn3` = (z3, p) the backward sums of the BatchNorm `p` over z3 (dx's
/// shape) whose output gradient the joined g is (the block before's last BatchNorm: no ReLU of its own, so
/// sum g and sum g xhat over every element), taken from the joined values in the same launch where it runs on a
/// TMA tile (`gemm_nn_joinsw_*`, z3 and the statistics aligned), and on the CPU after the join's pass
/// ([`crate::ops::batchnorm::grad_sums_partials`]): (g, true, Some(partials)), the partials (2, chunks of 128 rows,
/// c) f32 (reduced by [`crate::ops::batchnorm::grad_sums_from_partials`] or the cooperative backward). Otherwise
/// no partials: the caller's BatchNorm backward takes its own sums.
pub fn conv2d_nhwc_grad_input_join_sums(
    dy: &Tensor,
    w: &Tensor,
    in_hw: (usize, usize),
    policy: &KernelPolicy,
    b: &Tensor,
    mask: &Tensor,
    bn3: Option<(&Tensor, &crate::BnParams)>,
) -> Result<(Tensor, bool, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    let out = if kernels_apply(dy) {
        Some(cuda_ops::conv_nhwc_dgrad_join(dy, w, in_hw, policy, b, mask, bn3)?)
    } else {
        None
    };
    #[cfg(not(feature = "cuda"))]
    let out = None;
    let out = match out {
        Some(o) => o,
        None => {
            let dx = conv2d_nhwc_grad_input(dy, w, 1, 0, in_hw, policy)?;
            // The pass's gate is made on the host: on the CPU only (a GPU would synchronise, and a captured graph
            // break); elsewhere the caller's join runs.
            if dy.device().is_cpu() {
                let g = crate::ops::batchnorm::join_masked(&dx, b, mask)?;
                let part = match bn3 {
                    Some((z3, p)) => Some(crate::ops::batchnorm::grad_sums_partials(z3, &g, &p.stats)?),
                    None => None,
                };
                (g, true, part)
            } else {
                (dx, false, None)
            }
        }
    };
    JOINED_GRAD_INPUTS.with(|k| k.set(k.get() + u64::from(out.1)));
    JOIN_SUMS.with(|k| k.set(k.get() + u64::from(out.2.is_some())));
    Ok(out)
}

/// Joined grad-inputs of this thread that also took the sums of the BatchNorm before
/// ([`conv2d_nhwc_grad_input_join_sums`] returning partials): tests check that the fold happened.
pub fn join_sums_launches() -> u64 {
    JOIN_SUMS.with(|k| k.get())
}

/// The BatchNorm + ReLU backward sums over (z, g) as their own pass.
fn sums_pass(z: &Tensor, g: &Tensor, p: &crate::BnParams) -> Result<Tensor> {
    let op = crate::ops::batchnorm::BnGrad {
        relu: true,
        stats: p.stats.clone(),
        weight: p.weight.clone(),
        bias: p.bias.clone(),
        sums: None,
    };
    z.apply_op2_no_bwd(g, &op)
}

/// Grad-inputs of this thread that joined ([`conv2d_nhwc_grad_input_join`] returning true: on CUDA the epilogue
/// ran): tests check that the fold happened.
pub fn joined_grad_inputs() -> u64 {
    JOINED_GRAD_INPUTS.with(|k| k.get())
}

thread_local! {
    static JOINED_GRAD_INPUTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static JOIN_SUMS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Launches of this thread whose activation operand was normalised inside the convolution
    /// ([`conv2d_nhwc_forward_bn_relu`], [`conv2d_nhwc_grad_weight_bn_relu`] on a TMA tile): tests check that the
    /// fused path ran.
    static BN_RELU_IN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many convolution passes this thread has run with the BatchNorm + ReLU of their input inside the kernel.
pub fn bn_relu_in_launches() -> u64 {
    BN_RELU_IN.with(std::cell::Cell::get)
}

/// relu(bn(z)) with the training-mode BatchNorm `p`, as the explicit step's separate pass computes it.
fn bn_relu(z: &Tensor, p: &crate::BnParams) -> Result<Tensor> {
    let op = crate::ops::batchnorm::BnApply { relu: true, stats: p.stats.clone() };
    z.apply_op3_no_bwd(&p.weight, &p.bias, &op)
}

/// [`conv2d_nhwc_forward`] of x = relu(bn(z)) (`p`: a training-mode BatchNorm over z's channels): on CUDA, for a
/// 1x1 stride-1 convolution on a wgmma device in BF16/FP16, the TMA GEMM normalises z in shared memory on its
/// way to the tensor cores, so x is never written nor read (`KernelPolicy::bn_apply_in_conv`); elsewhere x is
/// made by the BatchNorm pass first. The same result bit for bit either way.
pub fn conv2d_nhwc_forward_bn_relu(
    z: &Tensor,
    p: &crate::BnParams,
    w: &Tensor,
    stride: usize,
    pad: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    Ok(forward_bn_relu(z, p, w, (stride, pad), false, policy)?.0)
}

/// [`conv2d_nhwc_forward_bn_relu`] with the BatchNorm moments of its output, as [`conv2d_nhwc_forward_stats`]
/// gives them: on CUDA from the epilogue of the normalising GEMM (`gemm_nt_bnin_stats_*`, always where that GEMM
/// runs, also under `policy.bn_epilogue_by_timing`) or of the convolution over the materialised input; None
/// elsewhere (the caller's BatchNorm reduces them).
pub fn conv2d_nhwc_forward_bn_relu_stats(
    z: &Tensor,
    p: &crate::BnParams,
    w: &Tensor,
    stride: usize,
    pad: usize,
    policy: &KernelPolicy,
) -> Result<(Tensor, Option<Tensor>)> {
    forward_bn_relu(z, p, w, (stride, pad), true, policy)
}

/// The two above: with `moments`, the moments as [`conv2d_nhwc_forward_stats`] gives them; else None.
fn forward_bn_relu(
    z: &Tensor,
    p: &crate::BnParams,
    w: &Tensor,
    (stride, pad): (usize, usize),
    moments: bool,
    policy: &KernelPolicy,
) -> Result<(Tensor, Option<Tensor>)> {
    check_nhwc(z, w, stride, pad)?;
    #[cfg(feature = "cuda")]
    if kernels_apply(z) {
        if let Some(out) = cuda_ops::conv_nhwc_bn_relu_in(z, p, w, (stride, pad), None, moments, policy)? {
            BN_RELU_IN.with(|n| n.set(n.get() + 1));
            return Ok(out);
        }
    }
    let x = bn_relu(z, p)?;
    if moments {
        return conv2d_nhwc_forward_stats(&x, w, stride, pad, policy);
    }
    Ok((conv2d_nhwc_forward(&x, w, stride, pad, policy)?, None))
}

/// [`conv2d_nhwc_grad_weight`] of a convolution over x = relu(bn(z)), with x normalised inside the kernel where
/// [`conv2d_nhwc_forward_bn_relu`] does so (the TN GEMM's B operand), else made by the BatchNorm pass first. The
/// same result bit for bit either way.
pub fn conv2d_nhwc_grad_weight_bn_relu(
    dy: &Tensor,
    z: &Tensor,
    p: &crate::BnParams,
    r: usize,
    stride: usize,
    pad: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if kernels_apply(dy) && r == 1 {
        let w_like = (dy.dim(3)?, r);
        if let Some((dw, _)) = cuda_ops::conv_nhwc_bn_relu_in(z, p, dy, (stride, pad), Some(w_like), false, policy)? {
            BN_RELU_IN.with(|n| n.set(n.get() + 1));
            return Ok(dw);
        }
    }
    conv2d_nhwc_grad_weight(dy, &bn_relu(z, p)?, r, stride, pad, policy)
}

/// Grad-weight of [`conv2d_nhwc_forward`]: dy (n, p, q, k), x (n, h, w, c) -> dw (k, r, r, c). Our kernels on
/// CUDA in BF16/FP16; elsewhere candle's forward convolutions ([`super::conv::conv2d_grad_weight`]).
pub fn conv2d_nhwc_grad_weight(
    dy: &Tensor,
    x: &Tensor,
    r: usize,
    stride: usize,
    pad: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if kernels_apply(dy) {
        return cuda_ops::conv_nhwc_wgrad(dy, x, r, stride, pad, policy);
    }
    let _ = policy;
    let dyn_ = dy.detach().permute((0, 3, 1, 2))?.contiguous()?;
    let xn = x.detach().permute((0, 3, 1, 2))?.contiguous()?;
    let p = super::conv::Conv2dParams { stride, padding: pad };
    super::conv::conv2d_grad_weight(&xn, &dyn_, p, r)?.permute((0, 2, 3, 1))?.contiguous()
}

/// Grad-input through candle's NCHW convolutions and permutes: channel counts the vectorised kernels cannot take
/// (the 3-channel stem, whose input needs no gradient in a model).
#[cfg(feature = "cuda")]
fn dgrad_reference(dy: &Tensor, w: &Tensor, g: ConvGeom) -> Result<Tensor> {
    let dyn_ = dy.permute((0, 3, 1, 2))?.contiguous()?;
    let wn = w.permute((0, 3, 1, 2))?.contiguous()?;
    let p = Conv2dParams { stride: g.stride, padding: g.pad };
    conv2d_grad_input(&dyn_, &wn, p, (g.h, g.w))?.permute((0, 2, 3, 1))?.contiguous()
}

#[cfg(feature = "cuda")]
pub use cuda_ops::{
    conv_nhwc_dgrad, conv_nhwc_dgrad_join, conv_nhwc_dgrad_partials, conv_nhwc_dgrad_sums, conv_nhwc_fwd,
    conv_nhwc_fwd_stats, conv_nhwc_wgrad,
};

/// The candle ops over the CUDA launchers.
#[cfg(feature = "cuda")]
mod cuda_ops {
    use super::{dgrad_reference, kernels_apply};
    use crate::cuda::autotune::{epilogue_pays, remembered_epilogue};
    use crate::cuda::conv::{conv_storage, wgrad_transposed, ConvLaunch, StatsOut};
    use crate::cuda::im2col::im2col_applies;
    use crate::cuda::tma::Epi;
    use crate::geom::{ConvGeom, ConvPass};
    use crate::ops::aligned;
    use crate::policy::{KernelPolicy, Tuning};
    use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// One pass of a channels-last convolution as a candle op (no backward of its own; [`ConvNhwc`] has the
    /// backward of the forward pass). Fwd: (x, w) -> y. Dgrad: (dy, w) -> dx. Wgrad: (dy, x) -> dw.
    #[derive(Debug, Clone)]
    struct ConvOp {
        geom: ConvGeom,
        pass: ConvPass,
        /// Grad-weight only: compute dw^T, shape (r, r, c, ko) (see [`wgrad_transposed`]).
        transposed: bool,
        tuning: Tuning,
        im2col_budget: usize,
        /// Forward only: the address of the epilogue statistics' partials and the flag the launch sets when it
        /// wrote them ([`crate::cuda::conv::StatsOut`]).
        stats: Option<(Epi, Arc<AtomicBool>)>,
        /// A 1x1 pass over relu(bn(z)) normalised in the kernel ([`crate::cuda::conv::ConvLaunch::bn_in`]).
        bn_in: Option<crate::cuda::tma::BnAddrs>,
    }

    impl ConvOp {
        fn new(geom: ConvGeom, pass: ConvPass, policy: &KernelPolicy) -> Self {
            Self {
                geom,
                pass,
                transposed: false,
                tuning: policy.tuning.clone(),
                im2col_budget: policy.im2col_budget,
                stats: None,
                bn_in: None,
            }
        }
        fn launch(&self) -> ConvLaunch<'_> {
            ConvLaunch {
                geom: self.geom,
                pass: self.pass,
                transposed: self.transposed,
                tuning: &self.tuning,
                im2col_budget: self.im2col_budget,
                stats: self.stats.as_ref().map(|(epi, wrote)| StatsOut { epi: *epi, wrote }),
                bn_in: self.bn_in,
            }
        }
    }

    impl CustomOp2 for ConvOp {
        fn name(&self) -> &'static str {
            self.launch().op_name()
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("{} runs on CUDA only (the CPU path is conv2d_nhwc_reference)", self.name())
        }
        fn cuda_fwd(
            &self,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            conv_storage(&self.launch(), s1, l1, s2, l2)
        }
    }

    /// The differentiable forward op: (x, w) -> y, backward through the grad-input and grad-weight passes.
    #[derive(Debug, Clone)]
    struct ConvNhwc {
        fwd: ConvOp,
        policy: KernelPolicy,
    }

    impl CustomOp2 for ConvNhwc {
        fn name(&self) -> &'static str {
            "conv2d_nhwc"
        }
        fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
            self.fwd.cpu_fwd(s1, l1, s2, l2)
        }
        fn cuda_fwd(
            &self,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            self.fwd.cuda_fwd(s1, l1, s2, l2)
        }
        fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dy = aligned(&dy.to_dtype(x.dtype())?)?;
            let g = self.fwd.geom;
            let dx = if x.track_op() { Some(dgrad_geom(&dy, w, g, &self.policy)?) } else { None };
            let dw = if w.track_op() { Some(wgrad_geom(&dy, x, g, &self.policy)?) } else { None };
            Ok((dx, dw))
        }
    }

    fn geom_of(x: &Tensor, w: &Tensor, stride: usize, pad: usize) -> Result<ConvGeom> {
        let (n, h, wd, c) = x.dims4()?;
        let (ko, r, _, _) = w.dims4()?;
        Ok(ConvGeom { n, h, w: wd, c, ko, r, stride, pad })
    }

    fn dgrad_geom(dy: &Tensor, w: &Tensor, g: ConvGeom, policy: &KernelPolicy) -> Result<Tensor> {
        if !g.c.is_multiple_of(8) || !g.ko.is_multiple_of(8) {
            return dgrad_reference(dy, w, g);
        }
        dy.apply_op2_no_bwd(&aligned(w)?, &ConvOp::new(g, ConvPass::Dgrad, policy))
    }

    fn wgrad_geom(dy: &Tensor, x: &Tensor, g: ConvGeom, policy: &KernelPolicy) -> Result<Tensor> {
        let transposed = match dy.device() {
            candle_core::Device::Cuda(d) => kernels_apply(dy) && wgrad_transposed(d, &g),
            _ => false,
        };
        let op = ConvOp { transposed, ..ConvOp::new(g, ConvPass::Wgrad, policy) };
        let dw = dy.apply_op2_no_bwd(&aligned(x)?, &op)?;
        if transposed {
            dw.permute((3, 0, 1, 2))?.contiguous() // (r, r, c, ko) -> (ko, r, r, c)
        } else {
            Ok(dw)
        }
    }

    /// Channel counts below this that are not multiples of 8 (the 3-channel stem) are zero-padded up to the next
    /// multiple of 8 so that the vectorised kernels run them: the extra FLOPs cost far less than element-wise
    /// loads.
    const PAD_CHANNELS_BELOW: usize = 64;

    /// Whether `x` (channels-last, convolved to `ko` outputs) takes the explicit im2col path.
    fn im2col_tensor(x: &Tensor, ko: usize) -> bool {
        match (x.device(), x.dim(3)) {
            (candle_core::Device::Cuda(d), Ok(c)) => kernels_apply(x) && im2col_applies(d, c, ko),
            _ => false,
        }
    }

    /// Whether the kernels see `x`'s channels (convolved to `ko` outputs) zero-padded to a multiple of 8: a small
    /// count that is not one already and does not take the im2col path.
    fn pads_channels(x: &Tensor, ko: usize) -> Result<bool> {
        let c = x.dim(3)?;
        Ok(c % 8 != 0 && c < PAD_CHANNELS_BELOW && !im2col_tensor(x, ko))
    }

    /// `x` (n, h, w, c) and `w` (ko, r, s, c) with c zero-padded to a multiple of 8 when c is small and not one
    /// already (same result: the added channels are zero in both); otherwise unchanged.
    fn pad_channels(x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
        let c = x.dim(3)?;
        if !pads_channels(x, w.dim(0)?)? {
            return Ok((x.clone(), w.clone()));
        }
        let extra = c.next_multiple_of(8) - c;
        Ok((x.pad_with_zeros(3, 0, extra)?, w.pad_with_zeros(3, 0, extra)?))
    }

    /// Differentiable channels-last convolution on our kernels. A small channel count that is not a multiple of 8
    /// runs through explicit im2col + the TMA GEMM on a wgmma device (fewer than 8 channels: the RGB stem), else
    /// is zero-padded (autograd narrows the weight gradient back).
    pub(super) fn conv2d_nhwc(
        x: &Tensor,
        w: &Tensor,
        stride: usize,
        pad: usize,
        policy: &KernelPolicy,
    ) -> Result<Tensor> {
        let (x, w) = pad_channels(x, w)?;
        let geom = geom_of(&x, &w, stride, pad)?;
        let x = aligned(&x)?;
        let w = aligned(&w)?;
        x.apply_op2(&w, ConvNhwc { fwd: ConvOp::new(geom, ConvPass::Fwd, policy), policy: policy.clone() })
    }

    /// Forward pass only (benchmarks, tests); pads small channel counts as [`conv2d_nhwc`] does.
    pub fn conv_nhwc_fwd(x: &Tensor, w: &Tensor, stride: usize, pad: usize, policy: &KernelPolicy) -> Result<Tensor> {
        let (x, w) = pad_channels(x, w)?;
        let geom = geom_of(&x, &w, stride, pad)?;
        aligned(&x)?.apply_op2_no_bwd(&aligned(&w)?, &ConvOp::new(geom, ConvPass::Fwd, policy))
    }

    /// The CUDA device of a tensor on one.
    fn cuda_device(t: &Tensor) -> Result<&candle_core::CudaDevice> {
        match t.device() {
            candle_core::Device::Cuda(d) => Ok(d),
            d => candle_core::bail!("conv2d_nhwc (cuda): a tensor on {d:?}"),
        }
    }

    /// [`conv_nhwc_fwd`] with the BatchNorm moments of its output computed in the epilogue, when the pass runs on a
    /// TMA tile: (y, Some(partials)) with the partials of [`crate::cuda::tma::stats_partials_len`] floats for
    /// [`crate::ops::batchnorm::batch_stats_from_partials`]; (y, None) on the other paths, and under
    /// `policy.bn_epilogue_by_timing` where the plain convolution and the moments pass were timed faster for this
    /// shape ([`crate::cuda::autotune::epilogue_pays`]).
    pub fn conv_nhwc_fwd_stats(
        x: &Tensor,
        w: &Tensor,
        stride: usize,
        pad: usize,
        policy: &KernelPolicy,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (x, w) = pad_channels(x, w)?;
        let geom = geom_of(&x, &w, stride, pad)?;
        let (x, w) = (aligned(&x)?, aligned(&w)?);
        let dev = cuda_device(&x)?;
        let key = || format!("moments {geom:?} {:?}", x.dtype());
        let plain = ConvOp::new(geom, ConvPass::Fwd, policy);
        let by_timing = policy.bn_epilogue_by_timing;
        if by_timing && remembered_epilogue(dev, &policy.tuning, key) == Some(false) {
            return Ok((x.apply_op2_no_bwd(&w, &plain)?, None));
        }
        let (rows, c) = (geom.n * geom.p() * geom.q(), geom.ko);
        let (op, part, wrote) = with_moments(plain.clone(), &x, rows, c)?;
        let y = x.apply_op2_no_bwd(&w, &op)?;
        if !wrote.load(Ordering::Relaxed) {
            return Ok((y, None));
        }
        if by_timing {
            // The finalisers, with no running statistics to update, are timed on both sides.
            let stats = crate::ops::batchnorm::BnStats { eps: 1e-5 };
            let pass = || x.apply_op2_no_bwd(&w, &plain)?.apply_op1_no_bwd(&stats).map(drop);
            let epi = || {
                x.apply_op2_no_bwd(&w, &op)?;
                crate::ops::batchnorm::batch_stats_from_partials_unrecorded(&part, rows, c, 1e-5).map(drop)
            };
            if !epilogue_pays(dev, &policy.tuning, key, pass, epi)? {
                return Ok((y, None));
            }
        }
        Ok((y, Some(part)))
    }

    /// `op` (a forward of `rows` x `c` outputs) with the moments of its output asked of the epilogue: the op, the
    /// fresh partials ([`crate::cuda::tma::stats_partials_len`] floats, on `like`'s device) and the flag the launch
    /// sets when it wrote them.
    fn with_moments(op: ConvOp, like: &Tensor, rows: usize, c: usize) -> Result<(ConvOp, Tensor, Arc<AtomicBool>)> {
        let len = crate::cuda::tma::stats_partials_len(rows, c);
        let part = crate::cuda::empty_f32(like, len)?;
        let addr = crate::cuda::addr_of::<f32>(&part, len, "epilogue statistics")?;
        let wrote = Arc::new(AtomicBool::new(false));
        Ok((ConvOp { stats: Some((Epi::Moments { part: addr }, wrote.clone())), ..op }, part, wrote))
    }

    /// A 1x1 stride-1 pass over x = relu(bn(z)) with x normalised inside the TMA GEMM ([`Epi::BnReluIn`]): the
    /// forward (`other` = the weight (ko, 1, 1, c), `wgrad` None) or the grad-weight (`other` = dy (n, h, w, ko),
    /// `wgrad` = Some((ko, r))). None where it does not apply (another geometry or dtype, no wgmma, a transposed
    /// grad-weight, tensors the kernel cannot read in place): the caller materialises x. `moments` (forward only):
    /// also the BatchNorm moments of the output from the epilogue ([`Epi::BnReluInMoments`]), as
    /// [`conv_nhwc_fwd_stats`]'s partials; the second element is None otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv_nhwc_bn_relu_in(
        z: &Tensor,
        p: &crate::BnParams,
        other: &Tensor,
        (stride, pad): (usize, usize),
        wgrad: Option<(usize, usize)>,
        moments: bool,
        policy: &KernelPolicy,
    ) -> Result<Option<(Tensor, Option<Tensor>)>> {
        let dev = cuda_device(z)?;
        let (n, h, wd, c) = z.dims4()?;
        let (ko, r) = match wgrad {
            Some(kr) => kr,
            None => (other.dim(0)?, other.dim(1)?),
        };
        let geom = ConvGeom { n, h, w: wd, c, ko, r, stride, pad };
        let per_channel = [(&p.stats, 3 * c), (&p.weight, c), (&p.bias, c)];
        let fits = geom.is_plain()
            && c.is_multiple_of(8)
            && ko.is_multiple_of(8)
            && matches!(z.dtype(), DType::BF16 | DType::F16)
            && other.dtype() == z.dtype()
            && z.is_contiguous()
            && per_channel
                .iter()
                .all(|(t, len)| t.dtype() == DType::F32 && t.is_contiguous() && t.elem_count() == *len)
            && crate::cuda::loader::has_wgmma(dev)
            && !(wgrad.is_some() && wgrad_transposed(dev, &geom));
        if !fits {
            return Ok(None);
        }
        let f32_addr = |t: &Tensor, n: usize, what: &str| crate::cuda::addr_of::<f32>(t, n, what);
        let bn = crate::cuda::tma::BnAddrs {
            stats: f32_addr(&p.stats, 3 * c, "BatchNorm statistics")?,
            weight: f32_addr(&p.weight, c, "BatchNorm weight")?,
            bias: f32_addr(&p.bias, c, "BatchNorm bias")?,
        };
        // The kernel reads 8 channels' constants as two float4 loads from each tensor.
        if [bn.stats, bn.weight, bn.bias].iter().any(|a| a % 16 != 0) {
            return Ok(None);
        }
        let pass = if wgrad.is_some() { ConvPass::Wgrad } else { ConvPass::Fwd };
        let op = ConvOp { bn_in: Some(bn), ..ConvOp::new(geom, pass, policy) };
        let (z, other) = (aligned(z)?, aligned(other)?);
        if let (true, None) = (moments, wgrad) {
            let (op, part, wrote) = with_moments(op, &z, n * h * wd, ko)?;
            let y = z.apply_op2_no_bwd(&other, &op)?;
            return Ok(Some((y, wrote.load(Ordering::Relaxed).then_some(part))));
        }
        let out = match wgrad {
            Some(_) => other.apply_op2_no_bwd(&z, &op)?,
            None => z.apply_op2_no_bwd(&other, &op)?,
        };
        Ok(Some((out, None)))
    }

    /// Grad-input: dy (n, p, q, ko), w (ko, r, r, c) -> dx (n, h, w, c) for an input of `in_hw`.
    pub fn conv_nhwc_dgrad(
        dy: &Tensor,
        w: &Tensor,
        stride: usize,
        pad: usize,
        in_hw: (usize, usize),
        policy: &KernelPolicy,
    ) -> Result<Tensor> {
        let (n, _, _, ko) = dy.dims4()?;
        let (_, r, _, c) = w.dims4()?;
        let geom = ConvGeom { n, h: in_hw.0, w: in_hw.1, c, ko, r, stride, pad };
        dgrad_geom(&aligned(dy)?, w, geom, policy)
    }

    /// The device address of a contiguous BF16 / FP16 tensor of `len` elements; None for another dtype.
    fn half_addr(t: &Tensor, len: usize, what: &str) -> Result<Option<u64>> {
        Ok(match t.dtype() {
            DType::BF16 => Some(crate::cuda::addr_of::<half::bf16>(t, len, what)?),
            DType::F16 => Some(crate::cuda::addr_of::<half::f16>(t, len, what)?),
            _ => None,
        })
    }

    /// [`conv_nhwc_dgrad`] whose dx is the gradient at the output of BatchNorm `p` + ReLU over `z`, with that
    /// BatchNorm's backward sums computed in the epilogue when the pass runs on a TMA tile (plain or stride 1):
    /// (dx, Some(sums (2, c))); (dx, None) on the other paths.
    /// Under `policy.bn_epilogue_by_timing`, (dx, None) also where the plain grad-input and the sums pass were timed
    /// faster for this shape ([`crate::cuda::autotune::epilogue_pays`]).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_nhwc_dgrad_sums(
        dy: &Tensor,
        w: &Tensor,
        stride: usize,
        pad: usize,
        in_hw: (usize, usize),
        policy: &KernelPolicy,
        z: &Tensor,
        p: &crate::BnParams,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (dx, part) = conv_nhwc_dgrad_partials(dy, w, stride, pad, in_hw, policy, z, p)?;
        let sums = match part {
            Some(part) => {
                let c = w.dim(3)?;
                Some(crate::ops::batchnorm::grad_sums_from_partials(&part, dx.elem_count() / c, c)?)
            }
            None => None,
        };
        Ok((dx, sums))
    }

    /// [`conv_nhwc_dgrad_sums`] with the epilogue's sums left as the partials it wrote
    /// ([`crate::cuda::tma::grad_sums_partials_len`] floats): (dx, Some(partials)) where the epilogue ran.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_nhwc_dgrad_partials(
        dy: &Tensor,
        w: &Tensor,
        stride: usize,
        pad: usize,
        in_hw: (usize, usize),
        policy: &KernelPolicy,
        z: &Tensor,
        p: &crate::BnParams,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (n, _, _, ko) = dy.dims4()?;
        let (_, r, _, c) = w.dims4()?;
        let geom = ConvGeom { n, h: in_hw.0, w: in_hw.1, c, ko, r, stride, pad };
        let rows = n * in_hw.0 * in_hw.1;
        let dev = cuda_device(dy)?;
        let key = || format!("sums {geom:?} {:?}", dy.dtype());
        let by_timing = policy.bn_epilogue_by_timing;
        if by_timing && remembered_epilogue(dev, &policy.tuning, key) == Some(false) {
            return Ok((dgrad_geom(&aligned(dy)?, w, geom, policy)?, None));
        }
        let fits = z.dims() == [n, in_hw.0, in_hw.1, c]
            && z.dtype() == dy.dtype()
            && z.is_contiguous()
            && [&p.stats, &p.weight, &p.bias].iter().all(|t| t.dtype() == DType::F32 && t.is_contiguous())
            && p.stats.elem_count() == 3 * c
            && p.weight.elem_count() == c
            && p.bias.elem_count() == c;
        if !c.is_multiple_of(8) || !ko.is_multiple_of(8) || !fits {
            return Ok((dgrad_geom(&aligned(dy)?, w, geom, policy)?, None));
        }
        let len = crate::cuda::tma::grad_sums_partials_len(rows, c);
        let part = crate::cuda::empty_f32(dy, len)?;
        let f32_addr = |t: &Tensor, n: usize, what: &str| crate::cuda::addr_of::<f32>(t, n, what);
        let Some(za) = half_addr(z, rows * c, "BatchNorm input")? else {
            return Ok((dgrad_geom(&aligned(dy)?, w, geom, policy)?, None));
        };
        let bn = crate::cuda::tma::BnAddrs {
            stats: f32_addr(&p.stats, 3 * c, "BatchNorm statistics")?,
            weight: f32_addr(&p.weight, c, "BatchNorm weight")?,
            bias: f32_addr(&p.bias, c, "BatchNorm bias")?,
        };
        // The epilogue loads z two values at a time and the per-channel tensors two floats at a time.
        if za % 4 != 0 || [bn.stats, bn.weight, bn.bias].iter().any(|a| a % 8 != 0) {
            return Ok((dgrad_geom(&aligned(dy)?, w, geom, policy)?, None));
        }
        let epi = Epi::GradSums { part: f32_addr(&part, len, "backward sums")?, z: za, bn };
        let wrote = Arc::new(AtomicBool::new(false));
        let op = ConvOp { stats: Some((epi, wrote.clone())), ..ConvOp::new(geom, ConvPass::Dgrad, policy) };
        let (dy, w) = (aligned(dy)?, aligned(w)?);
        let dx = dy.apply_op2_no_bwd(&w, &op)?;
        if !wrote.load(Ordering::Relaxed) {
            return Ok((dx, None));
        }
        if by_timing {
            let pass = || super::sums_pass(z, &dgrad_geom(&dy, &w, geom, policy)?, p).map(drop);
            let epi = || {
                dy.apply_op2_no_bwd(&w, &op)?;
                crate::ops::batchnorm::grad_sums_from_partials(&part, rows, c).map(drop)
            };
            if !epilogue_pays(dev, &policy.tuning, key, pass, epi)? {
                return Ok((dx, None));
            }
        }
        Ok((dx, Some(part)))
    }

    /// [`super::conv2d_nhwc_grad_input_join_sums`] on CUDA: a 1x1 stride-1 grad-input with the joined store
    /// ([`Epi::Join`]; with `bn3` and z3 fit for map Z3, [`Epi::JoinSums`] and the partials) where it runs (TMA
    /// tiles, c % 32 == 0, contiguous aligned operands, enough tiles that the plain pass would not split K); else
    /// the plain grad-input and false.
    pub fn conv_nhwc_dgrad_join(
        dy: &Tensor,
        w: &Tensor,
        in_hw: (usize, usize),
        policy: &KernelPolicy,
        b: &Tensor,
        mask: &Tensor,
        bn3: Option<(&Tensor, &crate::BnParams)>,
    ) -> Result<(Tensor, bool, Option<Tensor>)> {
        let (n, _, _, ko) = dy.dims4()?;
        let (_, r, _, c) = w.dims4()?;
        let geom = ConvGeom { n, h: in_hw.0, w: in_hw.1, c, ko, r, stride: 1, pad: 0 };
        let rows = n * in_hw.0 * in_hw.1;
        let plain = || Ok((dgrad_geom(&aligned(dy)?, w, geom, policy)?, false, None));
        let fits = r == 1
            && c.is_multiple_of(32)
            && ko.is_multiple_of(8)
            && b.dims() == [n, in_hw.0, in_hw.1, c]
            && b.dtype() == dy.dtype()
            && b.is_contiguous()
            && mask.dims() == [rows, c / 8]
            && mask.dtype() == DType::U8
            && mask.is_contiguous();
        // Where the plain grad-input could take split-K (fewer than sms / 2 tiles even of 128 x 256: tma_split),
        // its FP32 sums would be added in another order: the join stays a pass there, so that the fold gives the
        // plain TMA pass's values bit for bit (ResNet-152 at batch 256: every conv1 has hundreds of tiles).
        let x256_tiles = rows.div_ceil(128) * c.div_ceil(256);
        if !fits || 2 * x256_tiles < crate::cuda::loader::sm_count(cuda_device(dy)?)? {
            return plain();
        }
        let Some(ba) = half_addr(b, rows * c, "shortcut gradient")? else {
            return plain();
        };
        let ma = crate::cuda::addr_of::<u8>(mask, rows * c / 8, "ReLU mask")?;
        // Map Z reads b as map C writes dx (16-byte rows and base); the store reads the mask 4 bytes at a time.
        if ba % 16 != 0 || ma % 4 != 0 {
            return plain();
        }
        // The sums: z3 read through map Z3 (16-byte base), the statistics a float at a time, the partials 16 bytes.
        let sums = match bn3 {
            Some((z3, p))
                if z3.dims() == b.dims()
                    && z3.dtype() == dy.dtype()
                    && z3.is_contiguous()
                    && p.stats.dtype() == DType::F32
                    && p.stats.is_contiguous()
                    && p.stats.elem_count() == 3 * c =>
            {
                let za = half_addr(z3, rows * c, "BatchNorm input")?;
                let sa = crate::cuda::addr_of::<f32>(&p.stats, 3 * c, "BatchNorm statistics")?;
                za.filter(|za| za % 16 == 0).map(|za| (za, sa))
            }
            _ => None,
        };
        let wrote = Arc::new(AtomicBool::new(false));
        let (epi, part) = match sums {
            Some((z3, stats)) => {
                let len = crate::cuda::tma::grad_sums_partials_len(rows, c);
                let part = crate::cuda::empty_f32(dy, len)?;
                let pa = crate::cuda::addr_of::<f32>(&part, len, "backward sums")?;
                (Epi::JoinSums { mask: ma, b: ba, z3, part: pa, stats }, Some(part))
            }
            None => (Epi::Join { mask: ma, b: ba }, None),
        };
        let op = ConvOp { stats: Some((epi, wrote.clone())), ..ConvOp::new(geom, ConvPass::Dgrad, policy) };
        let (dy, w) = (aligned(dy)?, aligned(w)?);
        let dx = dy.apply_op2_no_bwd(&w, &op)?;
        let joined = wrote.load(Ordering::Relaxed);
        Ok((dx, joined, part.filter(|_| joined)))
    }

    /// Grad-weight: dy (n, p, q, ko), x (n, h, w, c) -> dw (ko, r, r, c); small channel counts take the im2col
    /// path or are padded for the kernel (as in [`conv2d_nhwc`]) and the result narrowed back.
    pub fn conv_nhwc_wgrad(
        dy: &Tensor,
        x: &Tensor,
        r: usize,
        stride: usize,
        pad: usize,
        policy: &KernelPolicy,
    ) -> Result<Tensor> {
        let c0 = x.dim(3)?;
        let x = if pads_channels(x, dy.dim(3)?)? {
            x.pad_with_zeros(3, 0, c0.next_multiple_of(8) - c0)?
        } else {
            x.clone()
        };
        let (n, h, w, c) = x.dims4()?;
        let ko = dy.dim(3)?;
        let geom = ConvGeom { n, h, w, c, ko, r, stride, pad };
        let dw = wgrad_geom(&aligned(dy)?, &x, geom, policy)?;
        if c == c0 {
            Ok(dw)
        } else {
            dw.narrow(3, 0, c0)?.contiguous()
        }
    }
}
