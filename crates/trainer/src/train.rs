//! The training loop: `train_epoch` / `validate` with meters, mixed precision with loss scaling, gradient
//! accumulation and clipping, checkpoints and resume, fine-tuning.

use crate::checkpoint::{self, EpochMeters, TrainState};
use crate::config::{Config, DataKind, LossScaling, OnCorrupt, OptimName, StepEngine};
use crate::data::{self, Dataset, HostBatch, Loader, LoaderOptions, Split};
use crate::dist::buckets::{gather_scaled, BucketPlan, BucketReducer};
use crate::metrics::MetricsWriter;
use crate::optim::{OptimKind, Optimizer, ParamOptions};
use crate::scaler::LossScaler;
use crate::sched::Schedule;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use indicatif::{ProgressBar, ProgressStyle};
use resnet::{weights, Precision, ResNet, ResNetConfig};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Opens the device of a `cpu`, `cuda` or `cuda:N` spec.
pub fn select_device(spec: &str) -> Result<Device> {
    let ordinal = match crate::config::parse_device(spec) {
        None => bail!("device = \"{spec}\": expected cpu, cuda or cuda:N"),
        Some(None) => return Ok(Device::Cpu),
        Some(Some(n)) => n as usize,
    };
    if !cfg!(feature = "cuda") {
        bail!(
            "device = \"{spec}\": this trainer was built without CUDA (rebuild with `--features cuda`, see the README)"
        );
    }
    #[cfg(feature = "cuda")]
    // A preference only: where the driver refuses it (the context already open), waits keep spinning.
    let _ = kernels::cuda::prefer_blocking_sync(ordinal);
    let dev = Device::new_cuda(ordinal).map_err(|e| anyhow!("device = \"{spec}\": cannot open the GPU ({e})"))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        // cudarc's event tracking creates two CUDA events per allocation and records them at every launch, to
        // order work across streams. The trainer issues all device work from this thread on candle's one stream,
        // so the events only cost host time (thousands of allocations and launches per training step).
        // SAFETY: no buffer created from here on is used from a second stream.
        unsafe { d.disable_event_tracking() };
        // Without memory pools (some virtualised GPUs) the allocator works as before: say so, and go on.
        if let Err(e) = kernels::cuda::keep_pool_memory(d) {
            eprintln!("warning: device = \"{spec}\": the CUDA memory pool keeps returning memory to the driver ({e})");
        }
    }
    Ok(dev)
}

pub fn precision(cfg: &Config) -> Precision {
    cfg.amp.dtype
}

/// Whether dynamic loss scaling is on: amp.loss_scaling = "on"/"off", or "auto" (fp16 only).
pub fn scaling_enabled(cfg: &Config) -> bool {
    match cfg.amp.loss_scaling {
        LossScaling::On => true,
        LossScaling::Off => false,
        LossScaling::Auto => cfg.amp.dtype == Precision::F16,
    }
}

/// Builds the model of the config: kernel policy (`kernels.*`, "auto" resolved for the device and dtype; the
/// custom convs make the model channels-last), initialisation, `model.init_from` (head replaced when the class
/// count differs), frozen modules and BatchNorm statistics.
pub fn build_model(cfg: &Config, device: &Device) -> Result<ResNet> {
    let mc = ResNetConfig {
        arch: cfg.model.arch,
        num_classes: cfg.model.num_classes,
        stem: cfg.model.stem,
        zero_init_residual: cfg.model.zero_init_residual,
        seed: cfg.seed,
        kernels: cfg.kernels.policy(device.is_cuda(), cfg.amp.dtype)?,
    };
    let model = ResNet::new(mc, device)?;
    if !cfg.model.init_from.is_empty() {
        let path = Path::new(&cfg.model.init_from);
        // Plain weights, or the model of a trainer checkpoint (a fine-tuning start from another run).
        let report = if checkpoint::is_checkpoint(path) {
            let tensors = checkpoint::load_model_tensors(path).context("model.init_from")?;
            weights::load_tensors(&model, &tensors, true)
                .map_err(|m| anyhow!("model.init_from: {}: {m}", path.display()))?
        } else {
            weights::load_into(&model, path, true).with_context(|| "model.init_from".to_string())?
        };
        eprintln!(
            "loaded {} tensors from {}{}",
            report.loaded,
            path.display(),
            if report.head_replaced { format!(" (new {}-class head)", cfg.model.num_classes) } else { String::new() }
        );
    }
    if !cfg.finetune.freeze.is_empty() {
        let names: Vec<String> = model.store().entries().into_iter().map(|(n, _)| n).collect();
        for p in &cfg.finetune.freeze {
            if !names.iter().any(|n| n == p || n.starts_with(&format!("{p}."))) {
                bail!(
                    "finetune.freeze: `{p}` names no module of {} (e.g. conv1, bn1, layer1, layer2.0, fc)",
                    cfg.model.arch
                );
            }
        }
        model.store().freeze_prefixes(&cfg.finetune.freeze);
    }
    model.freeze_bn_stats(cfg.finetune.bn_frozen);
    Ok(model)
}

/// Mean cross-entropy with label smoothing, in FP32. logits: [n, k] any float dtype, labels: [n] u32.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor, smoothing: f64) -> candle_core::Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let nll = logp.gather(&labels.unsqueeze(1)?, 1)?.mean_all()?.neg()?;
    if smoothing == 0.0 {
        return Ok(nll);
    }
    let uniform = logp.mean(D::Minus1)?.mean_all()?.neg()?;
    (nll * (1.0 - smoothing))? + (uniform * smoothing)?
}

/// Number of samples whose label is among the top `k` logits. logits: [n, classes], labels: [n].
fn topk_correct(logits: &Tensor, labels: &Tensor, k: usize) -> candle_core::Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let target = logits.gather(&labels.unsqueeze(1)?, 1)?; // [n, 1]
                                                           // Rank of the target = number of logits strictly greater than it.
    let rank = logits.broadcast_gt(&target)?.to_dtype(DType::F32)?.sum(D::Minus1)?;
    // A NaN target logit compares false with everything: never count it as correct.
    let finite = target.eq(&target)?.squeeze(1)?.to_dtype(DType::F32)?;
    (rank.lt(k as f64)?.to_dtype(DType::F32)? * finite)?.sum_all()
}

pub struct Batch {
    pub images: Tensor,
    pub labels: Tensor,
    pub n: usize,
}

impl Batch {
    /// A batch of no samples (a data-parallel rank's share of a short last global batch): the step skips its
    /// forward and backward, and the rank joins the all-reduce with zeros.
    pub fn empty(device: &Device, size: usize, dtype: DType, layout: kernels::input::InputLayout) -> Result<Self> {
        let images = match layout {
            kernels::input::InputLayout::Nchw => Tensor::zeros((0, 3, size, size), dtype, device)?,
            kernels::input::InputLayout::Nhwc => Tensor::zeros((0, size, size, 3), dtype, device)?,
        };
        Ok(Self { images, labels: Tensor::zeros(0, DType::U32, device)?, n: 0 })
    }
}

/// The dtype and memory layout the model takes its input in: the activation dtype of `prec`, NHWC for a
/// channels-last model (the tensor is then a (n, 3, h, w) view of NHWC memory, see `kernels::input`).
pub fn input_format(model: &ResNet, prec: Precision) -> (DType, kernels::input::InputLayout) {
    let layout = if model.config.channels_last() {
        kernels::input::InputLayout::Nhwc
    } else {
        kernels::input::InputLayout::Nchw
    };
    (prec.act_dtype(), layout)
}

/// A uint8 host batch as the model's input on `device`: the bytes are copied as they are and converted,
/// normalised and flipped there (one CUDA kernel, or the same arithmetic in Rust on the CPU).
pub fn to_device(b: &HostBatch, device: &Device, dtype: DType, layout: kernels::input::InputLayout) -> Result<Batch> {
    if b.n == 0 {
        return Batch::empty(device, b.size, dtype, layout);
    }
    let images = Tensor::from_slice(b.images.as_slice(), (b.n, b.size, b.size, 3), device)?;
    let flips = Tensor::from_slice(&b.flips, b.n, device)?;
    let images = kernels::input::u8_to_input(&images, &flips, dtype, layout)?;
    let labels = Tensor::from_slice(&b.labels, b.n, device)?;
    Ok(Batch { images, labels, n: b.n })
}

/// Result of one optimizer step.
#[derive(Debug, Clone)]
pub struct StepOutput {
    pub loss: f64,
    pub correct: u64,
    pub samples: usize,
    pub skipped: bool,
    pub loss_scale: f64,
    pub grad_norm: f64,
}

/// Model, optimizer and scaler: what one training step needs.
pub struct StepRunner {
    pub model: ResNet,
    pub opt: Optimizer,
    pub scaler: LossScaler,
    pub precision: Precision,
    pub label_smoothing: f64,
    pub clip_grad_norm: f64,
    /// Which engine runs forward and backward (`kernels.step` resolved).
    pub engine: StepEngine,
    /// When set, `step` synchronizes the device between phases and adds each phase's wall time here
    /// (`trainer bench --phases`); the synchronizations themselves slow the step a little.
    pub phases: Option<PhaseTimes>,
    /// Data-parallel training: the other ranks. Each step's gradients (every rank's mean gradient weighted by its
    /// sample count), loss, correct count and sample count are summed over the ranks before the inf/NaN check, so
    /// the skip decision, the clipping and the update are the same on every rank.
    pub collective: Option<Box<dyn crate::dist::Collective>>,
    /// `train.sync_bn`: with a collective, BatchNorm statistics over the global batch (fused step only).
    pub sync_bn: bool,
    /// Data-parallel: counted up on arrival at every collective ([`Ranks::progress`]).
    pub progress: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// `train.grad_allreduce`: the dtype of the gradient all-reduce.
    pub grad_allreduce: crate::config::GradAllreduce,
    /// `train.bucket_mb` in bytes: the size of the gradient all-reduce's buckets.
    pub bucket_bytes: usize,
    /// `kernels.recompute`: what the fused step's backward recomputes instead of keeping it.
    pub recompute: resnet::step::Recompute,
    /// `kernels.weights_in_optimizer`: the fused step on CUDA in bf16/fp16 reads the conv weights the optimizer
    /// keeps ([`Optimizer::keep_conv_weights`]) instead of converting them each step.
    pub weights_in_optimizer: bool,
    /// Data-parallel: the gradient buckets (made at the first step).
    buckets: Option<BucketPlan>,
    /// The device's copy of the loss scale, growth tracker and steps taken ([`Self::device_state`]), and the host
    /// values it was last known to match.
    ctl: Option<Tensor>,
    ctl_seen: Option<(LossScaler, u64)>,
    /// Steps queued and resolved so far.
    queued: u64,
    resolved: u64,
    /// CUDA: pinned buffers for the reports of queued steps, reused once resolved.
    #[cfg(feature = "cuda")]
    readbacks: Vec<kernels::cuda::readback::HostReadback>,
    /// CUDA: the learning rate on the device (one FP32), written by the host before each step.
    #[cfg(feature = "cuda")]
    lr_dev: Option<Tensor>,
    /// `kernels.graph`, and the captured steps with the policy that decides when to capture.
    pub graphs: crate::graphs::Graphs,
}

/// The trainer's collective as the explicit step's [`resnet::step::BnSync`], counting arrivals like the
/// gradient all-reduce does.
struct SyncVia<'a>(&'a dyn crate::dist::Collective, Option<&'a std::sync::atomic::AtomicU64>);

impl resnet::step::BnSync for SyncVia<'_> {
    fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<()> {
        arrive(self.1);
        self.0.all_reduce_sum(t).map_err(|e| candle_core::Error::Msg(format!("sync BatchNorm: {e:#}")))
    }
}

/// One more arrival at a collective ([`Ranks::progress`]).
fn arrive(progress: Option<&std::sync::atomic::AtomicU64>) {
    if let Some(p) = progress {
        p.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Seconds spent per training-step phase, summed over steps (see [`StepRunner::phases`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseTimes {
    /// Forward pass and loss.
    pub forward: f64,
    /// `backward()` over the autograd graph.
    pub backward: f64,
    /// Gradient gathering: FP32 casts, accumulation, the flat buffer, unscaling, norm and the host read-back.
    pub grads: f64,
    /// Optimizer update (and clipping) plus the scaler update.
    pub optimizer: f64,
    pub steps: usize,
}

impl PhaseTimes {
    /// Milliseconds per step for each phase: (name, ms).
    pub fn per_step_ms(&self) -> [(&'static str, f64); 4] {
        let n = self.steps.max(1) as f64;
        let ms = |s: f64| 1000.0 * s / n;
        [
            ("forward", ms(self.forward)),
            ("backward", ms(self.backward)),
            ("grads", ms(self.grads)),
            ("optimizer", ms(self.optimizer)),
        ]
    }
}

impl StepRunner {
    pub fn new(cfg: &Config, model: ResNet) -> Result<Self> {
        let kind = match cfg.optim.name {
            OptimName::AdamW => OptimKind::AdamW { beta1: cfg.optim.beta1, beta2: cfg.optim.beta2, eps: cfg.optim.eps },
            OptimName::Sgd => OptimKind::Sgd { momentum: cfg.optim.momentum, nesterov: cfg.optim.nesterov },
        };
        let params = model
            .store()
            .trainable()
            .into_iter()
            .map(|(name, var)| {
                let no_decay = cfg.optim.no_decay_bn_bias && var.rank() <= 1;
                let lr_mult = if name.starts_with("fc.") { cfg.finetune.head_lr_mult } else { 1.0 };
                let o = ParamOptions { weight_decay: if no_decay { 0.0 } else { cfg.optim.weight_decay }, lr_mult };
                (name, var, o)
            })
            .collect::<Vec<_>>();
        if params.is_empty() {
            bail!("finetune.freeze leaves nothing to train");
        }
        let cuda = model.device().is_cuda();
        let (engine, note) = cfg.kernels.step_engine(model.config.channels_last(), precision(cfg), cuda)?;
        if cfg.train.sync_bn && engine == StepEngine::Autograd {
            bail!(
                "train.sync_bn = true needs the fused step, but this run takes autograd (kernels.step = \"fused\" \
                 with the channels-last model: kernels.conv = \"custom\", or \"auto\" on CUDA in bf16/fp16)"
            );
        }
        if cfg.kernels.recompute != crate::config::RecomputeChoice::None && engine == StepEngine::Autograd {
            bail!(
                "kernels.recompute = \"{}\" needs the fused step, but this run takes autograd (kernels.step = \
                 \"fused\" with the channels-last model: kernels.conv = \"custom\", or \"auto\" on CUDA in bf16/fp16)",
                cfg.kernels.recompute.name()
            );
        }
        if cfg.kernels.graph == crate::config::GraphChoice::On {
            let why =
                crate::graphs::unsupported(cuda && cfg!(feature = "cuda"), engine == StepEngine::Fused, false, false);
            if let Some(why) = why {
                bail!("kernels.graph = \"on\": {why}");
            }
        }
        // On the CPU autograd is the expected engine: the note is for CUDA runs that miss the fused step.
        if let (Some(note), true) = (note, cuda) {
            eprintln!("note: {note}");
        }
        Ok(Self {
            engine,
            opt: Optimizer::new(kind, params),
            scaler: LossScaler::new(&cfg.amp, scaling_enabled(cfg)),
            precision: precision(cfg),
            label_smoothing: cfg.train.label_smoothing,
            clip_grad_norm: cfg.train.clip_grad_norm,
            phases: None,
            collective: None,
            sync_bn: cfg.train.sync_bn,
            progress: None,
            grad_allreduce: cfg.train.grad_allreduce,
            bucket_bytes: (cfg.train.bucket_mb * 1e6).max(1.0) as usize,
            recompute: cfg.kernels.recompute.level(),
            weights_in_optimizer: cfg.kernels.weights_in_optimizer(),
            buckets: None,
            ctl: None,
            ctl_seen: None,
            queued: 0,
            resolved: 0,
            #[cfg(feature = "cuda")]
            readbacks: Vec::new(),
            #[cfg(feature = "cuda")]
            lr_dev: None,
            graphs: crate::graphs::Graphs::new(cfg.kernels.graph),
            model,
        })
    }

    /// Forward + backward over the micro-batches, then unscale, inf/NaN check, clip, update or skip, and update the
    /// scale (PyTorch GradScaler's order), and the step's report read back: [`Self::step_async`] then
    /// [`Self::resolve`].
    pub fn step(&mut self, micro: &[Batch], lr: f64) -> Result<StepOutput> {
        let p = self.step_async(micro, lr)?;
        self.resolve(p)
    }

    /// The device state ([`crate::scaler::DEVICE_STATE_LEN`]: loss scale, growth tracker, steps taken), uploaded
    /// again only when the host's values were changed from outside since the last step was resolved (a resumed
    /// checkpoint, a test that sets the scale).
    pub(crate) fn device_state(&mut self) -> Result<Tensor> {
        let mirror = (self.scaler.clone(), self.opt.steps);
        match (&self.ctl, &self.ctl_seen) {
            (Some(ctl), Some(seen)) if *seen == mirror => Ok(ctl.clone()),
            _ => {
                let ctl = self.scaler.device_state(self.opt.steps, self.model.device())?;
                self.ctl = Some(ctl.clone());
                self.ctl_seen = Some(mirror);
                Ok(ctl)
            }
        }
    }

    /// Queues one training step without waiting for the device: forward + backward over the micro-batches, the
    /// gradients gathered and unscaled (and all-reduced, data-parallel), then the update, which the device itself
    /// skips on inf/NaN and clips by the global norm, then the loss scale's update on the device. The loss scale,
    /// the skip decision and AdamW's step count live in device memory ([`Self::device_state`]): there is no host
    /// synchronisation inside the step. The returned report is read by [`Self::resolve`], whenever the caller
    /// chooses (the trainer reads step k's while step k + 1 runs). Steps must be resolved in order.
    pub fn step_async(&mut self, micro: &[Batch], lr: f64) -> Result<PendingStep> {
        // The learning rate goes to the device (the update kernels read it there), so that a captured step
        // replays with each step's rate.
        #[cfg(feature = "cuda")]
        let lr_dev = self.lr_device(lr)?;
        #[cfg(not(feature = "cuda"))]
        let lr_dev: Option<Tensor> = None;
        #[cfg(feature = "cuda")]
        if let Some(report) = crate::graphs::graph_step(self, micro, lr_dev.as_ref())? {
            return self.queue_report(report);
        }
        let report = self.queue_step(micro, (lr, lr_dev.as_ref()))?;
        self.queue_report(report)
    }

    /// CUDA: the device copy of the learning rate, `lr` written into it after the work queued so far.
    #[cfg(feature = "cuda")]
    fn lr_device(&mut self, lr: f64) -> Result<Option<Tensor>> {
        if !self.model.device().is_cuda() {
            return Ok(None);
        }
        let t = match &self.lr_dev {
            Some(t) => t.clone(),
            None => {
                let t = Tensor::zeros(1, DType::F32, self.model.device())?;
                self.lr_dev = Some(t.clone());
                t
            }
        };
        kernels::cuda::graph::write_f32(&t, &[lr as f32])?;
        Ok(Some(t))
    }

    /// Queues the step's work and returns its report on the device ([`Self::resolve`] reads it): [mean loss,
    /// correct, samples, sum of squares, then the scaler's report]. `lr`: the host's rate and, on CUDA, the
    /// device copy the update reads. Inside a CUDA graph capture this is what the graph records.
    pub(crate) fn queue_step(&mut self, micro: &[Batch], lr: (f64, Option<&Tensor>)) -> Result<Tensor> {
        let timing = self.phases.is_some();
        let device = self.model.device().clone();
        let mut mark = Instant::now();
        // Time since the last mark, after the device has finished the queued work (0 when not timing).
        let mut lap = |timing: bool| -> Result<f64> {
            if !timing {
                return Ok(0.0);
            }
            device.synchronize()?;
            let now = Instant::now();
            let dt = now.duration_since(mark).as_secs_f64();
            mark = now;
            Ok(dt)
        };
        let mut times = PhaseTimes::default();
        lap(timing)?;
        let ctl = self.device_state()?;
        // The loss scale as the device knows it (None without loss scaling: the gradients are not scaled).
        let loss_scale = if self.scaler.enabled { Some(ctl.narrow(0, 0, 1)?) } else { None };
        let accum = micro.len() as f64;
        self.keep_conv_weights()?;
        #[cfg(feature = "cuda")]
        let kept = self.opt.conv_weights().map(|w| w.views());
        #[cfg(not(feature = "cuda"))]
        let kept = None;
        let vars: Vec<_> = self.opt.vars().map(|(_, v)| v.clone()).collect();
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut loss_sum: Option<Tensor> = None;
        let mut correct_sum: Option<Tensor> = None;
        let mut samples = 0;
        let sync = match (&self.collective, self.sync_bn) {
            (Some(c), true) => Some(SyncVia(c.as_ref(), self.progress.as_deref())),
            _ => None,
        };
        if self.collective.is_some() && self.buckets.is_none() {
            let ids: Vec<_> = vars.iter().map(|v| v.as_tensor().id()).collect();
            self.buckets = Some(BucketPlan::new(self.model.grad_buckets(self.bucket_bytes), &ids)?);
        }
        // Data-parallel, fused step: the last micro-batch's backward hands each gradient bucket to the reducer as
        // soon as it is final, and its all-reduce overlaps the rest of the backward. Not with synchronised
        // BatchNorm: its all-reduces in the backward would interleave with the buckets', and a rank without
        // images could not repeat that order. There, and on the autograd path, the buckets start after the
        // backward.
        let overlap = self.engine == StepEngine::Fused && !self.sync_bn && micro.last().is_some_and(|b| b.n > 0);
        let n_local: usize = micro.iter().map(|b| b.n).sum();
        let mut reducer = match (&self.collective, &self.buckets) {
            (Some(c), Some(plan)) => Some(BucketReducer::new(
                plan,
                c.as_ref(),
                self.progress.as_deref(),
                self.grad_allreduce,
                // Rank r contributes n_r x its mean gradient; the sum over ranks divided by the global sample
                // count is the gradient of the mean loss over the global batch (the single-process result when
                // every rank's micro-batches are full).
                (n_local as f64, loss_scale.clone()),
                vars.len(),
            )),
            _ => None,
        };
        // A data-parallel rank's last batch of an epoch may be empty: it still joins the all-reduce, with zeros
        // (and, with synchronised BatchNorm, every BatchNorm's all-reduces of the step).
        for (i, b) in micro.iter().enumerate() {
            if b.n == 0 {
                if let Some(s) = &sync {
                    self.model.sync_bn_idle_step(s)?;
                }
                continue;
            }
            let last = i + 1 == micro.len();
            // The loss and every trainable parameter's gradient of loss * scale / accum (None: no gradient, or
            // handed to the reducer already).
            let (logits, loss, grads): (Tensor, Tensor, Vec<Option<Tensor>>) = match self.engine {
                StepEngine::Autograd => {
                    let logits = self.model.forward(&b.images, true, self.precision)?;
                    let loss = cross_entropy(&logits, &b.labels, self.label_smoothing)?;
                    times.forward += lap(timing)?;
                    let mut scaled = (&loss * (1.0 / accum))?;
                    if let Some(s) = &loss_scale {
                        scaled = scaled.broadcast_mul(&s.reshape(())?)?;
                    }
                    let store = scaled.backward()?;
                    (logits, loss, vars.iter().map(|v| store.get(v.as_tensor()).cloned()).collect())
                }
                StepEngine::Fused => {
                    // Forward and backward in one call: its time is booked as backward.
                    let mut args = resnet::step::StepArgs {
                        sync: sync.as_ref().map(|s| s as &dyn resnet::step::BnSync),
                        loss_scale: loss_scale.clone(),
                        recompute: self.recompute,
                        weights: kept,
                        ..resnet::step::StepArgs::new(self.label_smoothing, 1.0 / accum, self.precision)
                    };
                    if let (true, true, Some(r), Some(plan)) = (overlap, last, reducer.as_mut(), &self.buckets) {
                        args.buckets = Some((&plan.ids, r as &mut dyn resnet::step::GradSink));
                    }
                    let mut o = self.model.train_step_explicit_with(&b.images, &b.labels, args)?;
                    let grads = vars.iter().map(|v| o.grads.remove(&v.as_tensor().id())).collect();
                    (o.logits, o.loss, grads)
                }
            };
            let correct = topk_correct(&logits.detach(), &b.labels, 1)?;
            times.backward += lap(timing)?;
            let slots: &mut [Option<Tensor>] = match reducer.as_mut() {
                Some(r) => r.acc_mut(),
                None => &mut acc,
            };
            for (slot, g) in slots.iter_mut().zip(grads) {
                if let Some(g) = g {
                    let g = g.to_dtype(DType::F32)?;
                    *slot = Some(match slot.take() {
                        None => g,
                        Some(a) => (a + g)?,
                    });
                }
            }
            let l = loss.detach();
            loss_sum = Some(match loss_sum {
                None => l,
                Some(s) => (s + l)?,
            });
            correct_sum = Some(match correct_sum {
                None => correct,
                Some(s) => (s + correct)?,
            });
            samples += b.n;
        }
        let zero = || Tensor::zeros((), DType::F32, &device);
        let loss_sum = match loss_sum {
            Some(l) => l.to_dtype(DType::F32)?,
            None if self.collective.is_some() => zero()?,
            None => bail!("empty step: every micro-batch has 0 samples"),
        };
        let correct_sum = match correct_sum {
            Some(c) => c.to_dtype(DType::F32)?,
            None => zero()?,
        };
        // All gradients in one flat FP32 buffer, unscaled in one pass: the inf/NaN check and the norm are then a
        // single reduction (sum of squares: non-finite iff some gradient is inf/NaN or overflows), and the
        // per-parameter gradients are views into the buffer. totals: (mean loss, correct, samples).
        let (all, total_sq, totals) = match (reducer, &self.collective) {
            (Some(mut r), Some(c)) => {
                // Whatever the backward did not hand out (all of it on the autograd path).
                r.start_rest(&vars)?;
                let summed = r.finish()?;
                let n = samples as f64;
                let counts =
                    Tensor::stack(&[Tensor::full(n as f32, (), &device)?, ((loss_sum / accum)? * n)?, correct_sum], 0)?;
                arrive(self.progress.as_deref());
                c.all_reduce_sum(&counts)?;
                let global_n = counts.narrow(0, 0, 1)?;
                // Into the optimizer's order and divided by the global count in one pass (the count read on the
                // device), with the sum of squares of the result.
                let (all, total_sq) = gather_scaled(&summed, 1.0, Some(&global_n))?;
                drop(summed);
                let mean_loss = counts.narrow(0, 1, 1)?.broadcast_div(&global_n)?;
                (all, total_sq, Tensor::cat(&[mean_loss, counts.narrow(0, 2, 1)?, global_n], 0)?)
            }
            _ => {
                let flat: Vec<Tensor> = acc
                    .into_iter()
                    .zip(&vars)
                    .map(|(g, v)| match g {
                        Some(g) => Ok(g.flatten_all()?),
                        None => Ok(v.as_tensor().zeros_like()?.flatten_all()?),
                    })
                    .collect::<Result<_>>()?;
                let (all, total_sq) = gather_scaled(&flat, 1.0, loss_scale.as_ref())?;
                let n = Tensor::full(samples as f32, 1, &device)?;
                (all, total_sq, Tensor::cat(&[(loss_sum / accum)?.reshape(1)?, correct_sum.reshape(1)?, n], 0)?)
            }
        };
        times.grads += lap(timing)?;
        // The update skips itself on inf/NaN (on the device); then the scale and the step count move.
        self.opt.step_flat(&all, &total_sq, self.clip_grad_norm, lr, &ctl)?;
        let (ctl, report) = self.scaler.update_on_device(&ctl, &total_sq)?;
        self.ctl = Some(ctl);
        let report = Tensor::cat(&[totals.to_dtype(DType::F32)?, total_sq.reshape(1)?, report], 0)?;
        times.optimizer += lap(timing)?;
        if let Some(p) = self.phases.as_mut() {
            p.forward += times.forward;
            p.backward += times.backward;
            p.grads += times.grads;
            p.optimizer += times.optimizer;
            p.steps += 1;
        }
        Ok(report)
    }

    /// Makes the conv weights the fused step reads from the optimizer (`kernels.weights_in_optimizer`) when they
    /// are wanted and not kept yet (without them the step converts its weights itself). Not wanted: on the
    /// autograd path, off CUDA, in fp32, with the option off. Not made inside a graph capture (a
    /// buffer made there would be the graph's): that step converts its weights itself, and the next eager step
    /// makes them.
    fn keep_conv_weights(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let act = self.precision.act_dtype();
            let wanted = self.weights_in_optimizer
                && self.engine == StepEngine::Fused
                && self.model.device().is_cuda()
                && matches!(act, DType::BF16 | DType::F16);
            if wanted && (self.opt.conv_weights().is_some() || !kernels::cuda::graph::capturing()) {
                let masters = self.model.conv_weight_masters();
                let refs: Vec<&Tensor> = masters.iter().collect();
                self.opt.keep_conv_weights(&refs, act)?;
            }
        }
        Ok(())
    }

    /// Hands a queued step's report to the host: on CUDA it goes to pinned host memory right away, so that
    /// reading it waits for this step only.
    fn queue_report(&mut self, report: Tensor) -> Result<PendingStep> {
        let device = self.model.device().clone();
        let report = match &device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let mut rb = match self.readbacks.pop() {
                    Some(rb) => rb,
                    None => kernels::cuda::readback::HostReadback::new(d, REPORT_MAX)?,
                };
                rb.queue(&report)?;
                Report::Pinned(rb)
            }
            _ => Report::Tensor(report),
        };
        self.queued += 1;
        Ok(PendingStep { report, seq: self.queued })
    }

    /// Reads a queued step's report (waiting for the device to finish that step, not the ones queued after it)
    /// and brings the host's copy of the state up to date: the loss scale and growth tracker, the optimizer's
    /// step count.
    pub fn resolve(&mut self, p: PendingStep) -> Result<StepOutput> {
        if p.seq != self.resolved + 1 {
            bail!("training steps resolved out of order: step {} after {}", p.seq, self.resolved);
        }
        // [mean loss, correct, samples, sum of squares, then the scaler's report: scale used, found inf, scale,
        // growth tracker, steps taken].
        let host: Vec<f32> = match p.report {
            Report::Tensor(t) => t.to_vec1()?,
            #[cfg(feature = "cuda")]
            Report::Pinned(rb) => {
                let v = rb.read()?;
                self.readbacks.push(rb);
                v
            }
        };
        self.resolved = p.seq;
        let (loss, correct, samples, norm_sq) = (host[0] as f64, host[1] as u64, host[2] as usize, host[3] as f64);
        let amp = &host[4..];
        let skipped = amp[1] != 0.0;
        let in_sync = self.ctl_seen.as_ref() == Some(&(self.scaler.clone(), self.opt.steps));
        self.scaler.set_from_report(amp);
        if !skipped {
            self.opt.steps += 1;
        }
        if in_sync {
            self.ctl_seen = Some((self.scaler.clone(), self.opt.steps));
        }
        Ok(StepOutput { loss, correct, samples, skipped, loss_scale: amp[0] as f64, grad_norm: norm_sq.sqrt() })
    }

    /// Whether every queued step has been resolved.
    pub fn idle(&self) -> bool {
        self.queued == self.resolved
    }
}

/// A queued training step ([`StepRunner::step_async`]): its report, on the device until
/// [`StepRunner::resolve`] reads it.
#[must_use = "a queued step must be resolved"]
pub struct PendingStep {
    report: Report,
    seq: u64,
}

/// Where a queued step's report waits: a device tensor (the CPU), or pinned host memory it is being copied to.
enum Report {
    Tensor(Tensor),
    #[cfg(feature = "cuda")]
    Pinned(kernels::cuda::readback::HostReadback),
}

/// Values in a step's report: [mean loss, correct, samples, sum of squares] and the scaler's report.
#[cfg(feature = "cuda")]
pub(crate) const REPORT_MAX: usize = 4 + crate::scaler::REPORT_LEN;

/// Validation result.
#[derive(Debug, Clone, Copy)]
pub struct EvalResult {
    pub loss: f64,
    pub top1: f64,
    pub top5: f64,
    pub samples: usize,
    pub img_per_s: f64,
}

/// Loss, top-1 and top-5 (in %) over a whole data set, eval-mode BatchNorm, no autograd graph. `doing` names the
/// pass in its errors ("validation after epoch 1", "evaluation"; see [`device_failure`]).
pub fn validate(
    model: &ResNet,
    ds: Arc<dyn Dataset>,
    cfg: &Config,
    prec: Precision,
    doing: &str,
) -> Result<EvalResult> {
    let (bs, key) = eval_batch(cfg);
    let what = format!("{key} = {bs}");
    check_host_batch(model, cfg, bs.min(ds.len()), &what, HostPass::Eval)?;
    let loader = Loader::new(ds, loader_options(cfg, bs, false, 0, 0));
    let (dtype, layout) = input_format(model, prec);
    let t0 = Instant::now();
    let sums = || -> Result<(f64, f64, f64, usize)> {
        let (mut loss, mut c1, mut c5, mut n) = (0f64, 0f64, 0f64, 0usize);
        for b in loader {
            let b = to_device(&b?, model.device(), dtype, layout)?;
            let v: Vec<f32> = resnet::no_grad(|| -> Result<Vec<f32>> {
                let logits = model.forward(&b.images, false, prec)?;
                let l = (cross_entropy(&logits, &b.labels, 0.0)? * b.n as f64)?;
                let k5 = 5.min(model.config.num_classes);
                let t = Tensor::stack(
                    &[l, topk_correct(&logits, &b.labels, 1)?, topk_correct(&logits, &b.labels, k5)?],
                    0,
                )?;
                Ok(t.to_vec1()?)
            })?;
            loss += v[0] as f64;
            c1 += v[1] as f64;
            c5 += v[2] as f64;
            n += b.n;
        }
        Ok((loss, c1, c5, n))
    };
    let (loss, c1, c5, n) = sums().map_err(|e| device_failure(e, doing, &what, HostPass::Eval, cfg))?;
    if n == 0 {
        bail!("the validation set is empty");
    }
    let n_f = n as f64;
    Ok(EvalResult {
        loss: loss / n_f,
        top1: 100.0 * c1 / n_f,
        top5: 100.0 * c5 / n_f,
        samples: n,
        img_per_s: n_f / t0.elapsed().as_secs_f64(),
    })
}

/// Random images and labels made on the device itself (benchmarks, synthetic training on a GPU), in the format
/// the device feed delivers real batches in (`format`, from [`input_format`]): the activation dtype, and for a
/// channels-last model a (n, 3, h, w) view of NHWC memory. So a benchmark's step does the work a training step on
/// real data does; an FP32 NCHW batch would add a cast and a transposing copy (~0.5 ms for ResNet-152 at batch 256
/// on the H200) that training never runs.
pub fn synthetic_batch(
    device: &Device,
    n: usize,
    size: usize,
    classes: usize,
    seed: u64,
    (dtype, layout): (DType, kernels::input::InputLayout),
) -> Result<Batch> {
    if device.is_cuda() {
        device.set_seed(seed)?;
    }
    let images = match layout {
        kernels::input::InputLayout::Nchw => Tensor::randn(0f32, 1.0, (n, 3, size, size), device)?.to_dtype(dtype)?,
        kernels::input::InputLayout::Nhwc => {
            Tensor::randn(0f32, 1.0, (n, size, size, 3), device)?.to_dtype(dtype)?.permute((0, 3, 1, 2))?
        }
    };
    let labels = Tensor::rand(0f32, classes as f32, n, device)?.floor()?.to_dtype(DType::U32)?;
    Ok(Batch { images, labels, n })
}

/// Where training batches come from: the host loader (on CUDA through the pinned, asynchronous device feed), or
/// (synthetic data on a GPU) random tensors made on the device.
pub enum BatchSource {
    Host {
        loader: Loader,
        device: Device,
        dtype: DType,
        layout: kernels::input::InputLayout,
    },
    #[cfg(feature = "cuda")]
    Fed(crate::feed::DeviceFeed),
    Device {
        device: Device,
        seed: u64,
        n: usize,
        size: usize,
        classes: usize,
        format: (DType, kernels::input::InputLayout),
        next: usize,
        batches: usize,
        t: f64,
    },
}

impl BatchSource {
    /// The training batches of `epoch` from batch `skip` on, as `model` takes them at `prec`; with `shard` =
    /// (rank, world), this rank's share of every global batch.
    pub fn new(
        cfg: &Config,
        ds: &Arc<dyn Dataset>,
        device: &Device,
        (dtype, layout): (DType, kernels::input::InputLayout),
        (epoch, skip): (usize, usize),
        shard: Option<(usize, usize)>,
    ) -> Result<Self> {
        let (rank, world) = shard.unwrap_or((0, 1));
        let batches = crate::dist::steps_per_epoch(ds.len(), world, cfg.train.batch_size);
        if cfg.data.kind == DataKind::Synthetic && device.is_cuda() {
            let seed = cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(epoch as u64);
            // Each rank draws its own batches (every one of full size).
            let seed = seed.wrapping_add((rank as u64) << 40);
            return Ok(Self::Device {
                device: device.clone(),
                seed,
                n: cfg.train.batch_size,
                size: cfg.data.image_size,
                classes: cfg.model.num_classes,
                format: (dtype, layout),
                next: skip,
                batches,
                t: 0.0,
            });
        }
        let loader = Loader::new(
            ds.clone(),
            LoaderOptions { shard, ..loader_options(cfg, cfg.train.batch_size, true, epoch, skip) },
        );
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let feed =
                crate::feed::DeviceFeed::new(loader, device, cfg.train.batch_size, ds.image_size(), dtype, layout)?;
            return Ok(Self::Fed(feed));
        }
        Ok(Self::Host { loader, device: device.clone(), dtype, layout })
    }

    /// The loader's own rate (decode + augment + collate, per second of its producer's time).
    pub fn images_per_sec(&self) -> f64 {
        match self {
            Self::Host { loader, .. } => loader.images_per_sec(),
            #[cfg(feature = "cuda")]
            Self::Fed(f) => f.loader_images_per_sec(),
            Self::Device { n, next, t, .. } => (*n * *next) as f64 / t.max(1e-9),
        }
    }
}

impl Iterator for BatchSource {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        match self {
            Self::Host { loader, device, dtype, layout } => {
                loader.next().map(|b| to_device(&b?, device, *dtype, *layout))
            }
            #[cfg(feature = "cuda")]
            Self::Fed(f) => f.next(),
            Self::Device { device, seed, n, size, classes, format, next, batches, t } => {
                if *next >= *batches {
                    return None;
                }
                let t0 = Instant::now();
                let r = synthetic_batch(device, *n, *size, *classes, seed.wrapping_add(*next as u64 * 7919), *format);
                *t += t0.elapsed().as_secs_f64();
                *next += 1;
                Some(r)
            }
        }
    }
}

pub fn loader_options(
    cfg: &Config,
    batch_size: usize,
    shuffle: bool,
    epoch: usize,
    skip_batches: usize,
) -> LoaderOptions {
    LoaderOptions {
        batch_size,
        shuffle,
        seed: cfg.seed,
        epoch,
        workers: cfg.data.workers,
        prefetch: cfg.data.prefetch,
        skip_corrupt: match cfg.data.on_corrupt {
            OnCorrupt::Skip => true,
            OnCorrupt::Error => false,
        },
        skip_batches,
        shard: None,
    }
}

/// Where a resumed run continues inside its epoch: the checkpoint's `batch_in_epoch` micro-batches of
/// `batch_size x world_size` samples (as saved) in micro-batches of `batch_size x world` (now). Mid-epoch, the
/// samples done must fill whole global batches of the new shape; at an epoch boundary any shape resumes.
pub fn resume_position(state: &TrainState, batch_size: usize, world: usize) -> std::result::Result<usize, String> {
    let saved_bs = if state.batch_size > 0 { state.batch_size } else { batch_size };
    let (saved, now) = (saved_bs * state.world_size.max(1), batch_size * world);
    if state.batch_in_epoch == 0 || saved == now {
        return Ok(state.batch_in_epoch);
    }
    let Some(done) = state.batch_in_epoch.checked_mul(saved) else {
        return Err(format!(
            "its place in epoch {} ({} batches of {saved}) is out of range",
            state.epoch + 1,
            state.batch_in_epoch
        ));
    };
    if !done.is_multiple_of(now) {
        return Err(format!(
            "it stopped {done} samples into epoch {} (global batch {saved_bs} x {} rank(s)), which is not a whole \
             number of global batches of {batch_size} x {world} rank(s); resume with a global batch that divides \
             {done}, or from a checkpoint taken at the end of an epoch",
            state.epoch + 1,
            state.world_size.max(1)
        ));
    }
    Ok(done / now)
}

/// Final figures of a run (also written to metrics.jsonl).
#[derive(Debug, Clone)]
pub struct Summary {
    pub steps: usize,
    pub last_loss: f64,
    pub losses: Vec<f64>,
    pub val: Option<EvalResult>,
    pub best_top1: Option<f64>,
    pub run_dir: PathBuf,
}

/// Opens both splits; the class count must match the model's head.
pub fn open_data(cfg: &Config) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    let train = data::open(&cfg.data, Split::Train, cfg.seed, cfg.model.num_classes)?;
    let val = data::open(&cfg.data, Split::Val, cfg.seed, cfg.model.num_classes)?;
    if train.num_classes() != cfg.model.num_classes {
        bail!(
            "model.num_classes = {} but data.kind = \"{}\" has {} classes (set model.num_classes = {})",
            cfg.model.num_classes,
            cfg.data.kind.name(),
            train.num_classes(),
            train.num_classes()
        );
    }
    if train.is_empty() {
        bail!("the training set is empty");
    }
    Ok((train, val))
}

/// Trains as the config says, in `run_dir`; with `resume`, continues from the latest checkpoint there.
pub fn train(cfg: &Config, run_dir: &Path, resume: bool) -> Result<Summary> {
    train_ranks(cfg, run_dir, resume, None)
}

/// A `Key: N kB` value of a /proc file in bytes (`/proc/self/status`'s `VmHWM:`, `/proc/meminfo`'s
/// `MemAvailable:`, ...; Linux).
fn proc_kib_bytes(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|k| k * 1024)
}

fn proc_status_bytes(key: &str) -> Option<u64> {
    proc_kib_bytes("/proc/self/status", key)
}

/// Starts a new measure of this process's peak resident memory (Linux: /proc/self/clear_refs; elsewhere a no-op).
pub fn host_peak_reset() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// This process's peak resident memory since [`host_peak_reset`] (Linux), in bytes.
pub fn host_peak_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// This process's resident memory now (Linux), in bytes.
pub fn host_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS:")
}

/// Bytes of host memory this process can still take (Linux): the kernel's MemAvailable, capped by the address
/// space limit (`ulimit -v`) less what the process maps now; None where unknown.
pub fn host_memory_available() -> Option<u64> {
    let avail = proc_kib_bytes("/proc/meminfo", "MemAvailable:")?;
    #[cfg(target_os = "linux")]
    {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } == 0 && lim.rlim_cur != libc::RLIM_INFINITY {
            let mapped = proc_status_bytes("VmSize:").unwrap_or(0);
            #[allow(clippy::unnecessary_cast)] // rlim_t is u64 here, narrower on some targets
            let limit = lim.rlim_cur as u64;
            return Some(avail.min(limit.saturating_sub(mapped)));
        }
    }
    Some(avail)
}

/// Values kept per conv output value by the CPU training step, as a floor: measured at 10.5-12.8 (peak RSS
/// against batch size, ResNet-18 at 8 and 64 px, ResNet-50 at 8 px, FP32, 2026-12-05); 8 leaves a quarter of
/// the least for what the measure did not cover.
pub const HOST_VALUES_PER_CONV_OUTPUT: u128 = 8;

/// Values held per value of the largest conv output by CPU evaluation, as a floor: measured at 4.6-6.0 (peak RSS
/// of `trainer eval` against batch size, ResNet-18 at 16 px CIFAR stem and 64 px ImageNet stem, ResNet-50 at 16
/// px, FP32, 2026-12-05).
pub const HOST_EVAL_VALUES_PER_MAX_CONV_OUTPUT: u128 = 4;

/// Which pass a batch is for: the CPU check of [`check_host_batch`], the advice of [`device_failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostPass {
    /// A training step: every conv output is kept for the backward.
    Train,
    /// Evaluation: no graph, the largest layer's input and output at once.
    Eval,
}

/// On the CPU, a batch of `batch` images whose activations cannot fit the host memory is refused here with an
/// error naming `what` (the setting that asked for it, e.g. "train.batch_size = 64"; an allocation that fails later aborts the process, past any error handling). The bound is a
/// floor of what the pass keeps: for training [`HOST_VALUES_PER_CONV_OUTPUT`] times every conv output's elements,
/// for evaluation [`HOST_EVAL_VALUES_PER_MAX_CONV_OUTPUT`] times the largest one's, at the activation width (4
/// bytes in FP32, 2 in BF16/FP16). GPU memory is not checked here: a CUDA allocation that fails is an error the
/// callers handle.
pub fn check_host_batch(model: &ResNet, cfg: &Config, batch: usize, what: &str, pass: HostPass) -> Result<()> {
    if model.device().is_cuda() {
        return Ok(());
    }
    let width = if precision(cfg) == resnet::Precision::F32 { 4 } else { 2 };
    let size = cfg.data.image_size;
    let (values, doing) = match pass {
        HostPass::Train => (HOST_VALUES_PER_CONV_OUTPUT * model.conv_output_elems(size) as u128, "training"),
        HostPass::Eval => {
            (HOST_EVAL_VALUES_PER_MAX_CONV_OUTPUT * model.max_conv_output_elems(size) as u128, "evaluation")
        }
    };
    let per_image = width * values;
    let need = per_image * batch as u128;
    let Some(have) = host_memory_available() else { return Ok(()) };
    if need > have as u128 {
        let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
        bail!(
            "{what} would run out of memory: {doing} {batch} images at {size}x{size} keeps at least {:.1} GiB ({:.1} MiB \
             an image), this machine has {:.1} GiB available",
            gib(need),
            per_image as f64 / (1u64 << 20) as f64,
            gib(have as u128)
        );
    }
    Ok(())
}

/// Whether `e` (an anyhow or candle error) is a device allocation that failed (CUDA's `CUDA_ERROR_OUT_OF_MEMORY`
/// through candle or cudarc).
pub fn is_oom(e: &impl std::fmt::Display) -> bool {
    let s = format!("{e:#}").to_lowercase();
    s.contains("out of memory") || s.contains("out_of_memory")
}

/// The error of a training step or a validation that failed: `e` under `doing` ("training step 13 (epoch 2)",
/// "validation after epoch 1"); a device allocation that failed instead becomes one line naming the batch setting
/// that asked for the memory (`what`, e.g. "train.batch_size = 256"; for `pass` = Train also the settings that fit
/// the same batch in less) and `trainer sweep --max`.
pub fn device_failure(e: anyhow::Error, doing: &str, what: &str, pass: HostPass, cfg: &Config) -> anyhow::Error {
    if !is_oom(&e) {
        return e.context(doing.to_string());
    }
    let less = match pass {
        HostPass::Train => {
            "a smaller batch (train.grad_accum keeps the global batch) or kernels.recompute = \"relu\" / \"relu+conv\" \
             fits in less"
        }
        HostPass::Eval => "a smaller batch fits in less",
    };
    anyhow::anyhow!(
        "out of GPU memory in {doing} at {what} ({}, {}): {less}; `trainer sweep --max` finds the largest training \
         batch that fits ({})",
        cfg.model.arch,
        cfg.amp.dtype,
        crate::one_line(&e)
    )
}

/// The evaluation batch size: `train.eval_batch_size`, or `train.batch_size` when that is 0, with the key that
/// gave it.
pub fn eval_batch(cfg: &Config) -> (usize, &'static str) {
    match cfg.train.eval_batch_size {
        0 => (cfg.train.batch_size, "train.batch_size"),
        n => (n, "train.eval_batch_size"),
    }
}

/// This process's part in a data-parallel run.
pub struct Ranks {
    /// Sums over the ranks (NCCL in the trainer).
    pub collective: Box<dyn crate::dist::Collective>,
    /// Ranks on this node, on cuda:0.. (rank 0's telemetry samples all of their GPUs).
    pub local_world_size: usize,
    /// Counted up each time this rank arrives at a collective (the rendezvous group's heartbeats carry
    /// it, so that a rank that stops arriving is named: `dist::Group::on_failure`).
    pub progress: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// [`train`] as one rank of a data-parallel run when `ranks` is given (`trainer launch`, torchrun, Slurm):
/// the rank trains on its share of every global batch (`dist::shard`), the gradients are summed over the ranks
/// every step, and only rank 0 writes (metrics.jsonl, checkpoints, plots, model.safetensors), validates and prints.
pub fn train_ranks(cfg: &Config, run_dir: &Path, resume: bool, ranks: Option<Ranks>) -> Result<Summary> {
    let (collective, ranks_info, progress) = match ranks {
        Some(r) => (Some(r.collective), Some(r.local_world_size), r.progress),
        None => (None, None, None),
    };
    let (rank, world) = collective.as_ref().map(|c| (c.rank(), c.world_size())).unwrap_or((0, 1));
    let writer = rank == 0;
    let ckpt_dir = run_dir.join("checkpoints");
    // The checkpoint to resume from, found before anything is created or written in the run directory.
    let resume_from = match resume {
        true => Some(
            checkpoint::resume_point(&ckpt_dir)
                .ok_or_else(|| anyhow!("--resume: no checkpoint in {}", ckpt_dir.display()))?,
        ),
        false => None,
    };
    let device = select_device(&cfg.device)?;
    let (train_ds, val_ds) = open_data(cfg)?;
    let model = build_model(cfg, &device)?;
    let bs = cfg.train.batch_size;
    check_host_batch(&model, cfg, bs, &format!("train.batch_size = {bs}"), HostPass::Train)?;
    // Checked now, not at the first validation: an abort there would come after an epoch's work.
    if writer && !val_ds.is_empty() {
        let (eval_bs, eval_key) = eval_batch(cfg);
        check_host_batch(&model, cfg, eval_bs.min(val_ds.len()), &format!("{eval_key} = {eval_bs}"), HostPass::Eval)?;
    }
    let mut runner = StepRunner::new(cfg, model)?;
    runner.collective = collective;
    runner.progress = progress;

    let accum = cfg.train.grad_accum;
    // Micro-batches per epoch, the same on every rank (each takes its share of every global batch).
    let batches_per_epoch = crate::dist::steps_per_epoch(train_ds.len(), world, cfg.train.batch_size);
    let steps_per_epoch = batches_per_epoch.div_ceil(accum);
    let mut total_steps = steps_per_epoch.checked_mul(cfg.train.epochs).ok_or_else(|| {
        anyhow!(
            "train.epochs = {}: {} steps per epoch over that many epochs is out of range",
            cfg.train.epochs,
            steps_per_epoch
        )
    })?;
    if cfg.train.max_steps > 0 {
        total_steps = total_steps.min(cfg.train.max_steps);
    }
    let sched = Schedule::new(&cfg.sched, cfg.optim.lr, steps_per_epoch, total_steps);

    let mut state = TrainState {
        format: checkpoint::FORMAT.into(),
        arch: cfg.model.arch.name().to_string(),
        num_classes: cfg.model.num_classes,
        epoch: 0,
        batch_in_epoch: 0,
        step: 0,
        optimizer_steps: 0,
        scaler: runner.scaler.clone(),
        seed: cfg.seed,
        meters: EpochMeters::default(),
        best_top1: None,
        metrics_lines: 0,
        world_size: world,
        batch_size: cfg.train.batch_size,
    };
    let mut metrics_keep = None;
    if let Some(path) = resume_from {
        if writer && checkpoint::latest(&ckpt_dir).is_none() {
            eprintln!("note: no periodic checkpoint in {}: resuming from the best one", ckpt_dir.display());
        }
        let loaded = checkpoint::load(&path)?;
        loaded.check_model(&path, cfg)?;
        weights::load_tensors(&runner.model, &loaded.model, false).map_err(|m| anyhow!("{}: {m}", path.display()))?;
        runner
            .opt
            .load_state(&loaded.optim, loaded.state.optimizer_steps)
            .with_context(|| path.display().to_string())?;
        let scaler = runner.scaler.resumed_from(&loaded.state.scaler);
        if writer && scaler.enabled && !loaded.state.scaler.enabled {
            eprintln!(
                "note: the checkpoint ran without loss scaling; amp.dtype = \"{}\" scales the loss from amp.init_scale = {}",
                cfg.amp.dtype.as_str(),
                cfg.amp.init_scale
            );
        }
        runner.scaler = scaler;
        state = loaded.state;
        state.scaler = runner.scaler.clone();
        state.batch_in_epoch = resume_position(&state, cfg.train.batch_size, world)
            .map_err(|m| anyhow!("--resume from {}: {m}", path.display()))?;
        if state.batch_in_epoch > batches_per_epoch {
            bail!(
                "--resume from {}: it stopped {} batches into epoch {}, which has {batches_per_epoch} with this data \
                 and batch size",
                path.display(),
                state.batch_in_epoch,
                state.epoch + 1
            );
        }
        (state.world_size, state.batch_size) = (world, cfg.train.batch_size);
        metrics_keep = Some(state.metrics_lines);
        if writer {
            eprintln!("resuming from {} (epoch {}, step {})", path.display(), state.epoch + 1, state.step);
        }
    }
    if resume && writer && (state.step >= total_steps || state.epoch >= cfg.train.epochs) {
        eprintln!(
            "note: the checkpoint has finished this run (train.epochs = {}): no steps to take; the run's final outputs \
             are written again (raise train.epochs to train further)",
            cfg.train.epochs
        );
    }
    if writer {
        // The run's folders and resolved config, once the data, the model and a resume's checkpoint are accepted
        // (a refused run leaves the directory as it was).
        std::fs::create_dir_all(&ckpt_dir).with_context(|| format!("cannot create {}", ckpt_dir.display()))?;
        let cfg_path = run_dir.join("config.toml");
        std::fs::write(&cfg_path, cfg.to_toml()).with_context(|| format!("cannot write {}", cfg_path.display()))?;
    }
    let metrics_path = run_dir.join("metrics.jsonl");
    let mut metrics = if writer {
        MetricsWriter::open(&metrics_path, metrics_keep)?
    } else {
        MetricsWriter::discard(&metrics_path, metrics_keep)
    };
    // Rank 0 samples every GPU of its node (ranks on cuda:LOCAL_RANK: ordinals 0..local_world_size).
    let gpus: Vec<u32> = match &ranks_info {
        Some(local) if *local > 1 => (0..*local as u32).collect(),
        _ => vec![cfg.cuda_ordinal()],
    };
    let telemetry: Vec<(u32, crate::telemetry::Telemetry)> = match (&device, cfg.telemetry.enabled && writer) {
        (Device::Cuda(_), true) => gpus
            .iter()
            .filter_map(|&g| {
                let every = std::time::Duration::from_millis(cfg.telemetry.interval_ms.max(50));
                crate::telemetry::Telemetry::start(g, every).map(|t| (g, t))
            })
            .collect(),
        _ => Vec::new(),
    };
    let mut losses = Vec::new();
    let mut last_val = None;

    let save = |runner: &StepRunner, state: &mut TrainState, metrics: &MetricsWriter, name: &str| -> Result<PathBuf> {
        state.scaler = runner.scaler.clone();
        state.optimizer_steps = runner.opt.steps;
        state.metrics_lines = metrics.lines();
        let path = ckpt_dir.join(name);
        if !writer {
            return Ok(path);
        }
        checkpoint::save(&path, &runner.model.store().snapshot()?, &runner.opt.state_tensors()?, state)?;
        Ok(path)
    };

    let show_progress = writer && cfg.log.progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let prune = |keep: usize| if writer { checkpoint::prune(&ckpt_dir, keep) } else { Ok(()) };
    let shard = (world > 1).then_some((rank, world));
    // The next epoch's batches, started as soon as this epoch's last batch has been taken.
    let mut ahead: Option<(usize, BatchSource)> = None;
    'epochs: while state.epoch < cfg.train.epochs {
        if state.step >= total_steps && state.batch_in_epoch == 0 {
            break;
        }
        let epoch = state.epoch;
        let input = input_format(&runner.model, runner.precision);
        let mut loader = match ahead.take() {
            Some((e, l)) if e == epoch && state.batch_in_epoch == 0 => l,
            _ => BatchSource::new(cfg, &train_ds, &device, input, (epoch, state.batch_in_epoch), shard)
                .with_context(|| format!("the data loader of epoch {}", epoch + 1))?,
        };
        let batch_setting = format!("train.batch_size = {}", cfg.train.batch_size);
        let step_failure = |e: anyhow::Error, step: usize| {
            let doing = format!("training step {step} (epoch {})", epoch + 1);
            device_failure(e, &doing, &batch_setting, HostPass::Train, cfg)
        };
        let bar = if show_progress { ProgressBar::new(steps_per_epoch as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{}/{}", epoch + 1, cfg.train.epochs));
        bar.set_position((state.batch_in_epoch / accum) as u64);
        let t_epoch = Instant::now();
        let mut epoch_images = 0usize;
        let mut t_log = Instant::now();
        let mut images_since_log = 0usize;
        // Steps queued on the device whose reports are not read yet: step k's report is read once step k + 1 is
        // queued, so the host never waits for the GPU between steps (at most one step in flight; checkpoints, the
        // epoch's end and GPU-health stops read everything first).
        let mut in_flight: std::collections::VecDeque<(PendingStep, usize, f64, f64)> = Default::default();
        // Seconds the training thread waited for the loader this epoch (with a step in flight the GPU keeps busy
        // for about a step of it; longer waits starve it).
        let mut data_wait = 0.0;
        loop {
            let mut micro = Vec::with_capacity(accum);
            let t_wait = Instant::now();
            if state.step < total_steps {
                for _ in 0..accum {
                    match loader.next() {
                        Some(b) => micro.push(b?),
                        None => break,
                    }
                }
            }
            let waited = t_wait.elapsed().as_secs_f64();
            let queued = !micro.is_empty();
            let mut checkpoint_due = false;
            if queued {
                // Every batch of this epoch taken: the loader of the next one starts now, so that its first
                // batches are decoded while the last steps and the validation of this epoch run (no gap at the
                // boundary).
                let last_step = state.step + 1 >= total_steps;
                if state.batch_in_epoch + micro.len() >= batches_per_epoch && epoch + 1 < cfg.train.epochs && !last_step
                {
                    let next = BatchSource::new(cfg, &train_ds, &device, input, (epoch + 1, 0), shard)
                        .with_context(|| format!("the data loader of epoch {}", epoch + 2))?;
                    ahead = Some((epoch + 1, next));
                }
                let lr = sched.lr(state.step);
                let pending = runner.step_async(&micro, lr).map_err(|e| step_failure(e, state.step + 1))?;
                state.batch_in_epoch += micro.len();
                state.step += 1;
                data_wait += waited;
                in_flight.push_back((pending, state.step, lr, waited));
                checkpoint_due =
                    cfg.checkpoint.every_steps > 0 && state.step.is_multiple_of(cfg.checkpoint.every_steps);
            }
            let events: Vec<crate::telemetry::Event> = telemetry.iter().flat_map(|(_, t)| t.events()).collect();
            let fatal = events.iter().any(|e| matches!(e, crate::telemetry::Event::Fatal(_)));
            let epoch_end = state.batch_in_epoch >= batches_per_epoch || state.step >= total_steps;
            let keep = if !queued || checkpoint_due || fatal || epoch_end { 0 } else { 1 };
            while in_flight.len() > keep {
                let (pending, step, lr, waited) = in_flight.pop_front().expect("a step in flight");
                let out = runner.resolve(pending).map_err(|e| step_failure(e, step))?;
                // Without loss scaling a non-finite loss or gradient means the run diverged: stop, keep the
                // checkpoints (the device skipped the update, so the weights are those of the step before).
                if (!out.loss.is_finite() || out.skipped) && !runner.scaler.enabled {
                    bar.finish_and_clear();
                    let last = checkpoint::latest(&ckpt_dir)
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "none yet".into());
                    let what = if out.loss.is_finite() {
                        format!("gradient norm became {}", out.grad_norm)
                    } else {
                        format!("loss became {}", out.loss)
                    };
                    bail!(
                        "{what} at step {step} (epoch {}, lr {lr:.3e}, {}): training stopped; last good checkpoint: {last}",
                        epoch + 1,
                        cfg.amp.dtype
                    );
                }
                if !out.skipped {
                    state.meters.loss_sum += out.loss * out.samples as f64;
                    state.meters.correct += out.correct;
                    state.meters.seen += out.samples as u64;
                }
                state.meters.steps += 1;
                losses.push(out.loss);
                epoch_images += out.samples;
                images_since_log += out.samples;
                bar.inc(1);
                if step.is_multiple_of(cfg.log.every_steps) || step == total_steps {
                    let ips = images_since_log as f64 / t_log.elapsed().as_secs_f64();
                    t_log = Instant::now();
                    images_since_log = 0;
                    metrics.write(&json!({
                        "kind": "step", "step": step, "epoch": epoch + 1, "loss": out.loss, "lr": lr,
                        "loss_scale": out.loss_scale, "skipped": out.skipped, "grad_norm": out.grad_norm,
                        "img_per_s": ips, "data_wait_ms": 1000.0 * waited,
                    }))?;
                    let acc = 100.0 * state.meters.correct as f64 / state.meters.seen.max(1) as f64;
                    let mut msg = format!(
                        "loss {:.4} acc {acc:.1}% lr {lr:.2e} scale {} {ips:.0} img/s",
                        out.loss, out.loss_scale
                    );
                    for (g, t) in &telemetry {
                        if let Some(sample) = t.latest() {
                            let mut rec = serde_json::to_value(&sample)?;
                            rec["kind"] = json!("telemetry");
                            rec["step"] = json!(step);
                            if telemetry.len() > 1 {
                                rec["gpu"] = json!(g);
                            }
                            metrics.write(&rec)?;
                        }
                        let prefix = if telemetry.len() > 1 { format!("gpu{g} ") } else { String::new() };
                        msg.push_str(&format!(" | {prefix}{}", t.summary()));
                    }
                    bar.set_message(msg);
                }
            }
            for ev in events {
                match ev {
                    crate::telemetry::Event::Warning(w) => bar.suspend(|| eprintln!("warning: {w}")),
                    crate::telemetry::Event::Fatal(f) => {
                        bar.finish_and_clear();
                        let name = checkpoint::step_name(state.step);
                        let p = save(&runner, &mut state, &metrics, &name)?;
                        bail!("GPU health: {f}; checkpoint saved to {} and training stopped", p.display());
                    }
                }
            }
            if checkpoint_due {
                let name = checkpoint::step_name(state.step);
                save(&runner, &mut state, &metrics, &name)?;
                prune(cfg.checkpoint.keep_last)?;
            }
            if !queued || state.step >= total_steps {
                break;
            }
        }
        bar.finish_and_clear();
        let epoch_done = state.batch_in_epoch >= batches_per_epoch;
        let train_ips = epoch_images as f64 / t_epoch.elapsed().as_secs_f64();
        // The loader's own rate (decode + augment time of its threads): it keeps the GPU fed while above train_ips.
        let loader_ips = loader.images_per_sec();
        drop(loader);
        let train_loss = state.meters.loss_sum / state.meters.seen.max(1) as f64;
        let train_top1 = 100.0 * state.meters.correct as f64 / state.meters.seen.max(1) as f64;
        // Rank 0 validates alone (the others go on to the next epoch's first all-reduce and wait there).
        let val = if writer && !val_ds.is_empty() {
            let doing = format!("validation after epoch {}", epoch + 1);
            Some(validate(&runner.model, val_ds.clone(), cfg, runner.precision, &doing)?)
        } else {
            None
        };
        metrics.write(&json!({
            "kind": "epoch", "epoch": epoch + 1, "step": state.step, "train_loss": train_loss, "train_top1": train_top1,
            "val_loss": val.map(|v| v.loss), "val_top1": val.map(|v| v.top1), "val_top5": val.map(|v| v.top5),
            "img_per_s": train_ips, "loader_img_per_s": loader_ips, "data_wait_s": data_wait, "complete": epoch_done,
        }))?;
        if writer {
            eprintln!(
                "epoch {}/{}: train loss {train_loss:.4} top1 {train_top1:.2}%{} | {train_ips:.1} img/s (loader {loader_ips:.0} img/s{}, waited {data_wait:.2} s for data)",
                epoch + 1,
                cfg.train.epochs,
                val.map(|v| format!(" | val loss {:.4} top1 {:.2}% top5 {:.2}%", v.loss, v.top1, v.top5))
                    .unwrap_or_default(),
                if world > 1 { " on rank 0" } else { "" }
            );
        }
        last_val = val;
        if epoch_done {
            state.epoch += 1;
            state.batch_in_epoch = 0;
            state.meters = EpochMeters::default();
        }
        let last = state.epoch >= cfg.train.epochs || state.step >= total_steps;
        if let Some(v) = val {
            if v.loss.is_finite() && state.best_top1.is_none_or(|b| v.top1 > b) {
                state.best_top1 = Some(v.top1);
                save(&runner, &mut state, &metrics, "best.safetensors")?;
            }
        }
        if last || (cfg.checkpoint.every_epochs > 0 && state.epoch.is_multiple_of(cfg.checkpoint.every_epochs)) {
            let name = checkpoint::step_name(state.step);
            save(&runner, &mut state, &metrics, &name)?;
            prune(cfg.checkpoint.keep_last)?;
        }
        if last {
            break 'epochs;
        }
    }
    drop(telemetry);
    if writer {
        weights::save(&runner.model, &run_dir.join("model.safetensors"))?;
        // curves.png and curves.svg (same plot; the SVG's text is real text).
        if let Err(e) = crate::plot::training_curves(metrics.path(), &run_dir.join("curves.png")) {
            eprintln!("warning: no training-curve plot: {e:#}");
        }
    }
    Ok(Summary {
        steps: state.step,
        last_loss: losses.last().copied().unwrap_or(f64::NAN),
        losses,
        val: last_val,
        best_top1: state.best_top1,
        run_dir: run_dir.to_path_buf(),
    })
}
