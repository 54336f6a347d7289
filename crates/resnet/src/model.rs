//! The ResNet family (torchvision's v1.5: stride on the 3x3 conv of a bottleneck), any number of classes,
//! an ImageNet stem (7x7/2 conv + 3x3/2 max-pool) or a small-image stem (3x3/1 conv, no pool).

use crate::layers::{global_avg_pool_ctx, max_pool2d, BatchNorm2d, Builder, Conv2d, Ctx, Linear};
use crate::store::ParamStore;
use crate::{ModelError, Precision};
use candle_core::{Device, Result, Tensor};
use kernels::{conv_out_size, KernelPolicy};
use std::sync::atomic::Ordering;

/// A ResNet depth; in configs by its lowercase name (`resnet152`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    ResNet18,
    ResNet34,
    ResNet50,
    ResNet101,
    ResNet152,
}

impl Arch {
    pub const ALL: [Arch; 5] = [Arch::ResNet18, Arch::ResNet34, Arch::ResNet50, Arch::ResNet101, Arch::ResNet152];

    pub fn parse(s: &str) -> std::result::Result<Self, ModelError> {
        Ok(match s {
            "resnet18" => Self::ResNet18,
            "resnet34" => Self::ResNet34,
            "resnet50" => Self::ResNet50,
            "resnet101" => Self::ResNet101,
            "resnet152" => Self::ResNet152,
            _ => return Err(ModelError::UnknownArch(s.to_string())),
        })
    }
    pub fn name(&self) -> &'static str {
        match self {
            Self::ResNet18 => "resnet18",
            Self::ResNet34 => "resnet34",
            Self::ResNet50 => "resnet50",
            Self::ResNet101 => "resnet101",
            Self::ResNet152 => "resnet152",
        }
    }
    /// Blocks per stage.
    pub fn layers(&self) -> [usize; 4] {
        match self {
            Self::ResNet18 => [2, 2, 2, 2],
            Self::ResNet34 | Self::ResNet50 => [3, 4, 6, 3],
            Self::ResNet101 => [3, 4, 23, 3],
            Self::ResNet152 => [3, 8, 36, 3],
        }
    }
    pub fn bottleneck(&self) -> bool {
        matches!(self, Self::ResNet50 | Self::ResNet101 | Self::ResNet152)
    }
    /// Channel expansion of the last conv of a block.
    pub fn expansion(&self) -> usize {
        if self.bottleneck() {
            4
        } else {
            1
        }
    }
}

/// The stem; in configs `imagenet` or `cifar`.
impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stem {
    /// 7x7 stride-2 conv, BN, ReLU, 3x3 stride-2 max-pool.
    ImageNet,
    /// 3x3 stride-1 conv, BN, ReLU, no pool (32x32 inputs).
    Cifar,
}

impl Stem {
    pub fn parse(s: &str) -> std::result::Result<Self, ModelError> {
        match s {
            "imagenet" => Ok(Self::ImageNet),
            "cifar" => Ok(Self::Cifar),
            _ => Err(ModelError::UnknownStem(s.to_string())),
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            Self::ImageNet => "imagenet",
            Self::Cifar => "cifar",
        }
    }
}

impl std::fmt::Display for Stem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone)]
pub struct ResNetConfig {
    pub arch: Arch,
    pub num_classes: usize,
    pub stem: Stem,
    /// Zero-initialise the last BatchNorm weight of every block (each block starts as the identity).
    pub zero_init_residual: bool,
    /// Seed of the parameter initialisation.
    pub seed: u64,
    /// Which kernels run (see [`kernels::KernelPolicy`]). The custom convolutions make the model channels-last
    /// ([`ResNetConfig::channels_last`]).
    pub kernels: KernelPolicy,
}

impl Default for ResNetConfig {
    fn default() -> Self {
        Self {
            arch: Arch::ResNet50,
            num_classes: 1000,
            stem: Stem::ImageNet,
            zero_init_residual: false,
            seed: 0,
            kernels: KernelPolicy::default(),
        }
    }
}

impl ResNetConfig {
    /// Run channels-last (NHWC): the (n, 3, h, w) input is permuted to (n, h, w, 3) once, every activation is
    /// (n, h, w, c), convs run [`kernels::conv2d_nhwc`] on a (k, r, s, c) copy of the low-precision weight, and
    /// the pooled (n, c) features feed `fc`. Master weights stay torchvision-shaped (k, c, r, s) FP32, so weight
    /// files and checkpoints do not depend on the layout.
    pub fn channels_last(&self) -> bool {
        self.kernels.channels_last()
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Downsample {
    pub(crate) conv: Conv2d,
    pub(crate) bn: BatchNorm2d,
}

/// BasicBlock (two 3x3 convs) or Bottleneck (1x1, 3x3 with the stride, 1x1 x4).
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) convs: Vec<Conv2d>,
    pub(crate) bns: Vec<BatchNorm2d>,
    pub(crate) downsample: Option<Downsample>,
}

impl Block {
    fn new(b: &Builder, arch: Arch, c_in: usize, width: usize, stride: usize, zero_last: bool) -> Result<Self> {
        let c_out = width * arch.expansion();
        let (convs, bns) = if arch.bottleneck() {
            (
                vec![
                    Conv2d::new(&b.pp("conv1"), c_in, width, 1, 1, 0)?,
                    Conv2d::new(&b.pp("conv2"), width, width, 3, stride, 1)?,
                    Conv2d::new(&b.pp("conv3"), width, c_out, 1, 1, 0)?,
                ],
                vec![
                    BatchNorm2d::new(&b.pp("bn1"), width, false)?,
                    BatchNorm2d::new(&b.pp("bn2"), width, false)?,
                    BatchNorm2d::new(&b.pp("bn3"), c_out, zero_last)?,
                ],
            )
        } else {
            (
                vec![
                    Conv2d::new(&b.pp("conv1"), c_in, width, 3, stride, 1)?,
                    Conv2d::new(&b.pp("conv2"), width, width, 3, 1, 1)?,
                ],
                vec![BatchNorm2d::new(&b.pp("bn1"), width, false)?, BatchNorm2d::new(&b.pp("bn2"), width, zero_last)?],
            )
        };
        let downsample = if stride != 1 || c_in != c_out {
            Some(Downsample {
                conv: Conv2d::new(&b.pp("downsample.0"), c_in, c_out, 1, stride, 0)?,
                bn: BatchNorm2d::new(&b.pp("downsample.1"), c_out, false)?,
            })
        } else {
            None
        };
        Ok(Self { convs, bns, downsample })
    }

    // x: [n, c_in, h, w] -> [n, c_out, h/stride, w/stride] (channels-last: [n, h, w, c_in] -> [n, h', w', c_out])
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut y = x.clone();
        let last = self.convs.len() - 1;
        for (i, (conv, bn)) in self.convs.iter().zip(&self.bns).enumerate() {
            let z = conv.forward(&y, ctx)?;
            // Every BN but the last is followed by ReLU (fused in channels-last training); the last feeds the add.
            y = if i != last { bn.forward_relu(&z, ctx)? } else { bn.forward(&z, ctx)? };
        }
        let identity = match &self.downsample {
            Some(d) => d.bn.forward(&d.conv.forward(x, ctx)?, ctx)?,
            None => x.clone(),
        };
        (y + identity)?.relu()
    }

    fn bns(&self) -> impl Iterator<Item = &BatchNorm2d> {
        self.bns.iter().chain(self.downsample.iter().map(|d| &d.bn))
    }
}

/// A ResNet whose tensors live in a [`ParamStore`] under torchvision's names.
#[derive(Debug, Clone)]
pub struct ResNet {
    pub config: ResNetConfig,
    store: ParamStore,
    pub(crate) conv1: Conv2d,
    pub(crate) bn1: BatchNorm2d,
    pub(crate) stages: Vec<Vec<Block>>,
    pub(crate) fc: Linear,
}

/// Output shape of each stage for one input, as printed by `trainer info`.
#[derive(Debug, Clone)]
pub struct StageShape {
    pub name: String,
    pub shape: Vec<usize>,
}

impl ResNet {
    pub fn new(config: ResNetConfig, device: &Device) -> Result<Self> {
        let store = ParamStore::new(device);
        let b = Builder::new(&store, config.seed);
        let arch = config.arch;
        let (conv1, c0) = match config.stem {
            Stem::ImageNet => (Conv2d::new(&b.pp("conv1"), 3, 64, 7, 2, 3)?, 64),
            Stem::Cifar => (Conv2d::new(&b.pp("conv1"), 3, 64, 3, 1, 1)?, 64),
        };
        let bn1 = BatchNorm2d::new(&b.pp("bn1"), c0, false)?;
        let mut c_in = c0;
        let mut stages = Vec::new();
        for (i, &n) in arch.layers().iter().enumerate() {
            let width = 64 << i;
            let stride = if i == 0 { 1 } else { 2 };
            let lb = b.pp(format!("layer{}", i + 1));
            let mut blocks = Vec::new();
            for j in 0..n {
                blocks.push(Block::new(
                    &lb.pp(j),
                    arch,
                    c_in,
                    width,
                    if j == 0 { stride } else { 1 },
                    config.zero_init_residual,
                )?);
                c_in = width * arch.expansion();
            }
            stages.push(blocks);
        }
        let fc = Linear::new(&b.pp("fc"), c_in, config.num_classes)?;
        Ok(Self { config, store, conv1, bn1, stages, fc })
    }

    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    pub fn device(&self) -> &Device {
        self.store.device()
    }

    /// Width of the feature vector fed to `fc`.
    pub fn feature_dim(&self) -> usize {
        512 * self.config.arch.expansion()
    }

    // x: [n, 3, h, w] (any float dtype) -> logits [n, num_classes] in the activation dtype.
    // The shape comments below are NCHW; with `channels_last` each 4D activation is (n, h, w, c) instead.
    pub fn forward(&self, x: &Tensor, train: bool, precision: Precision) -> Result<Tensor> {
        let ctx = Ctx { train, act: precision.act_dtype(), kernels: self.config.kernels.clone() };
        let mut x = x.to_dtype(ctx.act)?;
        if ctx.channels_last() {
            x = x.permute((0, 2, 3, 1))?.contiguous()?; // [n, h, w, 3], the only layout conversion
        }
        let mut x = self.bn1.forward_relu(&self.conv1.forward(&x, &ctx)?, &ctx)?; // [n, 64, h/2, w/2]
        if self.config.stem == Stem::ImageNet {
            x = max_pool2d(&x, &ctx, 3, 2, 1)?; // [n, 64, h/4, w/4]
        }
        for stage in &self.stages {
            for block in stage {
                x = block.forward(&x, &ctx)?;
            }
        } // [n, 512 * expansion, h/32, w/32]
        let x = global_avg_pool_ctx(&x, &ctx)?; // [n, 512 * expansion] in either layout
        self.fc.forward(&x, &ctx)
    }

    /// Output shape after the stem and each stage for an input of `image_size`, batch `n` (computed, not run).
    /// Always described as (n, c, h, w), whatever the layout the model runs in (see [`ResNetConfig::channels_last`]).
    pub fn stage_shapes(&self, n: usize, image_size: usize) -> Vec<StageShape> {
        let mut s = match self.config.stem {
            Stem::ImageNet => {
                let s = conv_out_size(image_size, 7, 2, 3);
                conv_out_size(s, 3, 2, 1)
            }
            Stem::Cifar => image_size,
        };
        let mut out = vec![StageShape { name: "stem".into(), shape: vec![n, 64, s, s] }];
        for i in 0..4 {
            if i > 0 {
                s = conv_out_size(s, 3, 2, 1);
            }
            out.push(StageShape {
                name: format!("layer{}", i + 1),
                shape: vec![n, (64 << i) * self.config.arch.expansion(), s, s],
            });
        }
        out.push(StageShape { name: "avgpool".into(), shape: vec![n, self.feature_dim()] });
        out.push(StageShape { name: "fc".into(), shape: vec![n, self.config.num_classes] });
        out
    }

    /// Elements of every convolution's output for one image of `image_size` (the stem, each block's convs and
    /// downsample), in forward order.
    fn conv_outputs(&self, image_size: usize) -> Vec<usize> {
        let out = |c: &Conv2d, s: usize| {
            let d = c.weight.var().dims();
            let s = conv_out_size(s, d[2], c.stride, c.padding);
            (s, d[0] * s * s)
        };
        let (mut s, stem) = out(&self.conv1, image_size);
        let mut v = vec![stem];
        if self.config.stem == Stem::ImageNet {
            s = conv_out_size(s, 3, 2, 1);
        }
        for block in self.stages.iter().flatten() {
            let input = s;
            for c in &block.convs {
                let (next, n) = out(c, s);
                s = next;
                v.push(n);
            }
            if let Some(d) = &block.downsample {
                v.push(out(&d.conv, input).1);
            }
        }
        v
    }

    /// Elements of every convolution's output for one image of `image_size`, summed: a lower bound of what
    /// training keeps per image, as each is saved for its BatchNorm's backward.
    pub fn conv_output_elems(&self, image_size: usize) -> usize {
        self.conv_outputs(image_size).iter().sum()
    }

    /// Elements of the largest convolution output for one image of `image_size`: a lower bound of what inference
    /// holds per image at its peak (that output, and the input it was made from).
    pub fn max_conv_output_elems(&self, image_size: usize) -> usize {
        self.conv_outputs(image_size).into_iter().max().unwrap_or(0)
    }

    /// Every BatchNorm layer with its name prefix.
    pub(crate) fn batchnorms(&self) -> Vec<&BatchNorm2d> {
        let mut v = vec![&self.bn1];
        for stage in &self.stages {
            for block in stage {
                v.extend(block.bns());
            }
        }
        v
    }

    /// Makes every BatchNorm use (and keep) its running statistics, also in training mode.
    pub fn freeze_bn_stats(&self, frozen: bool) {
        for bn in self.batchnorms() {
            bn.stats_frozen.store(frozen, Ordering::Relaxed);
        }
    }

    /// Re-initialises the classification head (PyTorch's Linear default) with a new seed.
    pub fn reset_head(&self, seed: u64) -> Result<()> {
        let tmp = ParamStore::new(self.device());
        let b = Builder::new(&tmp, seed);
        let fresh = Linear::new(&b.pp("fc"), self.feature_dim(), self.config.num_classes)?;
        self.fc.weight.var().set(&fresh.weight.tensor())?;
        self.fc.bias.var().set(&fresh.bias.tensor())?;
        Ok(())
    }
}
