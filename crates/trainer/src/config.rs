//! Typed run configuration: nested TOML sections, unknown keys rejected, `--set a.b=value` overrides.
//! Every default lives here, in the `Default` impls.

use anyhow::{anyhow, bail, Context, Result};
pub use kernels::{ConvChoice, MatmulChoice};
pub use resnet::{Arch, Precision, Stem};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Seed of initialisation, data order and augmentation.
    pub seed: u64,
    /// "cpu", "cuda" or "cuda:N".
    pub device: String,
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub optim: OptimSection,
    pub sched: SchedSection,
    pub amp: AmpSection,
    pub checkpoint: CheckpointSection,
    pub log: LogSection,
    pub finetune: FinetuneSection,
    pub kernels: KernelsSection,
    pub telemetry: TelemetrySection,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 0,
            device: "cpu".into(),
            model: Default::default(),
            data: Default::default(),
            train: Default::default(),
            optim: Default::default(),
            sched: Default::default(),
            amp: Default::default(),
            checkpoint: Default::default(),
            log: Default::default(),
            finetune: Default::default(),
            kernels: Default::default(),
            telemetry: Default::default(),
        }
    }
}

/// `optim.name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimName {
    Sgd,
    AdamW,
}

/// `sched.name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedName {
    Cosine,
    Step,
    MultiStep,
    Constant,
}

/// `amp.loss_scaling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossScaling {
    /// On for fp16 only.
    Auto,
    On,
    Off,
}

/// `train.grad_allreduce`: the dtype data-parallel gradients travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradAllreduce {
    /// FP32: the sum is exact up to FP32 rounding.
    Fp32,
    /// bf16: half the bytes on the wire; each rank's gradient rounded to bf16 (~0.4%) and summed in bf16.
    Bf16,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// resnet18 | resnet34 | resnet50 | resnet101 | resnet152
    pub arch: Arch,
    pub num_classes: usize,
    /// "imagenet" (7x7/2 conv + max-pool) | "cifar" (3x3/1 conv, no pool)
    pub stem: Stem,
    /// torchvision-format safetensors (or a checkpoint's model.safetensors) to start from; "" for none.
    pub init_from: String,
    pub zero_init_residual: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            arch: Arch::ResNet50,
            num_classes: 1000,
            stem: Stem::ImageNet,
            init_from: String::new(),
            zero_init_residual: false,
        }
    }
}

/// `data.kind`: where images come from.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Deterministic random images and labels (benchmarks).
    Synthetic,
    /// A built-in generated, learnable data set.
    Shapes,
    /// The CIFAR-10 binary version in `data.dir`.
    Cifar10,
    /// torchvision's ImageFolder layout in `data.train_dir` / `data.val_dir`.
    Imagefolder,
    /// Shards written by `trainer prepare` in `data.dir`.
    Packed,
}

impl DataKind {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            DataKind::Synthetic => "synthetic",
            DataKind::Shapes => "shapes",
            DataKind::Cifar10 => "cifar10",
            DataKind::Imagefolder => "imagefolder",
            DataKind::Packed => "packed",
        }
    }
}

/// `data.augment`: training-time augmentation.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Augment {
    None,
    /// RandomResizedCrop + flip (> 64 px), pad-4 random crop + flip (small images).
    Standard,
}

/// `data.on_corrupt`: what an unreadable image does.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OnCorrupt {
    /// Stop, naming the file.
    Error,
    /// Warn, naming the file, and use another sample.
    Skip,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    pub kind: DataKind,
    /// cifar10: folder with data_batch_1..5.bin and test_batch.bin; packed: the folder `trainer prepare` wrote
    pub dir: String,
    /// imagefolder (and `trainer prepare`'s input): one sub-folder per class
    pub train_dir: String,
    pub val_dir: String,
    /// synthetic / shapes: number of training samples (validation: num_samples / 5)
    pub num_samples: usize,
    pub image_size: usize,
    /// Validation: shorter side resized to this, then center-cropped to image_size.
    pub val_resize: usize,
    pub augment: Augment,
    /// Loader threads (0: one per core).
    pub workers: usize,
    /// Batches prepared ahead of the training step.
    pub prefetch: usize,
    pub on_corrupt: OnCorrupt,
    /// `trainer prepare`: longest side of the packed images (larger ones are shrunk and re-encoded).
    pub pack_max_side: usize,
    /// `trainer prepare`: JPEG quality of re-encoded images.
    pub pack_quality: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            kind: DataKind::Synthetic,
            dir: String::new(),
            train_dir: String::new(),
            val_dir: String::new(),
            num_samples: 1024,
            image_size: 224,
            val_resize: 256,
            augment: Augment::Standard,
            workers: 0,
            prefetch: 4,
            on_corrupt: OnCorrupt::Error,
            pack_max_side: 320,
            pack_quality: 90,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    pub epochs: usize,
    pub batch_size: usize,
    /// Stop after this many optimizer steps (0: no limit).
    pub max_steps: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Global-norm gradient clipping (0: off).
    pub clip_grad_norm: f64,
    pub label_smoothing: f64,
    /// Validation batch size (0: train.batch_size).
    pub eval_batch_size: usize,
    /// Data-parallel runs: BatchNorm statistics (and their gradient sums) over the global batch, all-reduced
    /// across the ranks every layer (the fused step only). Off: each GPU normalises with its own batch.
    pub sync_bn: bool,
    /// Data-parallel runs: a rank that has not reached a collective (gradient all-reduce, synchronised
    /// BatchNorm) this many seconds after another rank did is declared hung, and every rank stops naming it.
    /// Must exceed rank 0's validation and checkpoint time (the other ranks wait for it then).
    pub stall_timeout_s: f64,
    /// Data-parallel runs: "fp32" or "bf16", the dtype of the gradient all-reduce.
    pub grad_allreduce: GradAllreduce,
    /// Data-parallel runs: the gradients are all-reduced in buckets of about this many MB (of FP32 gradient),
    /// each started as soon as the fused step's backward has made it final (PyTorch DDP's bucket_cap_mb).
    pub bucket_mb: f64,
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 32,
            max_steps: 0,
            grad_accum: 1,
            clip_grad_norm: 0.0,
            label_smoothing: 0.0,
            eval_batch_size: 0,
            sync_bn: false,
            stall_timeout_s: 600.0,
            grad_allreduce: GradAllreduce::Fp32,
            bucket_mb: 25.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    /// "sgd" | "adamw"
    pub name: OptimName,
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// No weight decay on BatchNorm parameters and biases.
    pub no_decay_bn_bias: bool,
    /// AdamW betas and epsilon.
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

impl Default for OptimSection {
    fn default() -> Self {
        Self {
            name: OptimName::Sgd,
            lr: 0.1,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 1e-4,
            no_decay_bn_bias: false,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SchedSection {
    /// "cosine" | "step" | "multistep" | "constant"
    pub name: SchedName,
    /// Linear warm-up from warmup_start_factor * lr (fractional epochs allowed).
    pub warmup_epochs: f64,
    pub warmup_start_factor: f64,
    /// step: multiply by gamma every step_epochs epochs.
    pub step_epochs: usize,
    /// multistep: multiply by gamma at each of these epochs.
    pub milestones: Vec<usize>,
    pub gamma: f64,
    /// cosine: final learning rate.
    pub min_lr: f64,
}

impl Default for SchedSection {
    fn default() -> Self {
        Self {
            name: SchedName::Cosine,
            warmup_epochs: 0.0,
            warmup_start_factor: 0.01,
            step_epochs: 30,
            milestones: vec![],
            gamma: 0.1,
            min_lr: 0.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AmpSection {
    /// "fp32" | "bf16" | "fp16"
    pub dtype: Precision,
    /// Dynamic loss scaling: "auto" (on for fp16 only) | "on" | "off"
    pub loss_scaling: LossScaling,
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// Clamps of the scale (0: none).
    pub min_scale: f64,
    pub max_scale: f64,
}

impl Default for AmpSection {
    fn default() -> Self {
        Self {
            dtype: Precision::F32,
            loss_scaling: LossScaling::Auto,
            init_scale: 1024.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 0.0,
            max_scale: 0.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save at the end of every N epochs (0: only at the end of training).
    pub every_epochs: usize,
    /// Save every N optimizer steps (0: off).
    pub every_steps: usize,
    /// Keep the newest N step/epoch checkpoints (the best is kept apart).
    pub keep_last: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self { every_epochs: 1, every_steps: 0, keep_last: 3 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// A metrics.jsonl step record every N optimizer steps.
    pub every_steps: usize,
    /// Show the progress bar (off in tests and non-terminals).
    pub progress: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        Self { every_steps: 10, progress: true }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FinetuneSection {
    /// Module-name prefixes whose parameters get no gradient and no optimizer state.
    pub freeze: Vec<String>,
    /// Learning-rate multiplier of the fc head.
    pub head_lr_mult: f64,
    /// BatchNorm layers use and keep their running statistics during training.
    pub bn_frozen: bool,
}

impl Default for FinetuneSection {
    fn default() -> Self {
        Self { freeze: vec![], head_lr_mult: 1.0, bn_frozen: false }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KernelsSection {
    /// "auto" (custom on CUDA in bf16/fp16, fwdconv elsewhere) | "fwdconv" (candle's conv2d forward, backward
    /// through forward convs) | "candle" (candle's conv2d and its conv_transpose2d backward) | "custom"
    /// (channels-last implicit-GEMM tensor-core convs on CUDA for bf16/fp16, candle's conv through permutes on the
    /// CPU and in fp32; the whole model then runs NHWC)
    pub conv: ConvChoice,
    /// "auto" (custom on CUDA in bf16/fp16, cublas elsewhere) | "cublas" (candle's built-in matmul) | "custom"
    /// (our tensor-core GEMM for `fc` on CUDA in bf16/fp16, with the bias add fused; candle's matmul otherwise)
    pub matmul: MatmulChoice,
    /// Time every tile variant of the custom kernels on the first launch of each shape and keep the fastest
    /// (false: a fixed heuristic picks the tile)
    pub autotune: bool,
    /// Where autotuned choices persist across runs: "auto" (`$XDG_CACHE_HOME` or `~/.cache`,
    /// `resnet-train/kernels-autotune.tsv`), "off" (memory only), or a file path
    pub autotune_cache: String,
    /// "auto" (the explicit step on CUDA in bf16/fp16 where the config allows it, autograd elsewhere, with a
    /// one-line note naming the setting that forced autograd) | "fused" (the explicit, fused training step of
    /// `resnet::step`; needs the channels-last model, and f32 on the CPU) | "autograd" (candle's backward over
    /// the model's forward: the reference)
    pub step: StepChoice,
    /// Activation memory against recomputation in the fused step: "none" keeps every tensor the backward
    /// reads (the ImageNet stem's max-pool keeps its argmax offsets, a byte per output, not its input, at every
    /// level); "relu" drops the post-ReLU activations inside each block, which the backward makes again from the saved pre-BatchNorm outputs (one element-wise pass each);
    /// "relu+conv" also drops each block's last conv output and its downsample conv output and runs those convs
    /// again in the backward. Same gradients bit for bit at every level. ResNet-152 bf16 at batch 256 on the H200
    /// (2026-12-05): peak 21.8 / 18.6 / 11.8 GiB at 3,196 / 3,100 / 2,947 img/s (separate BatchNorm launches);
    /// `sweep --max` with "relu+conv" reached batch 2,560.
    pub recompute: RecomputeChoice,
    /// CUDA graphs for the fused step: "off" | "auto" (the default: on where they can run: the fused step on
    /// CUDA, one process, no `bench --phases`) | "on" (the same, and an error where they cannot run). The first
    /// step of a batch shape runs eagerly (it tunes the kernels), the second is captured as one graph, and every
    /// later step of that shape replays it: one launch per step. Other shapes (an epoch's last, smaller batch) run
    /// eagerly. On the H100 (2026-12-05) `graph_replay_matches_eager_steps` passed (ten SGD and ten AdamW steps
    /// with skipped fp16 steps equal bit for bit to the eager ones) and the replay ran ResNet-152 bf16 at 2,731
    /// img/s against 2,641 eager
    pub graph: GraphChoice,
    /// Where the fused step's BatchNorm reductions run: "pass" (each its own pass: the moments over each conv
    /// output, the backward sums over each BatchNorm's input and output gradient) or "fused" (inside the kernels
    /// next to them: the moments in the epilogue of the convolution before the BatchNorm, on the TMA tiles of an
    /// sm_90a GPU; the block output BatchNorm's backward sums in the pass that makes the block's ReLU gradient,
    /// an inner BatchNorm's in the epilogue of the grad-input that makes its output gradient; small launches then
    /// combine the partials as the passes' finalisers do), or one half of it: "forward" (the moments only) or
    /// "backward" (the sums only), to tell their costs apart; or "auto": "fused", with each convolution shape
    /// keeping its reduction in the epilogue only where the plain convolution and the pass were timed slower on
    /// first use (with `kernels.autotune`; remembered in the autotune cache, as `epilogue` or `pass`). With
    /// `kernels.bn_cooperative` each cooperative forward takes the epilogue's moments and skips its own moments
    /// phase, and each cooperative backward whose sums came from a grad-input epilogue reduces those partials in
    /// its own launch. The default is "fused" since 2026-12-07 (evening): three warps of a TMA kernel's producer
    /// warpgroup take both reductions from the tile its consumers stage for the store, under the next tile's
    /// MMAs (the moments, and at x128 / x64 the backward sums with a z tile beside it), and on an H100
    /// ResNet-152 at batch 256 ran 3,321.8 img/s bf16 with "fused" against 3,306.3 with "forward" (+0.47%;
    /// fp16 3,317.5 against 3,300.2, +0.52%), 987 kernels a step; "forward" had been the default since that
    /// morning (+2.2% over "pass")
    pub bn_stats: BnStatsChoice,
    /// The fused step on CUDA runs each BatchNorm as one cooperative launch forward (moments, finaliser,
    /// normalisation + ReLU; with `kernels.bn_stats` moving the moments into the conv's epilogue, without the
    /// moments phase) and one backward (sums, finaliser, grad-input; with the sums from a grad-input's epilogue,
    /// without the sums phase), with grid-wide barriers
    /// between the phases, instead of three launches each; a block's last BatchNorm with an identity shortcut
    /// also makes the block output relu(bn(z) + x) in its forward launch, and every block's last BatchNorm takes
    /// the block output's ReLU gradient into its backward launch, and a downsample block's two BatchNorms make
    /// the block output in one forward launch: about 670 launches fewer a ResNet-152 step, the same results bit
    /// for bit. Frozen and synchronised BatchNorms keep the separate launches. On by default: on the H100
    /// (2026-12-05) its GPU tests passed (every kernel bit for bit against the separate launches; ten fp16 steps
    /// eager and replayed from a CUDA graph bit for bit) and ResNet-152 ran 2% faster (bf16 2,787 img/s against
    /// 2,731; 986 kernels a step against 1,657)
    pub bn_cooperative: bool,
    /// The fused step on CUDA normalises each bottleneck's conv3 input, relu(bn2(z2)), inside that 1x1
    /// convolution's TMA GEMM (on an sm_90a GPU in bf16/fp16) instead of keeping it: "off" (the default),
    /// "backward" (the grad-weight normalises z2 as it reads it: the activation is not kept for the backward) or
    /// "both" (the forward conv3 too: bn2's forward keeps its statistics only, and the activation is never
    /// written). The same values bit for bit. A memory option: ResNet-152 bf16 batch 256 holds 1.59 GiB less
    /// (20.25 GiB against 21.84 at the allocator) either way; "both" runs 1.6% slower on the H200 and 1.0% on an
    /// H100 (2026-12-06: the normalisation costs the GEMMs more than the pass it saves; docs/BENCHMARKS.md).
    /// `KERNELS_BN_APPLY_IN_CONV=backward` or `both` in the environment sets it where this is "off"
    pub bn_apply_in_conv: BnApplyInConvChoice,
    /// The fused step on CUDA folds each block-output join (the ReLU gradient at a block's output, the sum of the
    /// next block's main-path and shortcut gradients) into the grad-input of the next bottleneck's conv1 (1x1,
    /// identity shortcut): its TMA GEMM's store adds the shortcut gradient and applies the block output's ReLU
    /// mask, so the block's last BatchNorm backward reads one joined gradient instead of two gradients and the
    /// mask. The same values bit for bit. Needs the cooperative BatchNorm (`kernels.bn_cooperative`); elsewhere,
    /// and where the epilogue cannot run, the join stays its own pass. With `kernels.bn_stats` "fused" or
    /// "backward" (not "auto") the same GEMM also takes that last BatchNorm's backward sums from the joined values
    /// (statistics warps of its producer warpgroup, `gemm_nn_joinsw_*`), and the BatchNorm's cooperative backward
    /// reduces those partials instead of running its own sums phase (equal to rounding: the sums are added in
    /// another order); `KERNELS_JOIN_SUMS=0` in the environment keeps the sums phase. On by default;
    /// `KERNELS_JOIN_IN_CONV=0` (or 1) in the environment overrides this value
    pub join_in_conv: bool,
    /// The fused step on CUDA in bf16/fp16 reads its conv weights from a copy in the activation dtype and the
    /// kernels' (k, r, s, c) layout that the optimizer's update writes as it updates the FP32 masters, instead of
    /// casting and permuting every weight at the start of each step (one launch, 0.22 ms a ResNet-152 step on the
    /// H200). The same values bit for bit. On by default; `KERNELS_WEIGHTS_IN_OPTIMIZER=0` (or 1) in the
    /// environment overrides this value
    pub weights_in_optimizer: bool,
}

/// `KERNELS_WEIGHTS_IN_OPTIMIZER` in the environment: `Some(false)` for 0, `Some(true)` for 1, None when unset or
/// anything else (an A/B switch of [`KernelsSection::weights_in_optimizer`]).
pub fn weights_in_optimizer_env() -> Option<bool> {
    match std::env::var("KERNELS_WEIGHTS_IN_OPTIMIZER").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    }
}

impl KernelsSection {
    /// [`Self::weights_in_optimizer`] with the environment's override.
    pub fn weights_in_optimizer(&self) -> bool {
        weights_in_optimizer_env().unwrap_or(self.weights_in_optimizer)
    }
}

impl Default for KernelsSection {
    fn default() -> Self {
        Self {
            conv: ConvChoice::Auto,
            matmul: MatmulChoice::Auto,
            autotune: true,
            autotune_cache: "auto".into(),
            step: StepChoice::Auto,
            recompute: RecomputeChoice::None,
            graph: GraphChoice::Auto,
            bn_stats: BnStatsChoice::Fused,
            bn_cooperative: true,
            bn_apply_in_conv: BnApplyInConvChoice::Off,
            join_in_conv: true,
            weights_in_optimizer: true,
        }
    }
}

/// `kernels.bn_apply_in_conv`: where a bottleneck's conv3 input is normalised.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BnApplyInConvChoice {
    Off,
    Backward,
    Both,
}

/// `kernels.bn_stats`: where the fused step's BatchNorm reductions run.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BnStatsChoice {
    Pass,
    Fused,
    /// "fused" where the epilogue was timed faster, per convolution shape.
    Auto,
    /// Only the forward's moments from the conv epilogues.
    Forward,
    /// Only the backward's sums from the kernels that make the gradients.
    Backward,
}

impl BnStatsChoice {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fused => "fused",
            Self::Auto => "auto",
            Self::Forward => "forward",
            Self::Backward => "backward",
        }
    }
}

/// `kernels.graph`: whether the fused step is captured as a CUDA graph and replayed.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GraphChoice {
    Auto,
    On,
    Off,
}

impl GraphChoice {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

/// `kernels.step`: which engine runs the training step's forward and backward.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StepChoice {
    Auto,
    Fused,
    Autograd,
}

/// `kernels.recompute`: what the fused step's forward drops and its backward recomputes
/// ([`resnet::step::Recompute`]).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum RecomputeChoice {
    #[serde(rename = "none")]
    None,
    #[serde(rename = "relu")]
    Relu,
    #[serde(rename = "relu+conv")]
    ReluConv,
}

impl RecomputeChoice {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Relu => "relu",
            Self::ReluConv => "relu+conv",
        }
    }

    pub fn level(self) -> resnet::step::Recompute {
        match self {
            Self::None => resnet::step::Recompute::None,
            Self::Relu => resnet::step::Recompute::Relu,
            Self::ReluConv => resnet::step::Recompute::ReluConv,
        }
    }
}

/// The engine a run's training steps take (`kernels.step` resolved).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepEngine {
    /// `resnet::step`: explicit forward and backward, fused element-wise kernels.
    Fused,
    /// candle's autograd over `ResNet::forward`.
    Autograd,
}

impl std::fmt::Display for StepEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Fused => "fused",
            Self::Autograd => "autograd",
        })
    }
}

impl KernelsSection {
    /// The autotune file `autotune_cache` names (None for "off", or for "auto" without a home directory).
    pub fn autotune_cache_path(&self) -> Option<PathBuf> {
        self.autotune_cache_path_in(|k| std::env::var_os(k))
    }

    /// [`Self::autotune_cache_path`] with the environment given (`XDG_CACHE_HOME`, `HOME`).
    fn autotune_cache_path_in(&self, env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
        match self.autotune_cache.as_str() {
            "off" => None,
            "auto" => env("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| env("HOME").map(|h| Path::new(&h).join(".cache")))
                .map(|d| d.join("resnet-train").join("kernels-autotune.tsv")),
            p => Some(PathBuf::from(p)),
        }
    }

    /// The step engine for a model running channels-last or not (`channels_last`, from [`Self::policy`]) in
    /// `precision` on a CUDA device (`cuda`) or the CPU, and under "auto" the note saying which setting kept it on
    /// autograd (None when "auto" took the fused step, or autograd was asked for). "fused" where it cannot run is
    /// an error naming the key.
    pub fn step_engine(
        &self,
        channels_last: bool,
        precision: Precision,
        cuda: bool,
    ) -> Result<(StepEngine, Option<String>)> {
        let why = resnet::step::unsupported_for(channels_last, cuda, precision);
        Ok(match (self.step, why) {
            (StepChoice::Autograd, _) => (StepEngine::Autograd, None),
            (StepChoice::Fused, None) => (StepEngine::Fused, None),
            (StepChoice::Fused, Some(why)) => bail!("kernels.step = \"fused\" cannot run this config: {why}"),
            (StepChoice::Auto, Some(why)) => {
                (StepEngine::Autograd, Some(format!("kernels.step = \"auto\" runs autograd: {why}")))
            }
            (StepChoice::Auto, None) if cuda && precision != Precision::F32 => (StepEngine::Fused, None),
            (StepChoice::Auto, None) => (
                StepEngine::Autograd,
                Some(format!(
                    "kernels.step = \"auto\" runs autograd: the fused step is taken on CUDA in bf16/fp16, this run is {} on {}",
                    precision.as_str(),
                    if cuda { "cuda" } else { "cpu" }
                )),
            ),
        })
    }

    /// The kernel policy for a model on a CUDA device (`cuda`) or the CPU computing in `precision`: "auto"
    /// resolved, and the autotuner with its cache file (or the heuristic when `autotune` is off).
    pub fn policy(&self, cuda: bool, precision: Precision) -> Result<kernels::KernelPolicy> {
        let act = precision.act_dtype();
        let tuning = if !self.autotune {
            kernels::Tuning::Heuristic
        } else {
            let tuner = match self.autotune_cache_path() {
                Some(p) => kernels::Autotuner::with_file(&p).map_err(|e| anyhow!("kernels.autotune_cache: {e}"))?,
                None => kernels::Autotuner::in_memory(),
            };
            kernels::Tuning::Autotune(std::sync::Arc::new(tuner))
        };
        Ok(kernels::KernelPolicy {
            conv: self.conv.resolve(cuda, act),
            matmul: self.matmul.resolve(cuda, act),
            tuning,
            bn_stats_in_conv: matches!(
                self.bn_stats,
                BnStatsChoice::Fused | BnStatsChoice::Auto | BnStatsChoice::Forward
            ),
            bn_sums_in_backward: matches!(
                self.bn_stats,
                BnStatsChoice::Fused | BnStatsChoice::Auto | BnStatsChoice::Backward
            ),
            bn_epilogue_by_timing: self.bn_stats == BnStatsChoice::Auto,
            // The cooperative kernels are CUDA's; on the CPU the separate passes are the same computation.
            bn_cooperative: self.bn_cooperative && cuda,
            bn_apply_in_conv: match self.bn_apply_in_conv {
                BnApplyInConvChoice::Off => kernels::ops::batchnorm::bn_apply_in_conv(),
                BnApplyInConvChoice::Backward => kernels::BnApplyInConv::Backward,
                BnApplyInConvChoice::Both => kernels::BnApplyInConv::Both,
            },
            join_in_conv: kernels::ops::batchnorm::join_in_conv_env().unwrap_or(self.join_in_conv),
            ..Default::default()
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    /// Sample GPU telemetry through NVML (CUDA devices only; missing NVML never stops training).
    pub enabled: bool,
    pub interval_ms: u64,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        Self { enabled: true, interval_ms: 1000 }
    }
}

/// Finds a config: the path as given, else the bare name inside `configs/` (of the working directory, then of
/// the repository this binary was built from).
pub fn resolve_path(name: &str) -> Result<PathBuf> {
    let p = PathBuf::from(name);
    if p.is_file() {
        return Ok(p);
    }
    if p.is_dir() {
        bail!("config file `{name}` is a folder (give the path of a .toml file)");
    }
    let mut tried = vec![p.display().to_string()];
    if p.components().count() == 1 {
        for base in [PathBuf::from("configs"), Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")] {
            let c = base.join(name);
            if c.is_file() {
                return Ok(c);
            }
            tried.push(c.display().to_string());
        }
    }
    bail!("config file `{name}` not found (looked at {})", tried.join(", "))
}

/// Parses a device spec: `Some(None)` for "cpu", `Some(Some(n))` for "cuda" (n = 0) or "cuda:n", `None` if invalid.
pub fn parse_device(spec: &str) -> Option<Option<u32>> {
    match spec {
        "cpu" => Some(None),
        "cuda" => Some(Some(0)),
        s => s.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(Some),
    }
}

impl Config {
    /// The CUDA ordinal of `device` (0 for "cpu", which has none).
    pub fn cuda_ordinal(&self) -> u32 {
        parse_device(&self.device).flatten().unwrap_or(0)
    }
}

/// Parses an override value as a TOML value, falling back to a plain string (`resnet18`, `cuda:0`).
fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match doc.parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

/// Applies one `a.b=value` override to a TOML tree; the key must exist in the schema. Returns the dotted key.
fn apply_override(root: &mut toml::Table, schema: &toml::Table, spec: &str) -> Result<String> {
    let spec = spec.trim();
    let (key, raw) = spec.split_once('=').ok_or_else(|| anyhow!("--set `{spec}`: expected key=value"))?;
    let (key, raw) = (key.trim(), raw.trim());
    if key.is_empty() {
        bail!("--set {spec}: empty key (expected key=value, e.g. train.batch_size=64)");
    }
    let parts: Vec<&str> = key.split('.').collect();
    let mut sch = schema;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        match sch.get(*part) {
            Some(toml::Value::Table(t)) if !last => sch = t,
            Some(toml::Value::Table(_)) => bail!("--set {spec}: `{key}` is a section, not a key"),
            Some(_) if last => {}
            _ => bail!("--set {spec}: unknown config key `{key}`"),
        }
    }
    let mut node = root;
    for part in &parts[..parts.len() - 1] {
        node = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .ok_or_else(|| anyhow!("--set {spec}: `{part}` is not a section in the config file"))?;
    }
    let value = match (lookup(schema, &parts), parse_value(raw)) {
        // A float key given an integer literal (`optim.lr=1`) is still a float, and so is a number too long for a
        // TOML integer (`optim.lr=99999999999999999999`).
        (Some(toml::Value::Float(_)), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
        (Some(toml::Value::Float(_)), v @ toml::Value::String(_)) => raw.parse().map(toml::Value::Float).unwrap_or(v),
        // Digits TOML could not read as an integer: beyond its 64-bit range.
        (Some(toml::Value::Integer(_)), toml::Value::String(_)) if integer_text(raw) => {
            let why = if raw.starts_with('-') { "must not be negative" } else { "is too large" };
            bail!("--set {spec}: {key} = {raw} {why}")
        }
        // A name or a path is the text typed, whatever TOML would read it as (`model.arch=18`, `data.dir=2024`).
        (Some(toml::Value::String(_)), v) if !v.is_str() => toml::Value::String(raw.to_string()),
        (_, v) => v,
    };
    node.insert(parts[parts.len() - 1].to_string(), value);
    Ok(key.to_string())
}

fn lookup<'a>(t: &'a toml::Table, parts: &[&str]) -> Option<&'a toml::Value> {
    let (first, rest) = parts.split_first()?;
    let v = t.get(*first)?;
    if rest.is_empty() {
        Some(v)
    } else {
        lookup(v.as_table()?, rest)
    }
}

/// A one-line error `msg` prefixed with where its culprit came from: the final `--set` of each key it names
/// (`--set optim.lr=-1: optim.lr must be ...`), else the config file (`origin`).
fn blame(origin: &str, sets: &[(String, &str)], msg: String) -> anyhow::Error {
    let named: Vec<&str> = sets.iter().filter(|(k, _)| names_key(&msg, k)).map(|(_, s)| *s).collect();
    if named.is_empty() {
        anyhow!("{origin}: {msg}")
    } else {
        anyhow!("--set {}: {msg}", named.join(" --set "))
    }
}

/// Whether an error message names `key`: a dotted key as a word anywhere, a top-level one (`device`) only as its
/// first word (the messages use "device" as a plain word too).
fn names_key(msg: &str, key: &str) -> bool {
    let mut words = msg.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')).filter(|w| !w.is_empty());
    if key.contains('.') {
        words.any(|w| w.trim_end_matches('.') == key)
    } else {
        words.next() == Some(key)
    }
}

impl Config {
    /// Parses TOML text plus overrides. Errors are one line naming the key and the value, prefixed with where the
    /// value came from: the `--set` that gave it, else the file (`origin`).
    pub fn from_str_with(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        let mut table: toml::Table =
            text.parse().map_err(|e: toml::de::Error| anyhow!("{origin}: {}", one_line(&e.to_string())))?;
        let schema = toml::Table::try_from(Config::default()).context("serialising the default config")?;
        // Integers where floats are expected (lr = 1) are accepted in files as well.
        coerce_floats(&mut table, &schema);
        // The last `--set` of each key: its value is the one checked.
        let mut sets: Vec<(String, &str)> = Vec::new();
        for o in overrides {
            let key = apply_override(&mut table, &schema, o)?;
            sets.retain(|(k, _)| *k != key);
            sets.push((key, o.trim()));
        }
        let cfg: Config = Config::deserialize(toml::Value::Table(table.clone()))
            .map_err(|e| blame(origin, &sets, value_error(&e, &table, &schema)))?;
        cfg.validate().map_err(|e| blame(origin, &sets, format!("{e:#}")))?;
        Ok(cfg)
    }

    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_str_with(&text, &path.display().to_string(), overrides)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot serialise config: {e}"))
    }

    /// Checks values that types alone do not (names from fixed sets, sizes and counts within what a run can hold,
    /// numbers within the ranges PyTorch allows or that make sense, keys that must agree). Each error is one line
    /// naming the key and the value.
    pub fn validate(&self) -> Result<()> {
        if self.kernels.autotune_cache.is_empty() {
            bail!("kernels.autotune_cache is empty (\"auto\", \"off\" or a file path)");
        }
        if parse_device(&self.device).is_none() {
            bail!("device = \"{}\" is not one of cpu, cuda, cuda:N", self.device);
        }
        // Counts and sizes: (key, value, least, most). The upper bounds keep absurd values from failing late: an
        // allocation (the loader holds 8 bytes of epoch order per sample; the head num_classes x 2048 weights), an
        // overflow of epochs x steps, minutes spent starting threads. Image sizes: the data transforms' range.
        // amp.growth_interval: the device counts clean steps in f32, which cannot count past 2^24.
        for (k, v, least, most) in [
            ("model.num_classes", self.model.num_classes, 2, 1_000_000),
            ("data.image_size", self.data.image_size, 1, 16384),
            ("data.val_resize", self.data.val_resize, 1, 16384),
            ("data.num_samples", self.data.num_samples, 1, 100_000_000),
            ("data.workers", self.data.workers, 0, 1024),
            ("data.prefetch", self.data.prefetch, 1, 1024),
            ("data.pack_max_side", self.data.pack_max_side, 16, 65535),
            ("data.pack_quality", self.data.pack_quality, 1, 100),
            ("train.epochs", self.train.epochs, 1, 1_000_000),
            ("train.batch_size", self.train.batch_size, 1, 1 << 20),
            ("train.eval_batch_size", self.train.eval_batch_size, 0, 1 << 20),
            ("train.grad_accum", self.train.grad_accum, 1, 65536),
            ("amp.growth_interval", self.amp.growth_interval, 1, 1 << 24),
        ] {
            if !(least..=most).contains(&v) {
                bail!("{k} must be in {least}..={most}, got {v}");
            }
        }
        // checkpoint.keep_last = 0 would delete the checkpoint a --resume needs (prune keeps at least one anyway).
        for (k, v) in [("log.every_steps", self.log.every_steps), ("checkpoint.keep_last", self.checkpoint.keep_last)] {
            if v == 0 {
                bail!("{k} must be at least 1, got 0");
            }
        }
        if self.data.val_resize < self.data.image_size {
            bail!(
                "data.val_resize ({}) must be at least data.image_size ({})",
                self.data.val_resize,
                self.data.image_size
            );
        }
        // The smallest inputs the stems take down to a 1x1 last stage (the model downsamples by 32 and by 8).
        match self.model.stem {
            Stem::ImageNet if self.data.image_size < 32 => bail!(
                "data.image_size = {} is too small for the imagenet stem (at least 32; use model.stem = \"cifar\")",
                self.data.image_size
            ),
            Stem::Cifar if self.data.image_size < 8 => {
                bail!("data.image_size = {} is too small for the cifar stem (at least 8)", self.data.image_size)
            }
            _ => {}
        }
        for (k, v) in [
            ("optim.lr", self.optim.lr),
            ("optim.eps", self.optim.eps),
            ("sched.gamma", self.sched.gamma),
            ("amp.init_scale", self.amp.init_scale),
            ("finetune.head_lr_mult", self.finetune.head_lr_mult),
            ("train.bucket_mb", self.train.bucket_mb),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{k} must be a positive number, got {}", num(v));
            }
        }
        for (k, v) in [
            ("optim.weight_decay", self.optim.weight_decay),
            ("train.clip_grad_norm", self.train.clip_grad_norm),
            ("sched.warmup_epochs", self.sched.warmup_epochs),
            ("sched.min_lr", self.sched.min_lr),
            ("amp.min_scale", self.amp.min_scale),
            ("amp.max_scale", self.amp.max_scale),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{k} must be a non-negative number, got {}", num(v));
            }
        }
        // PyTorch's ranges for the betas; a momentum of 1 or more never forgets a gradient and diverges.
        for (k, v) in [
            ("train.label_smoothing", self.train.label_smoothing),
            ("optim.momentum", self.optim.momentum),
            ("optim.beta1", self.optim.beta1),
            ("optim.beta2", self.optim.beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                bail!("{k} must be in [0, 1), got {}", num(v));
            }
        }
        if self.finetune.head_lr_mult > 1e6 {
            bail!("finetune.head_lr_mult must be at most 1e6, got {}", num(self.finetune.head_lr_mult));
        }
        let stall = self.train.stall_timeout_s;
        if !(stall.is_finite() && stall > 0.0) {
            bail!("train.stall_timeout_s must be a number of seconds above 0, got {}", num(stall));
        }
        if stall > 1e9 {
            bail!("train.stall_timeout_s must be at most 1e9 seconds, got {}", num(stall));
        }
        // torch.amp.GradScaler's rules; the device keeps the scale (and its clamps) in f32.
        if !(self.amp.backoff_factor > 0.0 && self.amp.backoff_factor < 1.0) {
            bail!("amp.backoff_factor must be in (0, 1), got {}", num(self.amp.backoff_factor));
        }
        if !(self.amp.growth_factor.is_finite() && self.amp.growth_factor > 1.0) {
            bail!("amp.growth_factor must be a number above 1, got {}", num(self.amp.growth_factor));
        }
        let (init, min, max) = (self.amp.init_scale, self.amp.min_scale, self.amp.max_scale);
        if init > f32::MAX as f64 {
            bail!("amp.init_scale must be at most 3.4e38 (the scale is kept in f32), got {}", num(init));
        }
        if min > 0.0 && max > 0.0 && min > max {
            bail!("amp.min_scale ({}) must be at most amp.max_scale ({})", num(min), num(max));
        }
        if min > 0.0 && init < min {
            bail!("amp.init_scale ({}) must be at least amp.min_scale ({})", num(init), num(min));
        }
        if max > 0.0 && init > max {
            bail!("amp.init_scale ({}) must be at most amp.max_scale ({})", num(init), num(max));
        }
        if self.optim.nesterov && self.optim.momentum == 0.0 {
            bail!("optim.nesterov = true needs optim.momentum > 0");
        }
        // The schedule: torch.optim.lr_scheduler.LinearLR's start factor; the cosine's floor below its start. A
        // warm-up longer than the run is allowed, as LinearLR's total_iters is (short runs of a long recipe).
        let s = &self.sched;
        if !(s.warmup_start_factor > 0.0 && s.warmup_start_factor <= 1.0) {
            bail!("sched.warmup_start_factor must be in (0, 1], got {}", num(s.warmup_start_factor));
        }
        if s.name == SchedName::Cosine && s.min_lr > self.optim.lr {
            bail!(
                "sched.min_lr ({}) must be at most optim.lr ({}) for sched.name = \"cosine\"",
                num(s.min_lr),
                num(self.optim.lr)
            );
        }
        if s.name == SchedName::Step && s.step_epochs == 0 {
            bail!("sched.step_epochs must be at least 1 for sched.name = \"step\"");
        }
        if s.milestones.contains(&0) {
            bail!("sched.milestones must be epochs of at least 1, got {:?}", s.milestones);
        }
        if s.milestones.windows(2).any(|w| w[0] >= w[1]) {
            bail!("sched.milestones must be strictly increasing, got {:?}", s.milestones);
        }
        Ok(())
    }
}

/// A number as the messages show it: very large and very small ones in exponent form (`1e300`, `1e-8`), others as
/// written (`0.5`, `-3`, `NaN`).
fn num(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e16).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// A config value as the messages show it (TOML syntax, numbers as [`num`] writes them).
fn show(v: &toml::Value) -> String {
    match v {
        toml::Value::Float(f) => num(*f),
        v => v.to_string(),
    }
}

fn coerce_floats(t: &mut toml::Table, schema: &toml::Table) {
    for (k, v) in t.iter_mut() {
        match (v, schema.get(k)) {
            (toml::Value::Table(sub), Some(toml::Value::Table(ssub))) => coerce_floats(sub, ssub),
            (v @ toml::Value::Integer(_), Some(toml::Value::Float(_))) => {
                if let toml::Value::Integer(i) = *v {
                    *v = toml::Value::Float(i as f64);
                }
            }
            _ => {}
        }
    }
}

/// The dotted key a deserialisation error is about (its `in `key`` line).
fn error_key(e: &toml::de::Error) -> Option<String> {
    e.to_string().lines().rev().find_map(|l| l.trim().strip_prefix("in `")?.strip_suffix('`').map(str::to_string))
}

/// The value and the allowed names of serde's "unknown variant" message.
fn unknown_variant(msg: &str) -> Option<(&str, Vec<&str>)> {
    let rest = msg.trim().strip_prefix("unknown variant `")?;
    let (value, expected) = rest.split_once('`').unwrap_or((rest, ""));
    Some((value, expected.split('`').skip(1).step_by(2).collect()))
}

/// The names a name-valued key takes (None for a free-form string such as a path): what serde lists when the key
/// in `table` is given a name it does not know.
fn choices(table: &toml::Table, parts: &[&str]) -> Option<Vec<String>> {
    let mut t = table.clone();
    let (last, sections) = parts.split_last()?;
    let mut node = &mut t;
    for p in sections {
        node = node.get_mut(*p)?.as_table_mut()?;
    }
    node.insert(last.to_string(), toml::Value::String("\u{1}".into()));
    let e = Config::deserialize(toml::Value::Table(t)).err()?;
    if error_key(&e)? != parts.join(".") {
        return None;
    }
    let (_, allowed) = unknown_variant(e.message())?;
    Some(allowed.into_iter().map(String::from).collect())
}

/// Digits with an optional sign (and TOML's underscores).
fn integer_text(s: &str) -> bool {
    let d = s.strip_prefix(['+', '-']).unwrap_or(s);
    d.chars().any(|c| c.is_ascii_digit()) && d.chars().all(|c| c.is_ascii_digit() || c == '_')
}

/// A deserialisation error as one line naming the key and the value: `model.arch = "resnet19" is not one of
/// resnet18, ...` for an unknown name (or a value of another type), `train.batch_size = 1.5 is not an integer` for
/// another wrong type, `train.batch_size = -1 must not be negative`, `key = value: message` otherwise.
/// `table` is the config deserialised, `schema` the default config.
fn value_error(e: &toml::de::Error, table: &toml::Table, schema: &toml::Table) -> String {
    use toml::Value as V;
    let Some(key) = error_key(e) else { return one_line(&e.to_string()) };
    let msg = e.message().trim();
    if let Some((value, allowed)) = unknown_variant(msg) {
        return format!("{key} = \"{value}\" is not one of {}", allowed.join(", "));
    }
    let parts: Vec<&str> = key.split('.').collect();
    let (Some(want), Some(got)) = (lookup(schema, &parts), lookup(table, &parts)) else {
        return format!("{key}: {}", one_line(msg));
    };
    let shown = show(got);
    match (want, got) {
        (V::Table(_), _) | (_, V::Table(_)) => format!("{key}: {}", one_line(msg)),
        (V::Integer(_), V::Integer(i)) if *i < 0 => format!("{key} = {i} must not be negative"),
        (V::Integer(_), g) if !g.is_integer() => format!("{key} = {shown} is not an integer"),
        (V::Float(_), g) if !(g.is_float() || g.is_integer()) => format!("{key} = {shown} is not a number"),
        (V::Boolean(_), g) if !g.is_bool() => format!("{key} = {shown} is not true or false"),
        (V::String(_), g) if !g.is_str() => match choices(table, &parts) {
            Some(allowed) => format!("{key} = {shown} is not one of {}", allowed.join(", ")),
            None => format!("{key} = {shown} is not a string (write it in quotes)"),
        },
        (V::Array(_), g) if !g.is_array() => format!("{key} = {shown} is not a list (write it as [a, b])"),
        _ => format!("{key} = {shown}: {}", one_line(msg)),
    }
}

/// TOML errors span several lines (a source excerpt); keep the message on one.
fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('|') && !l.chars().all(|c| c == '^' || c == ' '))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::KernelsSection;
    use std::path::PathBuf;

    #[test]
    fn autotune_cache_paths() {
        let k = |v: &str| KernelsSection { autotune_cache: v.into(), ..Default::default() };
        assert_eq!(k("off").autotune_cache_path(), None);
        assert_eq!(k("/tmp/x.tsv").autotune_cache_path(), Some(PathBuf::from("/tmp/x.tsv")));
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |key: &str| vars.iter().find(|(k, _)| *k == key).map(|(_, v)| std::ffi::OsString::from(v))
        };
        let auto = k("auto");
        let both = env(&[("XDG_CACHE_HOME", "/xdg"), ("HOME", "/home/u")]);
        assert_eq!(auto.autotune_cache_path_in(both), Some(PathBuf::from("/xdg/resnet-train/kernels-autotune.tsv")));
        let home = env(&[("HOME", "/home/u")]);
        let want = PathBuf::from("/home/u/.cache/resnet-train/kernels-autotune.tsv");
        assert_eq!(auto.autotune_cache_path_in(home), Some(want));
        assert_eq!(auto.autotune_cache_path_in(env(&[])), None);
    }

    #[test]
    fn kernel_choices_resolve_by_device_and_dtype() {
        use kernels::{ConvImpl, MatmulImpl};
        use resnet::Precision;
        let k = KernelsSection { autotune: false, ..Default::default() };
        let p = k.policy(true, Precision::Bf16).unwrap();
        assert_eq!((p.conv, p.matmul), (ConvImpl::Custom, MatmulImpl::Custom));
        assert!(matches!(p.tuning, kernels::Tuning::Heuristic));
        let p = k.policy(false, Precision::Bf16).unwrap();
        assert_eq!((p.conv, p.matmul), (ConvImpl::FwdConv, MatmulImpl::Cublas));
        let p = k.policy(true, Precision::F32).unwrap();
        assert_eq!((p.conv, p.matmul), (ConvImpl::FwdConv, MatmulImpl::Cublas));
        let off = KernelsSection { autotune_cache: "off".into(), ..Default::default() };
        let p = off.policy(true, Precision::F16).unwrap();
        assert!(matches!(&p.tuning, kernels::Tuning::Autotune(a) if a.file().is_none()));
    }

    #[test]
    fn data_parallel_numbers_must_be_positive() {
        for (set, want) in [
            ("train.bucket_mb=0", "train.bucket_mb must be a positive number, got 0"),
            ("train.bucket_mb=-3.5", "train.bucket_mb must be a positive number, got -3.5"),
            ("train.stall_timeout_s=0", "train.stall_timeout_s must be a number of seconds above 0, got 0"),
        ] {
            let e = super::Config::from_str_with("", "x.toml", &[set.to_string()]).unwrap_err();
            assert_eq!(format!("{e:#}"), format!("--set {set}: {want}"));
        }
        let c = super::Config::from_str_with("", "x.toml", &["train.bucket_mb=0.5".into()]).unwrap();
        assert_eq!(c.train.bucket_mb, 0.5);
    }

    /// Each `kernels.bn_stats` setting turns on its halves of the fused reductions; "auto" also the per-shape
    /// timing, which "fused" leaves off.
    #[test]
    fn bn_stats_settings_set_the_policy() {
        for (v, conv, backward, timed) in [
            ("pass", false, false, false),
            ("fused", true, true, false),
            ("auto", true, true, true),
            ("forward", true, false, false),
            ("backward", false, true, false),
        ] {
            let c = super::Config::from_str_with("", "x.toml", &[format!("kernels.bn_stats=\"{v}\"")]).unwrap();
            let p = c.kernels.policy(true, super::Precision::Bf16).unwrap();
            assert_eq!((p.bn_stats_in_conv, p.bn_sums_in_backward, p.bn_epilogue_by_timing), (conv, backward, timed));
            assert_eq!(c.kernels.bn_stats.name(), v);
        }
    }

    /// `kernels.bn_cooperative` reaches the policy (on by default), and its line in the policy's description.
    #[test]
    fn bn_cooperative_sets_the_policy() {
        let on = super::Config::from_str_with("", "x.toml", &[]).unwrap().kernels.policy(true, super::Precision::Bf16);
        let on = on.unwrap();
        assert!(on.bn_cooperative && on.describe().contains("one cooperative launch a BatchNorm pass"));
        let cpu = super::Config::from_str_with("", "x.toml", &[]).unwrap().kernels.policy(false, super::Precision::F32);
        assert!(!cpu.unwrap().bn_cooperative, "the CPU has no cooperative launches");
        let c = super::Config::from_str_with("", "x.toml", &["kernels.bn_cooperative=false".into()]).unwrap();
        let off = c.kernels.policy(true, super::Precision::Bf16).unwrap();
        assert!(!off.bn_cooperative && !off.describe().contains("cooperative"));
        let e = super::Config::from_str_with("", "x.toml", &["kernels.bn_cooperative=\"yes\"".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("bn_cooperative"), "{e:#}");
    }

    /// `kernels.bn_apply_in_conv` reaches the policy (off by default, unless the environment's switch is on) and
    /// the policy's description.
    #[test]
    fn bn_apply_in_conv_sets_the_policy() {
        use kernels::BnApplyInConv;
        let env = kernels::ops::batchnorm::bn_apply_in_conv();
        let d = super::Config::from_str_with("", "x.toml", &[]).unwrap().kernels.policy(true, super::Precision::Bf16);
        assert_eq!(d.unwrap().bn_apply_in_conv, env);
        for (v, want, text) in [
            ("backward", BnApplyInConv::Backward, "conv3 inputs normalised in the grad-weight"),
            ("both", BnApplyInConv::Both, "conv3 inputs normalised in the conv and its grad-weight"),
        ] {
            let c = super::Config::from_str_with("", "x.toml", &[format!("kernels.bn_apply_in_conv=\"{v}\"")]).unwrap();
            let p = c.kernels.policy(true, super::Precision::Bf16).unwrap();
            assert_eq!(p.bn_apply_in_conv, want);
            assert!(p.describe().contains(text), "{}", p.describe());
        }
    }

    /// `kernels.weights_in_optimizer`: on by default, off when set false (the environment's override aside), a
    /// value that is not a boolean named.
    #[test]
    fn weights_in_optimizer_is_a_boolean_on_by_default() {
        let env = super::weights_in_optimizer_env();
        let cfg = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            super::Config::from_str_with("", "x.toml", &sets)
        };
        assert!(cfg(&[]).unwrap().kernels.weights_in_optimizer);
        let off = cfg(&["kernels.weights_in_optimizer=false"]).unwrap();
        assert!(!off.kernels.weights_in_optimizer);
        assert_eq!(off.kernels.weights_in_optimizer(), env.unwrap_or(false));
        let e = cfg(&["kernels.weights_in_optimizer=1"]).unwrap_err();
        assert!(format!("{e:#}").contains("weights_in_optimizer"), "{e:#}");
    }

    /// `kernels.join_in_conv` reaches the policy and its description; a value that is not a boolean is named.
    #[test]
    fn join_in_conv_sets_the_policy() {
        let env = kernels::ops::batchnorm::join_in_conv_env();
        let policy = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let c = super::Config::from_str_with("", "x.toml", &sets).unwrap();
            c.kernels.policy(true, super::Precision::Bf16).unwrap()
        };
        // On by default; KERNELS_JOIN_IN_CONV (0 or 1), where set, decides over the config.
        assert_eq!(policy(&[]).join_in_conv, env.unwrap_or(true));
        assert_eq!(policy(&["kernels.join_in_conv=false"]).join_in_conv, env.unwrap_or(false));
        let p = policy(&["kernels.join_in_conv=true"]);
        assert_eq!(p.join_in_conv, env.unwrap_or(true));
        if p.join_in_conv {
            assert!(p.describe().contains("block-output joins in the conv1 grad-inputs"));
        }
        let e = super::Config::from_str_with("", "x.toml", &["kernels.join_in_conv=\"yes\"".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("join_in_conv"), "{e:#}");
    }

    #[test]
    fn unknown_names_give_one_line_naming_key_and_choices() {
        for (key, allowed) in [
            ("model.arch", "resnet18, resnet34, resnet50, resnet101, resnet152"),
            ("model.stem", "imagenet, cifar"),
            ("optim.name", "sgd, adamw"),
            ("sched.name", "cosine, step, multistep, constant"),
            ("amp.dtype", "fp32, bf16, fp16"),
            ("amp.loss_scaling", "auto, on, off"),
            ("kernels.conv", "auto, fwdconv, candle, custom"),
            ("kernels.matmul", "auto, cublas, custom"),
            ("kernels.graph", "auto, on, off"),
            ("kernels.bn_stats", "pass, fused, auto, forward, backward"),
            ("kernels.bn_apply_in_conv", "off, backward, both"),
        ] {
            let e = super::Config::from_str_with("", "x.toml", &[format!("{key}=\"nope\"")]).unwrap_err();
            let e = format!("{e:#}");
            assert_eq!(e, format!("--set {key}=\"nope\": {key} = \"nope\" is not one of {allowed}"));
            // The same key in the file (at its top, as a dotted key): the file is named.
            let e = super::Config::from_str_with(&format!("{key} = \"nope\"\n"), "y.toml", &[]).unwrap_err();
            assert_eq!(format!("{e:#}"), format!("y.toml: {key} = \"nope\" is not one of {allowed}"));
        }
        // A number where a name is expected: shown as written in the file (from --set: the text typed, quoted).
        let e = super::Config::from_str_with("[model]\narch = 3\n", "y.toml", &[]).unwrap_err();
        let e = format!("{e:#}");
        assert_eq!(e, "y.toml: model.arch = 3 is not one of resnet18, resnet34, resnet50, resnet101, resnet152");
    }

    /// `--set key=value` on the default config: the error is `--set key=value: <message>`.
    fn set_error(set: &str) -> String {
        let e = super::Config::from_str_with("", "x.toml", &[set.to_string()]).unwrap_err();
        format!("{e:#}")
    }

    /// Every range check names the key and the value, on one line, and blames the `--set` that gave it.
    #[test]
    fn out_of_range_values_name_key_and_value() {
        for (set, want) in [
            ("optim.lr=-1", "optim.lr must be a positive number, got -1"),
            ("optim.momentum=5", "optim.momentum must be in [0, 1), got 5"),
            ("optim.momentum=1", "optim.momentum must be in [0, 1), got 1"),
            ("optim.momentum=-0.1", "optim.momentum must be in [0, 1), got -0.1"),
            ("optim.momentum=nan", "optim.momentum must be in [0, 1), got NaN"),
            ("optim.beta1=1", "optim.beta1 must be in [0, 1), got 1"),
            ("optim.beta2=-0.5", "optim.beta2 must be in [0, 1), got -0.5"),
            ("optim.beta2=inf", "optim.beta2 must be in [0, 1), got inf"),
            ("optim.eps=0", "optim.eps must be a positive number, got 0"),
            ("optim.eps=nan", "optim.eps must be a positive number, got NaN"),
            ("sched.warmup_start_factor=0", "sched.warmup_start_factor must be in (0, 1], got 0"),
            ("sched.warmup_start_factor=1.5", "sched.warmup_start_factor must be in (0, 1], got 1.5"),
            ("sched.warmup_start_factor=nan", "sched.warmup_start_factor must be in (0, 1], got NaN"),
            ("sched.gamma=0", "sched.gamma must be a positive number, got 0"),
            ("sched.gamma=inf", "sched.gamma must be a positive number, got inf"),
            ("sched.min_lr=-1", "sched.min_lr must be a non-negative number, got -1"),
            ("sched.min_lr=0.5", "sched.min_lr (0.5) must be at most optim.lr (0.1) for sched.name = \"cosine\""),
            ("sched.milestones=[0, 3]", "sched.milestones must be epochs of at least 1, got [0, 3]"),
            ("sched.milestones=[5, 3]", "sched.milestones must be strictly increasing, got [5, 3]"),
            ("sched.milestones=[3, 3]", "sched.milestones must be strictly increasing, got [3, 3]"),
            ("amp.init_scale=0", "amp.init_scale must be a positive number, got 0"),
            ("amp.init_scale=1e300", "amp.init_scale must be at most 3.4e38 (the scale is kept in f32), got 1e300"),
            ("amp.growth_factor=1", "amp.growth_factor must be a number above 1, got 1"),
            ("amp.growth_factor=0.5", "amp.growth_factor must be a number above 1, got 0.5"),
            ("amp.growth_factor=inf", "amp.growth_factor must be a number above 1, got inf"),
            ("amp.backoff_factor=1", "amp.backoff_factor must be in (0, 1), got 1"),
            ("amp.backoff_factor=nan", "amp.backoff_factor must be in (0, 1), got NaN"),
            ("amp.min_scale=-1", "amp.min_scale must be a non-negative number, got -1"),
            ("amp.max_scale=inf", "amp.max_scale must be a non-negative number, got inf"),
            ("amp.min_scale=2048", "amp.init_scale (1024) must be at least amp.min_scale (2048)"),
            ("amp.max_scale=512", "amp.init_scale (1024) must be at most amp.max_scale (512)"),
            ("amp.growth_interval=0", "amp.growth_interval must be in 1..=16777216, got 0"),
            ("amp.growth_interval=16777217", "amp.growth_interval must be in 1..=16777216, got 16777217"),
            ("finetune.head_lr_mult=0", "finetune.head_lr_mult must be a positive number, got 0"),
            ("finetune.head_lr_mult=1e9", "finetune.head_lr_mult must be at most 1e6, got 1000000000"),
            ("model.num_classes=0", "model.num_classes must be in 2..=1000000, got 0"),
            ("model.num_classes=1", "model.num_classes must be in 2..=1000000, got 1"),
            ("model.num_classes=1000000000", "model.num_classes must be in 2..=1000000, got 1000000000"),
            ("data.image_size=0", "data.image_size must be in 1..=16384, got 0"),
            ("data.image_size=16385", "data.image_size must be in 1..=16384, got 16385"),
            ("data.val_resize=16385", "data.val_resize must be in 1..=16384, got 16385"),
            ("data.val_resize=100", "data.val_resize (100) must be at least data.image_size (224)"),
            (
                "data.image_size=16",
                "data.image_size = 16 is too small for the imagenet stem (at least 32; use model.stem = \"cifar\")",
            ),
            ("data.num_samples=0", "data.num_samples must be in 1..=100000000, got 0"),
            ("data.num_samples=10000000000", "data.num_samples must be in 1..=100000000, got 10000000000"),
            (
                "data.num_samples=9223372036854775807",
                "data.num_samples must be in 1..=100000000, got 9223372036854775807",
            ),
            ("data.workers=100000", "data.workers must be in 0..=1024, got 100000"),
            ("data.prefetch=0", "data.prefetch must be in 1..=1024, got 0"),
            ("data.prefetch=1000000", "data.prefetch must be in 1..=1024, got 1000000"),
            ("data.pack_quality=0", "data.pack_quality must be in 1..=100, got 0"),
            ("data.pack_max_side=8", "data.pack_max_side must be in 16..=65535, got 8"),
            ("train.epochs=0", "train.epochs must be in 1..=1000000, got 0"),
            ("train.epochs=4611686018427387904", "train.epochs must be in 1..=1000000, got 4611686018427387904"),
            ("train.batch_size=0", "train.batch_size must be in 1..=1048576, got 0"),
            ("train.batch_size=1048577", "train.batch_size must be in 1..=1048576, got 1048577"),
            ("train.eval_batch_size=1048577", "train.eval_batch_size must be in 0..=1048576, got 1048577"),
            ("train.grad_accum=0", "train.grad_accum must be in 1..=65536, got 0"),
            ("train.grad_accum=9223372036854775807", "train.grad_accum must be in 1..=65536, got 9223372036854775807"),
            ("train.stall_timeout_s=0", "train.stall_timeout_s must be a number of seconds above 0, got 0"),
            ("train.stall_timeout_s=1e20", "train.stall_timeout_s must be at most 1e9 seconds, got 1e20"),
            ("train.label_smoothing=1", "train.label_smoothing must be in [0, 1), got 1"),
            ("checkpoint.keep_last=0", "checkpoint.keep_last must be at least 1, got 0"),
            ("log.every_steps=0", "log.every_steps must be at least 1, got 0"),
        ] {
            assert_eq!(set_error(set), format!("--set {set}: {want}"));
        }
        // The small-image stem: down to 8 pixels (its last stage at 1x1).
        let cifar = |size: &str| {
            let sets = ["model.stem=\"cifar\"".to_string(), format!("data.image_size={size}")];
            super::Config::from_str_with("", "x.toml", &sets).map_err(|e| format!("{e:#}"))
        };
        let want = "--set data.image_size=4: data.image_size = 4 is too small for the cifar stem (at least 8)";
        assert_eq!(cifar("4").unwrap_err(), want);
        assert_eq!(cifar("8").unwrap().data.image_size, 8);
    }

    /// The edges of each range are accepted.
    #[test]
    fn values_at_the_edges_are_accepted() {
        let sets = [
            "optim.momentum=0",
            "optim.beta1=0",
            "optim.beta2=0.999999",
            "optim.eps=1e-30",
            "sched.warmup_start_factor=1",
            "sched.gamma=1",
            "sched.min_lr=0.1",
            "sched.milestones=[1, 2, 90]",
            "train.epochs=5",
            "sched.warmup_epochs=5",
            "amp.init_scale=3e38",
            "amp.min_scale=1",
            "amp.max_scale=3e38",
            "amp.growth_factor=1.0001",
            "amp.growth_interval=16777216",
            "finetune.head_lr_mult=1e6",
            "model.num_classes=2",
            "data.image_size=16384",
            "data.val_resize=16384",
            "data.num_samples=100000000",
            "data.workers=1024",
            "data.prefetch=1024",
            "train.batch_size=1048576",
            "train.grad_accum=65536",
            "train.stall_timeout_s=1e9",
            "checkpoint.keep_last=1",
        ];
        let c = super::Config::from_str_with("", "x.toml", &sets.map(String::from)).unwrap();
        assert_eq!((c.sched.milestones, c.amp.growth_interval, c.data.image_size), (vec![1, 2, 90], 1 << 24, 16384));
        // Warm-up and the cosine floor may take the whole run and the base rate; only the cosine has a floor.
        let step = ["sched.name=\"step\"", "sched.min_lr=5"].map(String::from);
        assert_eq!(super::Config::from_str_with("", "x.toml", &step).unwrap().sched.min_lr, 5.0);
    }

    /// Wrong types and impossible numbers: one line with the key and the value as typed, never serde's jargon.
    #[test]
    fn wrong_types_name_key_and_value() {
        for (set, want) in [
            ("model.arch=18", "model.arch = \"18\" is not one of resnet18, resnet34, resnet50, resnet101, resnet152"),
            ("device=3", "device = \"3\" is not one of cpu, cuda, cuda:N"),
            ("train.batch_size=99999999999999999999", "train.batch_size = 99999999999999999999 is too large"),
            ("train.batch_size=-99999999999999999999", "train.batch_size = -99999999999999999999 must not be negative"),
            ("train.batch_size=-1", "train.batch_size = -1 must not be negative"),
            ("seed=-1", "seed = -1 must not be negative"),
            ("train.batch_size=1.5", "train.batch_size = 1.5 is not an integer"),
            ("train.batch_size=abc", "train.batch_size = \"abc\" is not an integer"),
            ("train.batch_size=\"64\"", "train.batch_size = \"64\" is not an integer"),
            ("optim.lr=abc", "optim.lr = \"abc\" is not a number"),
            ("optim.lr=\"0.1\"", "optim.lr = \"0.1\" is not a number"),
            ("kernels.autotune=\"yes\"", "kernels.autotune = \"yes\" is not true or false"),
            ("sched.milestones=3", "sched.milestones = 3 is not a list (write it as [a, b])"),
            ("sched.milestones=[-1]", "sched.milestones = [-1]: invalid value: integer `-1`, expected usize"),
        ] {
            assert_eq!(set_error(set), format!("--set {set}: {want}"));
        }
        // Numbers beyond a TOML integer are still numbers for a float key; names and paths are the text typed.
        let sets = ["optim.lr=99999999999999999999", "data.dir=2024", "model.init_from=7"].map(String::from);
        let c = super::Config::from_str_with("", "x.toml", &sets).unwrap();
        assert_eq!((c.optim.lr, c.data.dir.as_str(), c.model.init_from.as_str()), (1e20, "2024", "7"));
        // The same mistakes in a file.
        for (text, want) in [
            ("[data]\ndir = 3\n", "data.dir = 3 is not a string (write it in quotes)"),
            ("[train]\nbatch_size = -1\n", "train.batch_size = -1 must not be negative"),
            ("[train]\nbatch_size = 2.5\n", "train.batch_size = 2.5 is not an integer"),
            ("[optim]\nlr = \"a\"\n", "optim.lr = \"a\" is not a number"),
            ("[amp]\ndtype = 16\n", "amp.dtype = 16 is not one of fp32, bf16, fp16"),
            ("[finetune]\nfreeze = \"layer1\"\n", "finetune.freeze = \"layer1\" is not a list (write it as [a, b])"),
            ("[log]\nprogress = 1\n", "log.progress = 1 is not true or false"),
            ("[train]\nbatch_size = \"64\"\n", "train.batch_size = \"64\" is not an integer"),
        ] {
            let e = super::Config::from_str_with(text, "y.toml", &[]).unwrap_err();
            assert_eq!(format!("{e:#}"), format!("y.toml: {want}"), "{text}");
        }
        // An integer beyond TOML's range in a file is TOML's own error, with the line.
        let e = super::Config::from_str_with("[train]\nbatch_size = 99999999999999999999\n", "y.toml", &[]);
        let e = format!("{:#}", e.unwrap_err());
        assert!(e.starts_with("y.toml: ") && e.contains("99999999999999999999") && !e.contains('\n'), "{e}");
        let e = super::Config::from_str_with("[train]\nbatchsize = 3\n", "y.toml", &[]).unwrap_err();
        let e = format!("{e:#}");
        assert!(e.starts_with("y.toml: train: unknown field `batchsize`") && !e.contains('\n'), "{e}");
    }

    /// Malformed `--set`s: one line quoting it.
    #[test]
    fn malformed_sets_are_quoted() {
        for (set, want) in [
            ("=3", "--set =3: empty key (expected key=value, e.g. train.batch_size=64)"),
            (" = 3", "--set = 3: empty key (expected key=value, e.g. train.batch_size=64)"),
            ("train", "--set `train`: expected key=value"),
            ("train=3", "--set train=3: `train` is a section, not a key"),
            ("train.nope=1", "--set train.nope=1: unknown config key `train.nope`"),
            ("nope=1", "--set nope=1: unknown config key `nope`"),
        ] {
            assert_eq!(set_error(set), want);
        }
    }

    /// An error names the `--set`s of the keys it is about when they gave the final value, the file otherwise.
    #[test]
    fn errors_blame_the_set_or_the_file() {
        let load = |text: &str, sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            super::Config::from_str_with(text, "x.toml", &sets).map_err(|e| format!("{e:#}"))
        };
        let momentum = "[optim]\nmomentum = 5\n";
        assert_eq!(load(momentum, &[]).unwrap_err(), "x.toml: optim.momentum must be in [0, 1), got 5");
        // Another key's --set does not take the blame; a --set of the key does, and can mend the file.
        let e = load(momentum, &["optim.lr=0.2"]).unwrap_err();
        assert_eq!(e, "x.toml: optim.momentum must be in [0, 1), got 5");
        let e = load(momentum, &["optim.momentum=2"]).unwrap_err();
        assert_eq!(e, "--set optim.momentum=2: optim.momentum must be in [0, 1), got 2");
        assert_eq!(load(momentum, &["optim.momentum=0.5"]).unwrap().optim.momentum, 0.5);
        // The last --set of a key is the one named.
        let e = load("", &["optim.lr=-1", "optim.lr=-2"]).unwrap_err();
        assert_eq!(e, "--set optim.lr=-2: optim.lr must be a positive number, got -2");
        // Two keys that disagree: the --set that made them disagree is named, or both.
        let floor = "[sched]\nmin_lr = 0.01\n";
        let msg = "sched.min_lr (0.01) must be at most optim.lr (0.001) for sched.name = \"cosine\"";
        assert_eq!(load(&format!("{floor}[optim]\nlr = 0.001\n"), &[]).unwrap_err(), format!("x.toml: {msg}"));
        assert_eq!(load(floor, &["optim.lr=0.001"]).unwrap_err(), format!("--set optim.lr=0.001: {msg}"));
        let e = load("", &["sched.min_lr=0.01", "train.epochs=3", "optim.lr=0.001"]).unwrap_err();
        assert_eq!(e, format!("--set sched.min_lr=0.01 --set optim.lr=0.001: {msg}"));
        let warm = "[sched]\nwarmup_epochs = 5\n[train]\nepochs = 90\n";
        assert!(load(warm, &["train.epochs=1"]).is_ok(), "a short run of a recipe with a warm-up");
        // A top-level key is named only as the subject of the message.
        let e = load("[amp]\ninit_scale = 1e300\n", &["device=\"cpu\"", "seed=3"]).unwrap_err();
        assert_eq!(e, "x.toml: amp.init_scale must be at most 3.4e38 (the scale is kept in f32), got 1e300");
        let e = load("", &["device=\"tpu\""]).unwrap_err();
        assert_eq!(e, "--set device=\"tpu\": device = \"tpu\" is not one of cpu, cuda, cuda:N");
        // Type errors too.
        let e = load("[model]\narch = \"resnet18\"\n", &["model.arch=resnet19"]).unwrap_err();
        let names = "resnet18, resnet34, resnet50, resnet101, resnet152";
        assert_eq!(e, format!("--set model.arch=resnet19: model.arch = \"resnet19\" is not one of {names}"));
    }

    /// The shipped configs pass the checks.
    #[test]
    fn shipped_configs_validate() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                super::Config::load(&path, &[]).unwrap_or_else(|e| panic!("{e:#}"));
                n += 1;
            }
        }
        assert!(n >= 5, "{n} configs in {}", dir.display());
    }
}
