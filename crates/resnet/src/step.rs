//! The explicit training step: forward and backward of a channels-last ResNet written out layer by layer,
//! with no autograd graph. It computes what `cross_entropy(model.forward(x)).backward()` computes (the autograd
//! path stays the oracle: tests/tests/step.rs and the GPU tests compare the two), but
//!
//! - every gradient is written once, by the op that produces it (autograd accumulates each contribution into a
//!   zero-filled buffer with an add);
//! - the element-wise work is fused: BatchNorm + ReLU in one pass, the block output's BatchNorm + residual add
//!   (+ the downsample branch's BatchNorm) + ReLU in one pass ([`kernels::bn_add_relu`]), the ReLU gradient
//!   joined with the shortcut gradient in one pass ([`kernels::add_relu_grad`]), the inner ReLU masks recomputed
//!   inside the BatchNorm backward from the saved pre-activation (no masks, no u8 casts);
//! - the saved activations are exactly the tensors the backward reads, in the activation dtype, each dropped as
//!   soon as the backward has used it.
//!
//! Per bottleneck block, forward: conv1, stats, bn+relu, conv2, stats, bn+relu, conv3, stats, [downsample conv,
//! stats], bn+add(+bn)+relu. Backward: relu-grad (joined with the next block's shortcut gradient), then per conv
//! the BatchNorm backward (sums, dx), grad-weight and grad-input.
//!
//! Kernels: the ops of the `kernels` crate (our convolutions, BatchNorm, pooling and fused residual kernels on
//! CUDA in bf16/fp16, their CPU references elsewhere). Per step, every conv weight is cast to the activation
//! dtype and (k, r, r, c) layout at the start (one launch on CUDA, [`kernels::ops::weights`]); with
//! `kernels.bn_stats = "fused"` (`KernelPolicy::bn_stats_in_conv`) the BatchNorm moments come from the
//! convolutions' epilogues and the backward sums from the kernels that make each BatchNorm's output gradient (the
//! block's ReLU-gradient pass, the next conv's grad-input epilogue); the grad-weights
//! are converted back to FP32 (k, c, r, r) per gradient bucket (one launch per bucket; a single bucket at the end
//! of the step unless data-parallel training asks for buckets, [`StepArgs::buckets`]); the BatchNorm statistics
//! update the running statistics inside their finaliser. Buffers are allocated per op by candle's caching
//! allocator; on CUDA the trainer captures the whole step (this function, the gather, the update) as one CUDA graph
//! and replays it (`kernels.graph`, crates/trainer/src/graphs.rs), where those allocations become the graph's
//! fixed memory.

use crate::layers::{BatchNorm2d, Conv2d, Linear};
use crate::model::{Block, ResNet, Stem};
use crate::Precision;
use candle_core::{DType, Result, Tensor, TensorId};
use kernels::ops::avgpool::{GlobalAvgPoolNhwc, GlobalAvgPoolNhwcBackward};
use kernels::ops::batchnorm::{
    batch_norm_train_relu_max_pool, batch_norm_train_relu_max_pool_backward, BnApply, BnGrad,
};
use kernels::ops::maxpool::{
    max_pool2d_nhwc_backward_offsets_sum, MaxPool2dNhwc, MaxPool2dNhwcBackwardOffsets, MaxPool2dNhwcOffsets,
};
use kernels::{BnParams, KernelPolicy, MaxPool2d};
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// What one explicit step returns.
#[derive(Debug)]
pub struct StepOutput {
    /// Mean softmax cross-entropy (with label smoothing) over the batch: f32 scalar, not scaled.
    pub loss: Tensor,
    /// Logits (n, classes) in the activation dtype.
    pub logits: Tensor,
    /// Gradient of `loss * grad_scale` with respect to every trainable (not frozen) parameter, keyed by the id of
    /// the parameter's tensor (`var.as_tensor().id()`): FP32 in the parameter's shape. Empty when the gradients
    /// went to a [`GradSink`] ([`StepArgs::buckets`]).
    pub grads: HashMap<TensorId, Tensor>,
    /// How many times a bucket was complete but held back because an earlier bucket of the plan was not: 0 when
    /// the plan's order is the backward's ([`ResNet::grad_buckets`]), so each bucket goes out as soon as it is final.
    pub buckets_held: usize,
    /// Bytes of the activations the blocks hold from the forward for the backward (every block's saved tensors,
    /// each counted once): what [`StepArgs::recompute`] reduces.
    pub saved_block_bytes: usize,
}

/// Synchronised BatchNorm (`train.sync_bn`): an in-place sum over the data-parallel ranks of a contiguous f32
/// tensor, called in the same order on every rank (the trainer passes its NCCL communicator). With it, the
/// explicit step normalises with the statistics of the global batch and its BatchNorm backward uses the global
/// gradient sums, so N ranks compute what one process computes on their batches together.
pub trait BnSync {
    fn all_reduce_sum(&self, t: &Tensor) -> Result<()>;
}

/// Receives the step's gradients bucket by bucket, as soon as the backward has made a bucket's gradients final
/// (data-parallel training starts each bucket's all-reduce there, so the communication overlaps the rest of the
/// backward). Buckets come in plan order, each exactly once.
pub trait GradSink {
    /// Bucket `index` of the plan: FP32 gradients of `loss * grad_scale` in the parameters' shapes, in the
    /// order of the plan's ids.
    fn bucket(&mut self, index: usize, grads: Vec<Tensor>) -> Result<()>;
}

/// Activation memory against recomputation in the explicit step: what the forward drops and the backward
/// recomputes. Every level gives the same loss, gradients and running statistics bit for bit (the same kernels
/// run on the same inputs again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every tensor the backward reads.
    #[default]
    None,
    /// Drop the post-ReLU activations inside each block (the inputs of its second and later convs): one
    /// BN+ReLU pass each in the backward, from the saved pre-BatchNorm output and statistics.
    Relu,
    /// Also drop each block's last conv output and its downsample conv output (the widest tensors of a
    /// Bottleneck): the backward runs those convs' forward again. What stays: the inner pre-BatchNorm outputs and
    /// the block outputs.
    ReluConv,
}

/// What one explicit step needs besides the batch.
pub struct StepArgs<'a> {
    /// Label smoothing of the softmax cross-entropy.
    pub label_smoothing: f64,
    /// The gradients are those of `loss * grad_scale` (gradient accumulation; loss scaling known on the host)
    /// times `loss_scale` when given.
    pub grad_scale: f64,
    /// A further factor of the gradients kept on the device (one FP32 element): the dynamic loss scale, which the
    /// host need not know when it queues the step.
    pub loss_scale: Option<Tensor>,
    pub precision: Precision,
    /// Synchronised BatchNorm over the data-parallel ranks (None: per-rank statistics).
    pub sync: Option<&'a dyn BnSync>,
    /// What the forward does not keep for the backward, which recomputes it ([`Recompute`]).
    pub recompute: Recompute,
    /// Gradient buckets and where they go: a partition of the trainable parameters' tensor ids
    /// ([`ResNet::grad_buckets`]) and the sink that takes each bucket as soon as it is final. None: the
    /// gradients come back in [`StepOutput::grads`], all converted at the end of the step.
    pub buckets: Option<(&'a [Vec<TensorId>], &'a mut dyn GradSink)>,
    /// Every conv's weight already in the activation dtype and the kernels' (k, r, r, c) layout, keyed by its
    /// master's tensor id ([`ResNet::conv_weight_masters`]): the weights the optimizer keeps up to date on CUDA
    /// (`kernels::cuda::optim::ConvWeights`). None: the step makes them from the masters (one launch on CUDA).
    pub weights: Option<&'a HashMap<TensorId, Tensor>>,
}

impl StepArgs<'_> {
    /// A plain step: no synchronised BatchNorm, gradients returned.
    pub fn new(label_smoothing: f64, grad_scale: f64, precision: Precision) -> Self {
        Self {
            label_smoothing,
            grad_scale,
            loss_scale: None,
            precision,
            sync: None,
            recompute: Recompute::None,
            buckets: None,
            weights: None,
        }
    }
}

/// Why the explicit step cannot train `model` in `precision`, or None when it can.
pub fn unsupported(model: &ResNet, precision: Precision) -> Option<String> {
    unsupported_for(model.config.channels_last(), model.device().is_cuda(), precision)
}

/// [`unsupported`] for a model that would run channels-last (`channels_last`) on CUDA (`cuda`) or the CPU.
pub fn unsupported_for(channels_last: bool, cuda: bool, precision: Precision) -> Option<String> {
    if !channels_last {
        return Some("it needs the channels-last model (kernels.conv = \"custom\", or \"auto\" on CUDA)".into());
    }
    if !cuda && precision != Precision::F32 {
        return Some(format!("on the CPU it runs fp32 only, not {}", precision.as_str()));
    }
    None
}

/// Whether `bn` normalises with its running statistics in training (`finetune.bn_frozen`).
fn frozen(bn: &BatchNorm2d) -> bool {
    bn.stats_frozen.load(Ordering::Relaxed)
}

/// One convolution's low-precision weight in the kernels' (k, r, r, c) layout, with its geometry.
struct ConvW<'a> {
    conv: &'a Conv2d,
    w: Tensor,
}

impl<'a> ConvW<'a> {
    fn with(conv: &'a Conv2d, w: Tensor) -> Self {
        Self { conv, w }
    }
}

/// A BatchNorm's forward state kept for its backward.
struct BnSaved {
    /// The pre-BatchNorm tensor; None once dropped for recomputation ([`Recompute::ReluConv`]) until the
    /// backward makes it again.
    z: Option<Tensor>,
    stats: Tensor,
    /// Synchronised BatchNorm: the values per channel over all ranks (f32, shape (1)).
    global_rows: Option<Tensor>,
}

impl BnSaved {
    fn z(&self) -> Result<&Tensor> {
        self.z
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("explicit training step: a dropped tensor was read".into()))
    }
}

/// What a block's backward reads.
struct BlockSaved {
    /// Block input (the previous block's output, or the stem's).
    x: Tensor,
    /// Pre-BatchNorm conv outputs with their statistics, one per conv.
    bns: Vec<BnSaved>,
    /// Post-ReLU activations feeding conv 2.. (inputs of the grad-weight passes); empty when the backward
    /// recomputes them ([`StepArgs::recompute`]).
    acts: Vec<Tensor>,
    /// Downsample conv output and statistics.
    down: Option<BnSaved>,
    /// Block output (post-ReLU): the mask of its gradient.
    out: Tensor,
    /// The block output's ReLU mask (1 bit an element), which the cooperative join reads instead of `out`
    /// (`policy.join_relu_mask`, where the forward made it).
    mask: Option<Tensor>,
    /// The convs' low-precision (k, r, r, c) weights made in the forward, reused by the grad-input passes.
    weights: Vec<Tensor>,
    down_weight: Option<Tensor>,
}

/// What a block's backward gives at its input ([`Engine::block_backward`]).
enum BlockGrad {
    /// The main path's gradient and the shortcut's, for the caller to join.
    Split(Tensor, Shortcut),
    /// Already joined by the conv1 grad-input's store: the gradient at the previous block's pre-ReLU output, and
    /// where that store also took them ([`Fold::bn3`]), the partials of the previous block's last BatchNorm sums.
    Joined(Tensor, Option<Tensor>),
}

/// The block before's join folded into a bottleneck's conv1 grad-input ([`Engine::join_fold`]): that block's
/// output ReLU mask, and where the grad-input also takes the backward sums of that block's last BatchNorm
/// (`KernelPolicy::join_sums`), that BatchNorm's saved input z3 and parameters.
struct Fold<'s> {
    mask: &'s Tensor,
    bn3: Option<(&'s Tensor, BnParams)>,
}

/// A block's shortcut gradient at its input: full size, or a 1x1 stride-2 downsample's grad-input on its own grid
/// ([`kernels::ops::batchnorm::ShortcutGrad::Stride2`]: zero off the even cells, never made at full size where the
/// cooperative join takes it).
enum Shortcut {
    Full(Tensor),
    Stride2(Tensor),
}

impl Shortcut {
    fn grad(&self) -> kernels::ops::batchnorm::ShortcutGrad<'_> {
        match self {
            Self::Full(t) => kernels::ops::batchnorm::ShortcutGrad::Full(t),
            Self::Stride2(t) => kernels::ops::batchnorm::ShortcutGrad::Stride2(t),
        }
    }

    /// The gradient at the size of `like` (the main path's gradient at the block input).
    fn full(self, like: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(t) => Ok(t),
            s => s.grad().full(like),
        }
    }
}

/// A conv's input: an activation tensor, or relu(bn(z)) of the conv before it, normalised inside this conv
/// (`policy.bn_apply_in_conv`, [`Engine::bn_in_conv`]: never materialised).
enum ConvIn {
    Act(Tensor),
    BnRelu(Tensor, BnParams),
}

impl ConvIn {
    fn act(t: &Tensor) -> Self {
        Self::Act(t.clone())
    }

    /// The (n, h, w, c) of the input (z's, for a normalised one).
    fn dims4(&self) -> Result<(usize, usize, usize, usize)> {
        match self {
            Self::Act(t) | Self::BnRelu(t, _) => t.dims4(),
        }
    }
}

/// A gradient as the backward makes it.
enum Piece {
    /// FP32 in the parameter's shape.
    Final(Tensor),
    /// A conv grad-weight in the kernels' (k, r, r, c) layout and the activation dtype: converted to FP32
    /// (k, c, r, r) with the rest of its bucket ([`kernels::ops::weights::conv_grads_kcrs`]: one launch per
    /// bucket on CUDA instead of a strided cast per conv).
    Conv(Tensor),
}

/// The step's gradients gathered into buckets and handed on as each fills ([`StepArgs::buckets`]).
struct Buckets<'a> {
    ids: Vec<Vec<TensorId>>,
    /// Bucket and position of each tensor id.
    slot: HashMap<TensorId, (usize, usize)>,
    parts: Vec<Vec<Option<Piece>>>,
    missing: Vec<usize>,
    /// The next bucket to hand on (strictly in plan order, so every rank's collectives come in one order).
    next: usize,
    /// [`StepOutput::buckets_held`].
    held: usize,
    sink: Option<&'a mut dyn GradSink>,
    /// Without a sink: the gradients by tensor id.
    grads: HashMap<TensorId, Tensor>,
}

impl<'a> Buckets<'a> {
    fn new(ids: Vec<Vec<TensorId>>, sink: Option<&'a mut dyn GradSink>) -> Self {
        let mut slot = HashMap::new();
        for (b, bucket) in ids.iter().enumerate() {
            for (i, id) in bucket.iter().enumerate() {
                slot.insert(*id, (b, i));
            }
        }
        let parts = ids.iter().map(|b| b.iter().map(|_| None).collect()).collect();
        let missing = ids.iter().map(Vec::len).collect();
        Self { ids, slot, parts, missing, next: 0, held: 0, sink, grads: HashMap::new() }
    }

    /// Takes the gradient of the parameter with tensor id `id`; hands on every bucket that is now complete.
    fn put(&mut self, id: TensorId, piece: Piece) -> Result<()> {
        let Some(&(b, i)) = self.slot.get(&id) else {
            candle_core::bail!("explicit training step: a gradient outside the bucket plan")
        };
        if self.parts[b][i].replace(piece).is_some() {
            candle_core::bail!("explicit training step: a gradient was made twice");
        }
        self.missing[b] -= 1;
        if self.missing[b] == 0 && b > self.next {
            self.held += 1;
        }
        while self.next < self.ids.len() && self.missing[self.next] == 0 {
            self.flush(self.next)?;
            self.next += 1;
        }
        Ok(())
    }

    fn flush(&mut self, b: usize) -> Result<()> {
        let parts: Vec<Piece> = self.parts[b].iter_mut().map(|p| p.take().expect("a complete bucket")).collect();
        let raw: Vec<Tensor> =
            parts.iter().filter_map(|p| if let Piece::Conv(t) = p { Some(t.clone()) } else { None }).collect();
        let mut converted = kernels::ops::weights::conv_grads_kcrs(&raw)?.into_iter();
        let grads: Vec<Tensor> = parts
            .into_iter()
            .map(|p| match p {
                Piece::Final(t) => t,
                Piece::Conv(_) => converted.next().expect("one conversion per conv gradient"),
            })
            .collect();
        match self.sink.as_mut() {
            Some(sink) => sink.bucket(b, grads),
            None => {
                self.grads.extend(self.ids[b].iter().copied().zip(grads));
                Ok(())
            }
        }
    }

    /// The gradients (empty with a sink) and [`StepOutput::buckets_held`].
    fn finish(self) -> Result<(HashMap<TensorId, Tensor>, usize)> {
        if self.next != self.ids.len() {
            let left: usize = self.missing.iter().sum();
            candle_core::bail!("explicit training step: {left} trainable parameter(s) got no gradient");
        }
        Ok((self.grads, self.held))
    }
}

struct Engine<'a> {
    model: &'a ResNet,
    sync: Option<&'a dyn BnSync>,
    act: DType,
    policy: &'a KernelPolicy,
    buckets: Buckets<'a>,
    /// [`StepArgs::recompute`].
    recompute: Recompute,
    /// Every conv's weight in the activation dtype and (k, r, r, c) layout, keyed by the master's tensor id: the
    /// caller's ([`StepArgs::weights`]) or made once per step ([`kernels::ops::weights::conv_weights_krsc`]: one
    /// launch on CUDA).
    weights: std::borrow::Cow<'a, HashMap<TensorId, Tensor>>,
}

/// A BatchNorm's parameters (detached) and running statistics, as the one-launch ops take them.
fn train_bn(bn: &BatchNorm2d) -> kernels::ops::batchnorm::TrainBn<'_> {
    kernels::ops::batchnorm::TrainBn {
        weight: bn.weight.var().as_tensor().detach(),
        bias: bn.bias.var().as_tensor().detach(),
        eps: bn.eps,
        running: bn.running(),
    }
}

/// What the kernel that made a BatchNorm's output gradient already computed of that BatchNorm's backward.
enum Pre {
    /// Its sums (2, c) = [dbias, dweight] ([`Engine::block_output_grad`] under `bn_sums_in_backward`, or the sums
    /// pass of [`Engine::conv_backward_sums`] where the grad-input's epilogue did not run).
    Sums(Tensor),
    /// The partials of its sums that the grad-input's epilogue wrote ([`Engine::conv_backward_sums`]), reduced by
    /// the BatchNorm backward's own launch.
    Partials(Tensor),
    /// Its sums and its grad-input ([`Engine::block_output_grad`] under `bn_cooperative`: one launch).
    Done { sums: Tensor, dz: Tensor },
}

impl<'a> Engine<'a> {
    fn weight(&self, conv: &'a Conv2d) -> Result<ConvW<'a>> {
        let w =
            self.weights.get(&conv.weight.var().as_tensor().id()).cloned().ok_or_else(|| {
                candle_core::Error::Msg("explicit training step: a conv weight was not converted".into())
            })?;
        Ok(ConvW { conv, w })
    }

    /// Fills [`Self::weights`] for every conv of the model: from `given` ([`StepArgs::weights`], checked to hold
    /// every conv's weight in its shape and the activation dtype), else made from the masters.
    fn convert_weights(&mut self, given: Option<&'a HashMap<TensorId, Tensor>>) -> Result<()> {
        let convs = self.model.convs();
        if let Some(given) = given {
            for c in &convs {
                let master = c.weight.var().as_tensor();
                let (k, ci, r, s) = master.dims4()?;
                match given.get(&master.id()) {
                    Some(w) if w.dims() == [k, r, s, ci] && w.dtype() == self.act => {}
                    Some(w) => candle_core::bail!(
                        "explicit training step: a given conv weight is {:?} {:?}, expected {:?} {:?}",
                        w.dims(),
                        w.dtype(),
                        [k, r, s, ci],
                        self.act
                    ),
                    None => {
                        candle_core::bail!("explicit training step: the given conv weights lack one of the model's")
                    }
                }
            }
            self.weights = std::borrow::Cow::Borrowed(given);
            return Ok(());
        }
        let masters: Vec<Tensor> = convs.iter().map(|c| c.weight.var().as_tensor().detach()).collect();
        let refs: Vec<&Tensor> = masters.iter().collect();
        let converted = kernels::ops::weights::conv_weights_krsc(&refs, self.act)?;
        self.weights =
            std::borrow::Cow::Owned(convs.iter().map(|c| c.weight.var().as_tensor().id()).zip(converted).collect());
        Ok(())
    }

    fn conv(&self, x: &Tensor, cw: &ConvW) -> Result<Tensor> {
        kernels::conv2d_nhwc_forward(x, &cw.w, cw.conv.stride, cw.conv.padding, self.policy)
    }

    /// [`Self::conv`] of a [`ConvIn`]: a normalised input through [`kernels::conv2d_nhwc_forward_bn_relu`].
    fn conv_in(&self, x: &ConvIn, cw: &ConvW) -> Result<Tensor> {
        match x {
            ConvIn::Act(t) => self.conv(t, cw),
            ConvIn::BnRelu(z, p) => {
                kernels::conv2d_nhwc_forward_bn_relu(z, p, &cw.w, cw.conv.stride, cw.conv.padding, self.policy)
            }
        }
    }

    /// Whether the input of conv `i + 1` of block `b`, relu(bn_i(conv_i output)), is normalised inside that conv's
    /// grad-weight instead of kept (`policy.bn_apply_in_conv` not off) or recomputed by a pass
    /// (`Recompute::Relu`: the same values, without writing and reading the activation again; H100, 2026-12-06:
    /// +0.8%): a 1x1 stride-1 unpadded conv (a bottleneck's conv3), where the kernels can read its operand so.
    /// Not under `Recompute::ReluConv`, whose backward runs conv3's forward again: one pass there feeds both it
    /// and the grad-weight, where the normalising forward GEMM would cost more than the pass.
    fn bn_in_conv(&self, b: &Block, i: usize) -> bool {
        let Some(next) = b.convs.get(i + 1) else { return false };
        let k = next.weight.var().as_tensor().dims();
        let on = match self.recompute {
            Recompute::None => self.policy.bn_apply_in_conv != kernels::BnApplyInConv::Off,
            Recompute::Relu => true,
            Recompute::ReluConv => false,
        };
        on && k.len() == 4 && (k[2], k[3], next.stride, next.padding) == (1, 1, 1, 0)
    }

    /// [`Self::bn_in_conv`] in the forward too (`BnApplyInConv::Both`): bn_i's forward is then its statistics
    /// alone, and the activation is never written.
    fn bn_in_conv_forward(&self, b: &Block, i: usize) -> bool {
        self.policy.bn_apply_in_conv == kernels::BnApplyInConv::Both && self.bn_in_conv(b, i)
    }

    /// A conv whose output BatchNorm `bn` normalises next, with that BatchNorm's statistics ([`Self::stats`]).
    /// With `policy.bn_stats_in_conv` (`kernels.bn_stats = "fused"`) the moments come from the conv's epilogue
    /// when it ran on a TMA tile, and one small launch turns them into the statistics and the running update, so
    /// no pass reads the output again for them; frozen or synchronised statistics, and convs on other kernels,
    /// take the pass.
    fn conv_stats(&self, x: &ConvIn, cw: &ConvW, bn: &BatchNorm2d) -> Result<BnSaved> {
        let x = match x {
            ConvIn::Act(t) if self.policy.bn_stats_in_conv && !frozen(bn) && self.sync.is_none() => t,
            _ => {
                let z = self.conv_in(x, cw)?;
                return self.stats(&z, bn);
            }
        };
        let (z, part) = kernels::conv2d_nhwc_forward_stats(x, &cw.w, cw.conv.stride, cw.conv.padding, self.policy)?;
        let Some(part) = part else { return self.stats(&z, bn) };
        let c = z.dim(z.rank() - 1)?;
        let rows = z.elem_count() / c.max(1);
        let stats = kernels::ops::batchnorm::batch_stats_from_partials(&part, rows, c, bn.eps, &bn.running())?;
        Ok(BnSaved { z: Some(z), stats, global_rows: None })
    }

    /// The gradient at the pre-ReLU output of block `b` (saved state `s`) from the gradients `a` (+ `b2`, the
    /// shortcut's) after it, masked by the block's ReLU output; with `policy.bn_sums_in_backward`, while the block's
    /// last pre-activation is kept (not `Recompute::ReluConv`), also its last BatchNorm's backward sums from the
    /// same pass ([`kernels::ops::batchnorm::join_grad_sums`]; bit for bit the sums the BatchNorm backward would
    /// compute), which [`Self::block_backward`] then takes instead of a pass of its own.
    fn block_output_grad(
        &self,
        b: &Block,
        s: &BlockSaved,
        a: &Tensor,
        b2: Option<Shortcut>,
    ) -> Result<(Tensor, Option<Pre>)> {
        if self.cooperative_backward() {
            if let (Some(saved), Some(bn)) = (s.bns.last(), b.bns.last()) {
                if let (Some(z), false) = (&saved.z, frozen(bn)) {
                    // The ReLU gradient and the BatchNorm's whole backward in one launch on CUDA.
                    let p = Self::bn_params(bn, &saved.stats);
                    let gate = match &s.mask {
                        Some(m) => kernels::ops::batchnorm::ReluGate::Mask(m),
                        None => kernels::ops::batchnorm::ReluGate::Output(&s.out),
                    };
                    let b2 = b2.as_ref().map(Shortcut::grad);
                    let (g, sums, dz) = kernels::ops::batchnorm::join_grad_backward(a, b2, gate, z, &p)?;
                    return Ok((g, Some(Pre::Done { sums, dz })));
                }
            }
        }
        let b2 = match b2 {
            Some(s) => Some(s.full(a)?),
            None => None,
        };
        let b2 = b2.as_ref();
        if self.policy.bn_sums_in_backward {
            if let (Some(saved), Some(bn)) = (s.bns.last(), b.bns.last()) {
                if let Some(z) = &saved.z {
                    let p = Self::bn_params(bn, &saved.stats);
                    let (g, sums) = kernels::ops::batchnorm::join_grad_sums(a, b2, &s.out, z, &p)?;
                    return Ok((g, Some(Pre::Sums(sums))));
                }
            }
        }
        let g = match b2 {
            Some(b2) => kernels::add_relu_grad(a, b2, &s.out)?,
            None => kernels::relu_grad(a, &s.out)?,
        };
        Ok((g, None))
    }

    /// Records the gradient of a parameter unless it is frozen.
    fn put(&mut self, p: &crate::Param, g: impl FnOnce() -> Result<Tensor>) -> Result<()> {
        if !p.is_frozen() {
            self.buckets.put(p.var().as_tensor().id(), Piece::Final(g()?))?;
        }
        Ok(())
    }

    /// Batch statistics of z, with the running statistics updated (PyTorch's momentum and unbiased variance; on
    /// CUDA inside the statistics' finaliser);
    /// for a BatchNorm with frozen statistics (`finetune.bn_frozen`), its running statistics in the same
    /// [mean, var, invstd] form, left unchanged (eval-mode normalisation, as the autograd forward does).
    fn stats(&self, z: &Tensor, bn: &BatchNorm2d) -> Result<BnSaved> {
        if frozen(bn) {
            let rm = bn.running_mean.tensor().detach();
            let rv = bn.running_var.tensor().detach();
            let invstd = (&rv + bn.eps)?.sqrt()?.recip()?;
            let stats = Tensor::stack(&[rm, rv, invstd], 0)?.to_dtype(DType::F32)?;
            return Ok(BnSaved { z: Some(z.clone()), stats, global_rows: None });
        }
        if let Some(sync) = self.sync {
            let (stats, rows) = sync_stats(sync, Some(z), bn)?;
            return Ok(BnSaved { z: Some(z.clone()), stats, global_rows: Some(rows) });
        }
        let stats = kernels::ops::batchnorm::batch_stats(z, bn.eps, &bn.running())?;
        Ok(BnSaved { z: Some(z.clone()), stats, global_rows: None })
    }

    fn bn_params(bn: &BatchNorm2d, stats: &Tensor) -> BnParams {
        let t = train_bn(bn);
        BnParams { stats: stats.clone(), weight: t.weight, bias: t.bias }
    }

    /// A conv followed by its BatchNorm (training statistics) and ReLU: the saved state and relu(bn(conv(x))).
    /// Under `policy.bn_cooperative`, a BatchNorm with batch statistics (not frozen, not synchronised) runs as one
    /// launch ([`kernels::ops::batchnorm::batch_norm_train_with`], with the conv epilogue's moments where it made
    /// them); else [`Self::conv_stats`] then [`Self::bn_apply`]. Same values either way.
    fn conv_bn_relu(&self, x: &ConvIn, cw: &ConvW, bn: &BatchNorm2d) -> Result<(BnSaved, Tensor)> {
        if self.cooperative(bn) {
            let (z, moments) = self.conv_moments(x, cw)?;
            let (stats, y) =
                kernels::ops::batchnorm::batch_norm_train_with(&z, None, moments.as_ref(), &train_bn(bn), true)?;
            return Ok((BnSaved { z: Some(z), stats, global_rows: None }, y));
        }
        let saved = self.conv_stats(x, cw, bn)?;
        let y = self.bn_apply(&saved, bn, true)?;
        Ok((saved, y))
    }

    /// A conv followed by its BatchNorm, whose normalisation + ReLU runs inside the next conv
    /// ([`Self::bn_in_conv`]): the saved state only (one statistics launch under `policy.bn_cooperative`, with
    /// the conv epilogue's moments where it made them; else [`Self::conv_stats`]). The same statistics and running
    /// update as [`Self::conv_bn_relu`].
    fn conv_bn_stats(&self, x: &ConvIn, cw: &ConvW, bn: &BatchNorm2d) -> Result<BnSaved> {
        if self.cooperative(bn) {
            let (z, moments) = self.conv_moments(x, cw)?;
            let stats = kernels::ops::batchnorm::batch_norm_train_stats(&z, moments.as_ref(), &train_bn(bn))?;
            return Ok(BnSaved { z: Some(z), stats, global_rows: None });
        }
        self.conv_stats(x, cw, bn)
    }

    /// Whether BatchNorm `bn`'s forward runs as one launch (`policy.bn_cooperative`; its statistics are the
    /// batch's: not frozen, not synchronised). With `policy.bn_stats_in_conv` the launch takes the conv epilogue's
    /// moments where the conv made them ([`Self::conv_moments`]) and skips its own moments pass.
    fn cooperative(&self, bn: &BatchNorm2d) -> bool {
        self.policy.bn_cooperative && !frozen(bn) && self.sync.is_none()
    }

    /// A conv's output for a cooperative BatchNorm, with its moments from the epilogue under
    /// `policy.bn_stats_in_conv` when the conv ran on a TMA tile that makes them (None: the launch reduces them).
    /// A normalised input ([`ConvIn::BnRelu`], `bn_apply_in_conv = "both"`) takes them from the normalising GEMM's
    /// epilogue (`gemm_nt_bnin_stats_*`).
    fn conv_moments(&self, x: &ConvIn, cw: &ConvW) -> Result<(Tensor, Option<Tensor>)> {
        let (stride, pad) = (cw.conv.stride, cw.conv.padding);
        match x {
            _ if !self.policy.bn_stats_in_conv => Ok((self.conv_in(x, cw)?, None)),
            ConvIn::Act(t) => kernels::conv2d_nhwc_forward_stats(t, &cw.w, stride, pad, self.policy),
            ConvIn::BnRelu(z, p) => kernels::conv2d_nhwc_forward_bn_relu_stats(z, p, &cw.w, stride, pad, self.policy),
        }
    }

    /// Whether the ImageNet stem's BatchNorm + ReLU + max-pool forward runs fused (`policy.stem_pool_fused`): its
    /// statistics the batch's (not frozen, not synchronised).
    fn stem_pool_fused(&self) -> bool {
        self.policy.stem_pool_fused && self.stem_batch_stats()
    }

    /// Whether the stem's BatchNorm normalises with this batch's own statistics (not frozen, not synchronised):
    /// what its fused kernels need.
    fn stem_batch_stats(&self) -> bool {
        !frozen(&self.model.bn1) && self.sync.is_none()
    }

    /// Whether the stem pool's backward runs inside the stem BatchNorm's backward (`policy.stem_pool_bwd_fused`),
    /// under the same conditions, and not beside the buckets' all-reduces (a cooperative grid, as
    /// `cooperative_backward`).
    fn stem_pool_bwd_fused(&self) -> bool {
        self.policy.stem_pool_bwd_fused && self.stem_batch_stats() && self.buckets.sink.is_none()
    }

    /// Whether block outputs keep their ReLU mask for the cooperative join (`policy.join_relu_mask`), where that
    /// join runs ([`Self::cooperative_join`]).
    fn join_mask(&self) -> bool {
        self.policy.join_relu_mask && self.cooperative_join()
    }

    /// Whether the blocks' backward starts with the cooperative join: cooperative BatchNorm backward, and each
    /// block's last BatchNorm input kept (the join needs it; `Recompute::ReluConv` drops it).
    fn cooperative_join(&self) -> bool {
        self.cooperative_backward() && self.recompute != Recompute::ReluConv
    }

    /// Whether the backward of a (not frozen) BatchNorm runs as one launch: `policy.bn_cooperative`, no
    /// synchronised statistics, and no gradient buckets handed on during the backward (a cooperative grid
    /// takes every SM, so it could not start beside the buckets' all-reduces and would serialise with them).
    fn cooperative_backward(&self) -> bool {
        self.policy.bn_cooperative && self.sync.is_none() && self.buckets.sink.is_none()
    }

    /// relu(bn(z)) (or bn(z) without `relu`).
    fn bn_apply(&self, s: &BnSaved, bn: &BatchNorm2d, relu: bool) -> Result<Tensor> {
        let p = Self::bn_params(bn, &s.stats);
        s.z()?.apply_op3_no_bwd(&p.weight, &p.bias, &BnApply { relu, stats: s.stats.clone() })
    }

    /// Backward of `[relu](bn(z))` for the gradient g of its output: records dweight, dbias, returns dz. With
    /// frozen statistics the mean and variance are constants, so dz = w * invstd * g: the dx pass with zero
    /// sums computes exactly that. `pre`: the sums (2, c) already computed with `g` by the kernel that made it
    /// ([`Self::block_output_grad`], [`Self::conv_backward_sums`]); None: the sums pass runs here.
    fn bn_backward(
        &mut self,
        s: &BnSaved,
        g: &Tensor,
        bn: &BatchNorm2d,
        relu: bool,
        pre: Option<Pre>,
    ) -> Result<Tensor> {
        if let Some(Pre::Done { sums, dz }) = pre {
            self.put(&bn.weight, || sums.get(1))?;
            self.put(&bn.bias, || sums.get(0))?;
            return Ok(dz);
        }
        let p = Self::bn_params(bn, &s.stats);
        let op = BnGrad { relu, stats: p.stats, weight: p.weight, bias: p.bias, sums: None };
        let z = s.z()?;
        let pre = match pre {
            Some(Pre::Partials(part)) if self.cooperative_backward() && !frozen(bn) => {
                // The epilogue's partials reduced and dz made in one launch on CUDA (the same values as reducing
                // them first and the dx pass below).
                let (sums, dz) = kernels::ops::batchnorm::batch_norm_train_backward_from_partials(z, g, &op, &part)?;
                self.put(&bn.weight, || sums.get(1))?;
                self.put(&bn.bias, || sums.get(0))?;
                return Ok(dz);
            }
            Some(Pre::Partials(part)) => {
                let c = z.dim(3)?;
                Some(kernels::ops::batchnorm::grad_sums_from_partials(&part, z.elem_count() / c, c)?)
            }
            Some(Pre::Sums(sums)) => Some(sums),
            Some(Pre::Done { .. }) | None => None,
        };
        if self.cooperative_backward() && pre.is_none() && !frozen(bn) {
            // Sums and grad-input in one launch on CUDA (the same values as the two passes below).
            let (sums, dz) = kernels::ops::batchnorm::batch_norm_train_backward(z, g, &op)?;
            self.put(&bn.weight, || sums.get(1))?;
            self.put(&bn.bias, || sums.get(0))?;
            return Ok(dz);
        }
        let sums = match pre {
            Some(sums) => sums,
            None => z.apply_op2_no_bwd(g, &op)?,
        };
        let dx_sums = match (&s.global_rows, self.sync) {
            _ if frozen(bn) => sums.zeros_like()?,
            (Some(w), Some(sync)) => sync_grad_sums(sync, &sums, local_rows(z)?, w)?,
            _ => sums.clone(),
        };
        let dz = z.apply_op2_no_bwd(g, &BnGrad { sums: Some(dx_sums), ..op })?;
        self.put(&bn.weight, || sums.get(1))?;
        self.put(&bn.bias, || sums.get(0))?;
        Ok(dz)
    }

    /// Grad-weight (recorded, FP32 torchvision layout) and, when `need_dx`, grad-input of a conv.
    fn conv_backward(&mut self, cw: &ConvW, x: &ConvIn, dz: &Tensor, need_dx: bool) -> Result<Option<Tensor>> {
        self.record_grad_weight(cw, x, dz)?;
        if !need_dx {
            return Ok(None);
        }
        let (c, (_, h, w, _)) = (cw.conv, x.dims4()?);
        Ok(Some(kernels::conv2d_nhwc_grad_input(dz, &cw.w, c.stride, c.padding, (h, w), self.policy)?))
    }

    /// [`Self::conv_backward`] for a conv whose input is BatchNorm `bn` + ReLU of the saved `prev`: also that
    /// BatchNorm's backward sums over (its input, the grad-input), as the partials the grad-input's epilogue wrote
    /// where it can ([`kernels::conv2d_nhwc_grad_input_bwd_sums`]), for its [`Self::bn_backward`].
    fn conv_backward_sums(
        &mut self,
        cw: &ConvW,
        x: &ConvIn,
        dz: &Tensor,
        prev: &BnSaved,
        bn: &BatchNorm2d,
    ) -> Result<(Tensor, kernels::BwdSums)> {
        self.record_grad_weight(cw, x, dz)?;
        let (c, (_, h, w, _)) = (cw.conv, x.dims4()?);
        let p = Self::bn_params(bn, &prev.stats);
        kernels::conv2d_nhwc_grad_input_bwd_sums(dz, &cw.w, (c.stride, c.padding, (h, w)), self.policy, prev.z()?, &p)
    }

    /// The grad-weight of a conv, recorded unless the weight is frozen (over a normalised input: through
    /// [`kernels::conv2d_nhwc_grad_weight_bn_relu`]).
    fn record_grad_weight(&mut self, cw: &ConvW, x: &ConvIn, dz: &Tensor) -> Result<()> {
        let (c, s, p) = (cw.conv, cw.conv.stride, cw.conv.padding);
        if !c.weight.is_frozen() {
            let r = cw.w.dim(1)?;
            let g = match x {
                ConvIn::Act(t) => kernels::conv2d_nhwc_grad_weight(dz, t, r, s, p, self.policy)?,
                ConvIn::BnRelu(z, bp) => kernels::conv2d_nhwc_grad_weight_bn_relu(dz, z, bp, r, s, p, self.policy)?,
            };
            self.buckets.put(c.weight.var().as_tensor().id(), Piece::Conv(g))?;
        }
        Ok(())
    }

    fn block_forward(&self, b: &'a Block, x: Tensor) -> Result<BlockSaved> {
        let last = b.convs.len() - 1;
        let (mut bns, mut acts, mut weights) = (Vec::new(), Vec::new(), Vec::new());
        let mut inp = ConvIn::act(&x);
        // The block output made with its last BatchNorm's statistics in one launch (identity shortcut), and its
        // ReLU mask when that launch wrote one.
        let mut joined = None;
        let mut mask = None;
        for (i, (conv, bn)) in b.convs.iter().zip(&b.bns).enumerate() {
            let cw = self.weight(conv)?;
            let saved = if i != last && self.bn_in_conv_forward(b, i) {
                // The next conv normalises this output itself: the statistics only, nothing to keep but z.
                let saved = self.conv_bn_stats(&inp, &cw, bn)?;
                inp = ConvIn::BnRelu(saved.z()?.clone(), Self::bn_params(bn, &saved.stats));
                saved
            } else if i != last {
                let (saved, y) = self.conv_bn_relu(&inp, &cw, bn)?;
                // Kept for the next conv's grad-weight unless recomputed, or normalised there from z.
                if self.recompute == Recompute::None && !self.bn_in_conv(b, i) {
                    acts.push(y.clone());
                }
                inp = ConvIn::Act(y);
                saved
            } else if b.downsample.is_none() && self.cooperative(bn) {
                let (z, moments) = self.conv_moments(&inp, &cw)?;
                let (stats, out, m) = kernels::ops::batchnorm::batch_norm_train_add_relu_masked(
                    &z,
                    &x,
                    moments.as_ref(),
                    &train_bn(bn),
                    self.join_mask(),
                )?;
                mask = m;
                joined = Some((out, None));
                BnSaved { z: Some(z), stats, global_rows: None }
            } else if let Some(d) = b.downsample.as_ref().filter(|d| self.cooperative(bn) && self.cooperative(&d.bn)) {
                // Both BatchNorms' statistics and the block output in one launch (without its moments pass when
                // both convs' epilogues made them).
                let (z, m) = self.conv_moments(&inp, &cw)?;
                let dcw = self.weight(&d.conv)?;
                let (zd, md) = self.conv_moments(&ConvIn::act(&x), &dcw)?;
                let (bn_main, bn_down) = (train_bn(bn), train_bn(&d.bn));
                let moments = m.as_ref().zip(md.as_ref());
                let (stats, stats_d, out, m) = kernels::ops::batchnorm::batch_norm_train2_add_relu(
                    &z,
                    &zd,
                    &bn_main,
                    &bn_down,
                    moments,
                    self.join_mask(),
                )?;
                mask = m;
                joined = Some((out, Some((BnSaved { z: Some(zd), stats: stats_d, global_rows: None }, dcw.w))));
                BnSaved { z: Some(z), stats, global_rows: None }
            } else {
                self.conv_stats(&inp, &cw, bn)?
            };
            weights.push(cw.w);
            bns.push(saved);
        }
        let main = Self::bn_params(&b.bns[last], &bns[last].stats);
        let (out, mut down, down_weight) = match (&b.downsample, joined) {
            (_, Some((out, Some((saved, w))))) => (out, Some(saved), Some(w)),
            (None, Some((out, None))) => (out, None, None),
            (Some(d), _) => {
                let cw = self.weight(&d.conv)?;
                let saved = self.conv_stats(&ConvIn::act(&x), &cw, &d.bn)?;
                let res = Self::bn_params(&d.bn, &saved.stats);
                (kernels::bn_add_relu(bns[last].z()?, saved.z()?, &main, Some(&res))?, Some(saved), Some(cw.w))
            }
            (None, _) => (kernels::bn_add_relu(bns[last].z()?, &x, &main, None)?, None, None),
        };
        if self.recompute == Recompute::ReluConv {
            // The backward runs these two convs again (block_backward).
            bns[last].z = None;
            if let Some(d) = down.as_mut() {
                d.z = None;
            }
        }
        Ok(BlockSaved { x, bns, acts, down, out, mask, weights, down_weight })
    }

    /// The ReLU mask of the block before `b` (saved state `prev`) when its join folds into `b`'s conv1
    /// grad-input (`policy.join_in_conv`, [`kernels::conv2d_nhwc_grad_input_join`]): the cooperative join with the
    /// block outputs' masks, `b` a bottleneck (conv1 1x1, stride 1, no padding) with an identity shortcut.
    /// `prev_block` is the block before, whose saved state `prev` is.
    fn join_fold<'s>(&self, b: &Block, prev_block: &Block, prev: &'s BlockSaved) -> Option<Fold<'s>> {
        let conv1 = b.convs.first()?;
        let k = conv1.weight.var().as_tensor().dims().last().copied();
        let applies = self.policy.join_in_conv
            && self.join_mask()
            && b.downsample.is_none()
            && b.convs.len() == 3
            && (k, conv1.stride, conv1.padding) == (Some(1), 1, 0);
        let mask = prev.mask.as_ref().filter(|_| applies)?;
        // The sums of the block before's last BatchNorm with the joined values (its output gradient), where its
        // input is kept and its statistics are the batch's.
        let bn3 = match (prev_block.bns.last(), prev.bns.last()) {
            (Some(bn), Some(saved)) if self.policy.join_sums() && !frozen(bn) && saved.global_rows.is_none() => {
                saved.z.as_ref().map(|z| (z, Self::bn_params(bn, &saved.stats)))
            }
            _ => None,
        };
        Some(Fold { mask, bn3 })
    }

    /// Backward of a block from the gradient `gp` at its output's pre-ReLU sum: the two gradient contributions at
    /// its input (main path, shortcut), which the caller joins, or with `fold` (the block before's ReLU mask,
    /// [`Self::join_fold`]) where the conv1 grad-input's epilogue joined them, that block's output gradient.
    /// `pre`: the backward sums of the block's last BatchNorm, made with `gp` ([`Self::block_output_grad`]).
    fn block_backward(
        &mut self,
        b: &'a Block,
        s: BlockSaved,
        gp: &Tensor,
        mut pre: Option<Pre>,
        fold: Option<Fold>,
    ) -> Result<BlockGrad> {
        let BlockSaved { x, mut bns, mut acts, down, out, mask, mut weights, down_weight } = s;
        drop((out, mask));
        let last = b.convs.len() - 1;
        // g: gradient at the output of bns[i] (pre-ReLU for the last, post-ReLU for the others).
        let mut g = gp.clone();
        let mut gx = None;
        for i in (0..=last).rev() {
            let mut saved = bns.pop().expect("one saved BatchNorm per conv");
            let cw = ConvW::with(&b.convs[i], weights.pop().expect("one weight per conv"));
            let input = match i {
                0 => ConvIn::act(&x),
                // Normalised inside the conv, as in the forward.
                _ if self.bn_in_conv(b, i - 1) => {
                    ConvIn::BnRelu(bns[i - 1].z()?.clone(), Self::bn_params(&b.bns[i - 1], &bns[i - 1].stats))
                }
                // relu(bn(z)) of the conv before, from its saved output and statistics (still in `bns`).
                _ if self.recompute != Recompute::None => {
                    ConvIn::Act(self.bn_apply(&bns[i - 1], &b.bns[i - 1], true)?)
                }
                _ => ConvIn::Act(acts.pop().expect("one saved activation per inner conv")),
            };
            if saved.z.is_none() {
                // The last conv's output, dropped by the forward: the same conv on the same input again.
                saved.z = Some(self.conv_in(&input, &cw)?);
            }
            // The sums of this BatchNorm: made with its output gradient by the pass before (the block output's, or
            // the next conv's grad-input epilogue), or None.
            let dz = self.bn_backward(&saved, &g, &b.bns[i], i != last, pre.take())?;
            drop(saved);
            let dx = match (bns.last(), fold.as_ref().filter(|_| i == 0)) {
                // The block input's join in the grad-input's store (identity shortcut: its gradient is gp), with
                // the sums of the block before's last BatchNorm where the fold takes them.
                (None, Some(f)) => {
                    self.record_grad_weight(&cw, &input, &dz)?;
                    let (_, h, w, _) = input.dims4()?;
                    let bn3 = f.bn3.as_ref().map(|(z, p)| (*z, p));
                    let (g, joined, part) =
                        kernels::conv2d_nhwc_grad_input_join_sums(&dz, &cw.w, (h, w), self.policy, gp, f.mask, bn3)?;
                    if joined {
                        return Ok(BlockGrad::Joined(g, part));
                    }
                    g
                }
                // The conv's input is relu(bn(z)) of the conv before: its sums come with the grad-input.
                (Some(prev), _) if self.policy.bn_sums_in_backward => {
                    let (dx, sums) = self.conv_backward_sums(&cw, &input, &dz, prev, &b.bns[i - 1])?;
                    pre = Some(match sums {
                        kernels::BwdSums::Sums(sums) => Pre::Sums(sums),
                        kernels::BwdSums::Partials(part) => Pre::Partials(part),
                    });
                    dx
                }
                _ => self.conv_backward(&cw, &input, &dz, true)?.expect("grad-input requested"),
            };
            if i == 0 {
                gx = Some(dx);
            } else {
                g = dx;
            }
        }
        let gs = match (&b.downsample, down, down_weight) {
            (Some(d), Some(mut saved), Some(w)) => {
                let cw = ConvW::with(&d.conv, w);
                if saved.z.is_none() {
                    saved.z = Some(self.conv(&x, &cw)?);
                }
                let dz = self.bn_backward(&saved, gp, &d.bn, false, None)?;
                drop(saved);
                if self.compact_shortcut(&cw)? {
                    // The 1x1 stride-2 conv's grad-input on its own grid: a 1x1 stride-1 grad-input there (no
                    // memset of the full-size tensor, which is zero off the even cells).
                    self.record_grad_weight(&cw, &ConvIn::act(&x), &dz)?;
                    let (_, oh, ow, _) = dz.dims4()?;
                    Shortcut::Stride2(kernels::conv2d_nhwc_grad_input(&dz, &cw.w, 1, 0, (oh, ow), self.policy)?)
                } else {
                    Shortcut::Full(self.conv_backward(&cw, &ConvIn::act(&x), &dz, true)?.expect("grad-input requested"))
                }
            }
            _ => Shortcut::Full(gp.clone()),
        };
        Ok(BlockGrad::Split(gx.expect("a block has convs"), gs))
    }

    /// Whether a downsample conv's grad-input stays on its own grid ([`Shortcut::Stride2`]):
    /// `policy.compact_shortcut_grad`, a 1x1 stride-2 conv without padding, and the cooperative join that reads it
    /// so ([`Self::cooperative_join`]; elsewhere it would be spread to full size at once).
    fn compact_shortcut(&self, cw: &ConvW) -> Result<bool> {
        let (_, r, s, _) = cw.w.dims4()?;
        Ok(self.policy.compact_shortcut_grad
            && self.cooperative_join()
            && (r, s, cw.conv.stride, cw.conv.padding) == (1, 1, 2, 0))
    }

    /// Linear forward, detached: the same kernel the autograd model runs (`kernels::linear`).
    fn fc_forward(&self, fc: &Linear, x: &Tensor) -> Result<Tensor> {
        let w = fc.weight.var().as_tensor().detach().to_dtype(self.act)?;
        let b = fc.bias.var().as_tensor().detach().to_dtype(self.act)?;
        kernels::linear(x, &w, &b, self.policy)
    }
}

/// Softmax cross-entropy with label smoothing `eps` over logits (n, k) (f32, bf16 or f16) and labels (n): the
/// mean loss (f32 scalar) and its gradient times `scale` ((n, k) f32). Target distribution
/// q = (1 - eps) onehot + eps / k; loss_i = -sum_j q_j log p_ij; dlogits = (p - q) * scale / n. Forward and
/// backward in one fused op ([`kernels::ops::xent`]; one launch on CUDA).
pub fn softmax_cross_entropy(logits: &Tensor, labels: &Tensor, eps: f64, scale: f64) -> Result<(Tensor, Tensor)> {
    kernels::ops::xent::softmax_xent(logits, labels, eps, scale)
}

/// Bytes held by the blocks' saved activations, each tensor counted once (a block's input is the block before's
/// output).
fn saved_bytes(saved: &[BlockSaved]) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0;
    for s in saved {
        let bns = s.bns.iter().chain(&s.down).filter_map(|b| b.z.as_ref());
        for t in bns.chain(&s.acts).chain([&s.x, &s.out]).chain(&s.mask) {
            if seen.insert(t.id()) {
                bytes += t.elem_count() * t.dtype().size_in_bytes();
            }
        }
    }
    bytes
}

/// Values per channel of a channels-last activation (everything but the last dim).
fn local_rows(z: &Tensor) -> Result<usize> {
    Ok(z.elem_count() / z.dims().last().copied().unwrap_or(1).max(1))
}

/// Synchronised batch statistics: this rank's statistics of z (None: a rank with no samples this step, which
/// still takes part) combined over the ranks exactly, as Chan et al.'s parallel variance does, in two sum
/// all-reduces: first n_r mean_r and n_r (the global mean and count), then n_r (var_r + (mean_r - mean)^2) (the
/// global sum of squared deviations). Returns the global [mean, biased var, invstd] (3, c) and the global number
/// of values per channel (1), with the running statistics updated from them as one process would (the same values
/// on every rank). (One all-reduce of sums shifted by a common constant would do with one round, but loses the
/// variance to cancellation when it is small against the squared mean.)
fn sync_stats(sync: &dyn BnSync, z: Option<&Tensor>, bn: &BatchNorm2d) -> Result<(Tensor, Tensor)> {
    let dev = bn.running_mean.tensor().device().clone();
    let c = bn.running_mean.tensor().elem_count();
    let local = match z {
        Some(z) => {
            let n = local_rows(z)? as f64;
            let st = z.apply_op1_no_bwd(&kernels::ops::batchnorm::BnStats { eps: bn.eps })?;
            Some((n, st.get(0)?, st.get(1)?))
        }
        None => None,
    };
    let first = match &local {
        Some((n, mean, _)) => Tensor::cat(&[(mean * *n)?, Tensor::full(*n as f32, 1, &dev)?], 0)?,
        None => Tensor::zeros(c + 1, DType::F32, &dev)?,
    };
    sync.all_reduce_sum(&first)?;
    let w = first.narrow(0, c, 1)?;
    let mean = first.narrow(0, 0, c)?.broadcast_div(&w)?;
    let second = match &local {
        Some((n, m, v)) => ((v + (m - &mean)?.sqr()?)? * *n)?,
        None => Tensor::zeros(c, DType::F32, &dev)?,
    };
    sync.all_reduce_sum(&second)?;
    let var = second.broadcast_div(&w)?;
    let invstd = (&var + bn.eps)?.sqrt()?.recip()?;
    // PyTorch's running update with the unbiased variance of the global batch.
    let r = bn.running();
    let m = r.momentum;
    let unbiased = var.broadcast_mul(&w.broadcast_div(&(&w - 1.0)?)?)?;
    r.mean.set(&((r.mean.as_tensor().detach() * (1.0 - m))? + (&mean * m)?)?)?;
    r.var.set(&((r.var.as_tensor().detach() * (1.0 - m))? + (unbiased * m)?)?)?;
    r.num_batches_tracked.set(&(r.num_batches_tracked.as_tensor().detach() + 1.0)?)?;
    Ok((Tensor::stack(&[mean, var, invstd], 0)?, w))
}

/// The BatchNorm backward's sums (2, c) for the dx pass under synchronised statistics: each rank's sums of the
/// gradient of its own mean loss, weighted by its value count `rows` and summed over the ranks, divided by the
/// global count `w`. The dx pass divides by the local count, so it sees global sum / global count, and the
/// result is this rank's part of the global-batch gradient in the local-mean convention that the trainer's
/// gradient all-reduce weights by sample count.
fn sync_grad_sums(sync: &dyn BnSync, sums: &Tensor, rows: usize, w: &Tensor) -> Result<Tensor> {
    let u = (sums * rows as f64)?.contiguous()?;
    sync.all_reduce_sum(&u)?;
    u.broadcast_div(w)
}

impl ResNet {
    /// Every convolution of the model: the stem, then each block's convs and its downsample conv, in order.
    pub fn convs(&self) -> Vec<&Conv2d> {
        let mut convs: Vec<&Conv2d> = vec![&self.conv1];
        for b in self.stages.iter().flatten() {
            convs.extend(&b.convs);
            if let Some(d) = &b.downsample {
                convs.push(&d.conv);
            }
        }
        convs
    }

    /// The FP32 master of every conv weight ([`Self::convs`]' order), keyed as [`StepArgs::weights`] takes them.
    pub fn conv_weight_masters(&self) -> Vec<Tensor> {
        self.convs().iter().map(|c| c.weight.var().as_tensor().clone()).collect()
    }

    /// A rank's part of a synchronised-BatchNorm step when it has no samples: the same all-reduces, in the same
    /// order, as [`Self::train_step_explicit_with`] runs (forward: every BatchNorm's statistics, with the
    /// running statistics updated from the global batch; backward: every BatchNorm's gradient sums), with zeros.
    pub fn sync_bn_idle_step(&self, sync: &dyn BnSync) -> Result<()> {
        let blocks: Vec<&Block> = self.stages.iter().flatten().collect();
        let mut order: Vec<&BatchNorm2d> = vec![&self.bn1];
        for b in &blocks {
            order.extend(&b.bns);
            if let Some(d) = &b.downsample {
                order.push(&d.bn);
            }
        }
        for bn in order.iter().filter(|bn| !frozen(bn)) {
            sync_stats(sync, None, bn)?;
        }
        let mut back: Vec<&BatchNorm2d> = Vec::new();
        for b in blocks.iter().rev() {
            back.extend(b.bns.iter().rev());
            if let Some(d) = &b.downsample {
                back.push(&d.bn);
            }
        }
        back.push(&self.bn1);
        for bn in back.iter().filter(|bn| !frozen(bn)) {
            let c = bn.running_mean.tensor().elem_count();
            sync.all_reduce_sum(&Tensor::zeros((2, c), DType::F32, bn.running_mean.tensor().device())?)?;
        }
        Ok(())
    }

    /// The trainable parameters in the order the explicit backward makes their gradients: the head, then each
    /// block from the last (per conv from the last: BatchNorm weight and bias, conv weight; then the downsample
    /// branch), then the stem.
    fn grad_order(&self) -> Vec<&crate::Param> {
        let mut order: Vec<&crate::Param> = vec![&self.fc.weight, &self.fc.bias];
        for b in self.stages.iter().flatten().collect::<Vec<_>>().into_iter().rev() {
            for (conv, bn) in b.convs.iter().zip(&b.bns).rev() {
                order.extend([&bn.weight, &bn.bias, &conv.weight]);
            }
            if let Some(d) = &b.downsample {
                order.extend([&d.bn.weight, &d.bn.bias, &d.conv.weight]);
            }
        }
        order.extend([&self.bn1.weight, &self.bn1.bias, &self.conv1.weight]);
        order.retain(|p| !p.is_frozen());
        order
    }

    /// The trainable parameters' tensor ids in buckets of about `bucket_bytes` of FP32 gradient each (a bucket
    /// closes once it holds at least that much; a parameter is never split), in the order the explicit backward
    /// completes them: the data-parallel trainer all-reduces each bucket while the backward goes on
    /// ([`StepArgs::buckets`]), and every rank gets the same plan.
    pub fn grad_buckets(&self, bucket_bytes: usize) -> Vec<Vec<TensorId>> {
        let mut buckets = vec![Vec::new()];
        let mut bytes = 0;
        for p in self.grad_order() {
            let t = p.var().as_tensor();
            buckets.last_mut().expect("a bucket").push(t.id());
            bytes += 4 * t.elem_count();
            if bytes >= bucket_bytes {
                buckets.push(Vec::new());
                bytes = 0;
            }
        }
        buckets.retain(|b| !b.is_empty());
        buckets
    }

    /// One explicit training step (see the module docs): forward in training mode on `x` ((n, 3, h, w), or its
    /// channels-last view), softmax cross-entropy against `labels` with `label_smoothing`, and the gradients of
    /// `loss * grad_scale` for every trainable parameter. Updates the BatchNorm running statistics as the
    /// autograd forward does. Errors with the reason of [`unsupported`] when the model or precision is not
    /// supported.
    pub fn train_step_explicit(
        &self,
        x: &Tensor,
        labels: &Tensor,
        label_smoothing: f64,
        grad_scale: f64,
        precision: Precision,
    ) -> Result<StepOutput> {
        self.train_step_explicit_with(x, labels, StepArgs::new(label_smoothing, grad_scale, precision))
    }

    /// [`Self::train_step_explicit`] with everything [`StepArgs`] offers: synchronised BatchNorm over the ranks
    /// of `args.sync`, and the gradients handed on bucket by bucket during the backward (`args.buckets`; then
    /// [`StepOutput::grads`] is empty).
    pub fn train_step_explicit_with(&self, x: &Tensor, labels: &Tensor, args: StepArgs<'_>) -> Result<StepOutput> {
        let StepArgs { label_smoothing, grad_scale, loss_scale, precision, sync, recompute, buckets, weights } = args;
        if let Some(why) = unsupported(self, precision) {
            candle_core::bail!("explicit training step: {why}");
        }
        let buckets = match buckets {
            Some((plan, sink)) => Buckets::new(plan.to_vec(), Some(sink)),
            None => Buckets::new(vec![self.grad_order().iter().map(|p| p.var().as_tensor().id()).collect()], None),
        };
        let policy = self.config.kernels.clone();
        let mut e = Engine {
            model: self,
            sync,
            act: precision.act_dtype(),
            policy: &policy,
            buckets,
            weights: std::borrow::Cow::Owned(HashMap::new()),
            recompute,
        };
        e.convert_weights(weights)?;
        let m = e.model;
        let input = x.detach().to_dtype(e.act)?.permute((0, 2, 3, 1))?.contiguous()?;

        // ----- forward
        let stem_w = e.weight(&m.conv1)?;
        let pool = MaxPool2d { kernel: 3, stride: 2, padding: 1 };
        let imagenet = matches!(m.config.stem, Stem::ImageNet);
        let (stem, stem_hw, mut h, pool_offsets) = if imagenet && e.stem_pool_fused() {
            // BatchNorm + ReLU + max-pool in one launch on CUDA (policy.stem_pool_fused): relu(bn(z)) at full
            // resolution is never written.
            let (z, moments) = e.conv_moments(&ConvIn::act(&input), &stem_w)?;
            let (stats, y, off) = batch_norm_train_relu_max_pool(&z, moments.as_ref(), &train_bn(&m.bn1), pool)?;
            let hw = (z.dim(1)?, z.dim(2)?);
            (BnSaved { z: Some(z), stats, global_rows: None }, hw, y, Some(off))
        } else {
            let (stem, a0) = e.conv_bn_relu(&ConvIn::act(&input), &stem_w, &m.bn1)?;
            // The ImageNet stem's max-pool keeps its windows' argmax offsets (one byte per output element) for
            // the backward, and its input (4x the output, in the activation dtype) is freed here.
            let (h, off) = if imagenet {
                (a0.apply_op1_no_bwd(&MaxPool2dNhwc(pool))?, Some(a0.apply_op1_no_bwd(&MaxPool2dNhwcOffsets(pool))?))
            } else {
                (a0.clone(), None)
            };
            let hw = (a0.dim(1)?, a0.dim(2)?);
            (stem, hw, h, off)
        };
        let blocks: Vec<&Block> = m.stages.iter().flatten().collect();
        let mut saved = Vec::with_capacity(blocks.len());
        for b in &blocks {
            let s = e.block_forward(b, h)?;
            h = s.out.clone();
            saved.push(s);
        }
        let saved_block_bytes = saved_bytes(&saved);
        let (_, fh, fw, _) = h.dims4()?;
        let feats = h.apply_op1_no_bwd(&GlobalAvgPoolNhwc)?;
        drop(h);
        let logits = e.fc_forward(&m.fc, &feats)?;
        let (loss, dlogits) = softmax_cross_entropy(&logits, labels, label_smoothing, grad_scale)?;
        let dlogits = match &loss_scale {
            Some(s) => dlogits.broadcast_mul(&s.to_dtype(DType::F32)?.reshape(1)?)?,
            None => dlogits,
        };

        // ----- backward: head
        let dl = dlogits.to_dtype(e.act)?;
        e.put(&m.fc.weight, || dl.t()?.matmul(&feats)?.to_dtype(DType::F32))?;
        e.put(&m.fc.bias, || dlogits.sum(0))?;
        let w_fc = m.fc.weight.var().as_tensor().detach().to_dtype(e.act)?;
        let dfeat = dl.matmul(&w_fc)?;
        drop(feats);
        let g_last = dfeat.apply_op1_no_bwd(&GlobalAvgPoolNhwcBackward { h: fh, w: fw })?;

        // ----- backward: blocks, last to first
        let last = saved.last().expect("a ResNet has blocks");
        let last_block = blocks.last().expect("a ResNet has blocks");
        let (mut gp, mut pre) = e.block_output_grad(last_block, last, &g_last, None)?;
        let mut g_stem = None;
        for (i, b) in blocks.iter().enumerate().rev() {
            let s = saved.pop().expect("one saved state per block");
            let fold = if i > 0 { e.join_fold(b, blocks[i - 1], &saved[i - 1]) } else { None };
            match e.block_backward(b, s, &gp, pre.take(), fold)? {
                // The join ran in the conv1 grad-input's store: the block before starts from its output gradient
                // (and the partials of its last BatchNorm's sums, where the store took them).
                BlockGrad::Joined(g, part) => {
                    gp = g;
                    pre = part.map(Pre::Partials);
                }
                // The block input is the previous block's ReLU output: join and mask in one pass.
                BlockGrad::Split(gm, gs) if i > 0 => {
                    (gp, pre) = e.block_output_grad(blocks[i - 1], &saved[i - 1], &gm, Some(gs))?;
                }
                BlockGrad::Split(gm, gs) => g_stem = Some((gm, gs)),
            }
        }
        let (gm, gs) = g_stem.expect("a ResNet has blocks");
        let gs = gs.full(&gm)?;

        // ----- backward: stem (the pool's backward adds the first block's two gradients as it reads them)
        let dz0 = match pool_offsets {
            Some(off) if e.stem_pool_bwd_fused() => {
                // The pool's backward inside the BatchNorm + ReLU backward, one launch on CUDA (either forward
                // saved the same z, statistics and offsets).
                let p = Engine::bn_params(&m.bn1, &stem.stats);
                let op = BnGrad { relu: true, stats: p.stats, weight: p.weight, bias: p.bias, sums: None };
                let (sums, dz) = batch_norm_train_relu_max_pool_backward(stem.z()?, &off, (&gm, Some(&gs)), &op, pool)?;
                e.put(&m.bn1.weight, || sums.get(1))?;
                e.put(&m.bn1.bias, || sums.get(0))?;
                dz
            }
            Some(off) => {
                let bwd = MaxPool2dNhwcBackwardOffsets { pool, in_hw: stem_hw };
                let g_a0 = max_pool2d_nhwc_backward_offsets_sum(&off, &gm, &gs, bwd)?;
                e.bn_backward(&stem, &g_a0, &m.bn1, true, None)?
            }
            None => e.bn_backward(&stem, &(gm + gs)?, &m.bn1, true, None)?,
        };
        drop(stem);
        e.conv_backward(&stem_w, &ConvIn::act(&input), &dz0, false)?;
        let (grads, buckets_held) = e.buckets.finish()?;
        Ok(StepOutput { loss, logits, grads, buckets_held, saved_block_bytes })
    }
}
