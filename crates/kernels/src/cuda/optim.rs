//! Multi-tensor kernels (`kernels/optim/01_multi_tensor.cu`): gathering every parameter's gradient into one flat,
//! unscaled FP32 buffer with its sum of squares, PyTorch's SGD and AdamW over all parameters in place, and the
//! training step's conv weights to and from the kernels' layout, each in one launch instead of several candle ops
//! (launch + allocation) per tensor.
//!
//! The parameters are read and written through their device addresses: callers pass the FP32 master weights (the
//! tensors of their `Var`s), contiguous, on one CUDA device, and nothing else may hold views of them that expect
//! the old values.

use super::ptx;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Result, Tensor, TensorId};
use std::collections::HashMap;

const MODULE: &str = "optim/01_multi_tensor";
/// Elements per block (CHUNK in the .cu file).
const CHUNK: usize = 16384;

/// Device address of the first element of a contiguous FP32 CUDA tensor, and its device.
fn f32_addr(t: &Tensor, what: &str) -> Result<(u64, CudaDevice)> {
    let candle_core::Device::Cuda(dev) = t.device() else {
        candle_core::bail!("multi-tensor: {what} is not on a CUDA device");
    };
    Ok((super::addr_of::<f32>(t, t.elem_count(), &format!("multi-tensor: {what}"))?, dev.clone()))
}

/// Tensor table and block -> (tensor, first element) chunk list on the device; the number of blocks.
struct Tables {
    tab: candle_core::cuda_backend::cudarc::driver::CudaSlice<u64>,
    chunks: candle_core::cuda_backend::cudarc::driver::CudaSlice<i32>,
    blocks: usize,
}

/// The fourth table word of an SGD entry: weight decay (low half) and lr multiplier (high half) as f32 bits.
fn sgd_word(wd: f32, lrm: f32) -> u64 {
    u64::from(wd.to_bits()) | (u64::from(lrm.to_bits()) << 32)
}

/// `entries`: (address, offset in the flat buffer, length, the kernel's fourth word) per tensor.
fn tables(dev: &CudaDevice, entries: &[(u64, usize, usize, u64)]) -> Result<Tables> {
    let mut tab = Vec::with_capacity(4 * entries.len());
    let mut chunks = Vec::new();
    for (i, &(addr, off, len, word)) in entries.iter().enumerate() {
        if len >= i32::MAX as usize {
            candle_core::bail!("multi-tensor: a tensor of {len} elements is too large");
        }
        tab.extend([addr, off as u64, len as u64, word]);
        for start in (0..len).step_by(CHUNK) {
            chunks.extend([i as i32, start as i32]);
        }
    }
    let blocks = chunks.len() / 2;
    if blocks == 0 {
        candle_core::bail!("multi-tensor: no elements");
    }
    // SAFETY: both buffers are written in full by the copies below before any kernel reads them.
    let mut t = unsafe { dev.alloc::<u64>(tab.len())? };
    let mut c = unsafe { dev.alloc::<i32>(chunks.len())? };
    // Inside a graph capture the copies read pinned buffers that the graph keeps (the tables hold the addresses
    // of that capture's buffers).
    super::graph::htod(dev, &tab, &mut t)?;
    super::graph::htod(dev, &chunks, &mut c)?;
    Ok(Tables { tab: t, chunks: c, blocks })
}

fn cfg(blocks: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// All of `tensors` (FP32, contiguous, one CUDA device) times `scale`, concatenated flat in order, and the sum of
/// the squares of that flat vector (a scalar tensor; summed per block, then in block order: deterministic).
pub fn gather_scaled(tensors: &[Tensor], scale: f32) -> Result<(Tensor, Tensor)> {
    gather_scaled_div(tensors, scale, None)
}

/// [`gather_scaled`] times `scale / div` where `div` is a device scalar (FP32, one element: the loss scale, read
/// by the kernel, so the host need not know it).
pub fn gather_scaled_div(tensors: &[Tensor], scale: f32, div: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let Some(first) = tensors.first() else { candle_core::bail!("multi-tensor: no tensors") };
    let (_, dev) = f32_addr(first, "gradient 0")?;
    let mut entries = Vec::with_capacity(tensors.len());
    let mut off = 0;
    for (i, t) in tensors.iter().enumerate() {
        let (a, _) = f32_addr(t, &format!("gradient {i}"))?;
        entries.push((a, off, t.elem_count(), 0));
        off += t.elem_count();
    }
    let tb = tables(&dev, &entries)?;
    // Not zero-filled: the tensors lie back to back in the flat buffer and the chunks cover each whole, so the
    // launch writes every element (a zero fill cost a 241 MB memset a ResNet-152 step), and every block its
    // partial sum.
    let flat = super::empty_f32(first, off)?;
    let partial = super::empty_f32(first, tb.blocks)?;
    let (pf, _) = f32_addr(&flat, "flat buffer")?;
    let (pp, _) = f32_addr(&partial, "partial sums")?;
    let pd = match div {
        Some(d) => scalar_addr(d, "loss scale")?,
        None => 0,
    };
    let f = dev.get_or_load_custom_func("mt_gather_f32", MODULE, ptx::OPTIM_01_MULTI_TENSOR)?;
    let mut b = f.builder();
    b.arg(&tb.tab).arg(&tb.chunks).arg(&pf).arg(&scale).arg(&pd).arg(&pp);
    // SAFETY: (tab, chunks, flat, scale, div, partial) as mt_gather_f32 takes them; every chunk lies inside its
    // tensor and the flat buffer (off elements), partial holds one float per block, div is null or one float.
    unsafe { b.launch(cfg(tb.blocks)) }.w()?;
    let sq = partial.sum_all()?;
    Ok((flat, sq))
}

/// One parameter for [`sgd_step`]: its FP32 master tensor, weight decay and learning-rate multiplier.
pub struct SgdParam<'a> {
    pub tensor: &'a Tensor,
    pub weight_decay: f32,
    pub lr_mult: f32,
}

/// Device address of a (small) contiguous FP32 tensor: a scalar the kernels read on the device.
fn scalar_addr(t: &Tensor, what: &str) -> Result<u64> {
    Ok(f32_addr(t, what)?.0)
}

/// The device-side step decision the update kernels take: `norm_sq` (device scalar, FP32) is the sum of squares
/// of the unscaled gradient; not finite -> the kernel skips the step; else the gradient is multiplied by the
/// global-norm clipping coefficient for `clip` (0: no clipping).
#[derive(Clone, Copy)]
pub struct DeviceDecision<'a> {
    pub norm_sq: &'a Tensor,
    pub clip: f32,
}

/// PyTorch's SGD over all `params` in place, their gradients `grad` (flat, in order) clipped and skipped as
/// `decision` says, momentum buffers in the flat `momentum_buf` (same length, zero before the first step; unused
/// when `momentum` is 0). The learning rate is read on the device from `lr` (one FP32), so a captured step
/// replays with each step's rate. `lowp`: the conv weights the update writes too ([`ConvWeights`]).
#[allow(clippy::too_many_arguments)]
pub fn sgd_step(
    params: &[SgdParam<'_>],
    grad: &Tensor,
    momentum_buf: &Tensor,
    decision: DeviceDecision<'_>,
    lr: &Tensor,
    momentum: f32,
    nesterov: bool,
    lowp: Option<&ConvWeights>,
) -> Result<()> {
    let Some(p0) = params.first() else { candle_core::bail!("multi-tensor: no parameters") };
    let (_, dev) = f32_addr(p0.tensor, "parameter 0")?;
    let mut entries = Vec::with_capacity(params.len());
    let mut off = 0;
    for (i, p) in params.iter().enumerate() {
        let (a, _) = f32_addr(p.tensor, &format!("parameter {i}"))?;
        entries.push((a, off, p.tensor.elem_count(), sgd_word(p.weight_decay, p.lr_mult)));
        off += p.tensor.elem_count();
    }
    if grad.elem_count() != off || momentum_buf.elem_count() != off {
        candle_core::bail!(
            "multi-tensor sgd: {off} parameter elements, {} gradient, {} momentum",
            grad.elem_count(),
            momentum_buf.elem_count()
        );
    }
    let tb = tables(&dev, &entries)?;
    let (pg, _) = f32_addr(grad, "gradient buffer")?;
    let (pm, _) = f32_addr(momentum_buf, "momentum buffer")?;
    let pn = scalar_addr(decision.norm_sq, "gradient norm")?;
    let plr = scalar_addr(lr, "learning rate")?;
    let nest = i32::from(nesterov);
    let lp = LowpTable::new(&dev, params, lowp)?;
    let f = dev.get_or_load_custom_func("mt_sgd_f32", MODULE, ptx::OPTIM_01_MULTI_TENSOR)?;
    let mut b = f.builder();
    b.arg(&tb.tab).arg(&tb.chunks).arg(&pg).arg(&pm).arg(&pn).arg(&decision.clip);
    b.arg(&plr).arg(&momentum).arg(&nest).arg(&lp.addr).arg(&lp.ltab).arg(&lp.f16);
    // SAFETY: (tab, chunks, grad, momentum, norm_sq, clip, lr, momentum, nesterov, lowp, ltab, lowp_f16) as
    // mt_sgd_f32 takes them; every chunk lies inside its parameter and the flat buffers (off elements each); norm_sq
    // and lr are one float each; lowp is null or holds every (offset + length) of ltab (LowpTable::new checks).
    unsafe { b.launch(cfg(tb.blocks)) }.w()?;
    Ok(())
}

/// PyTorch's AdamW over all `params` in place (decoupled weight decay, per-parameter lr multiplier), their
/// gradients `grad` (flat, in order) clipped and skipped as `decision` says, first and second moments in the flat
/// `exp_avg` / `exp_avg_sq` (same length, zero before the first step). The bias corrections count the steps taken
/// from `ctl[2]` ([`amp_update`]'s device state) + 1; the learning rate is read on the device from `lr` (one FP32).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    params: &[SgdParam<'_>],
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    decision: DeviceDecision<'_>,
    ctl: &Tensor,
    lr: &Tensor,
    (beta1, beta2, eps): (f64, f64, f64),
    lowp: Option<&ConvWeights>,
) -> Result<()> {
    let Some(p0) = params.first() else { candle_core::bail!("multi-tensor: no parameters") };
    let (_, dev) = f32_addr(p0.tensor, "parameter 0")?;
    if ctl.elem_count() < 3 {
        candle_core::bail!("multi-tensor adamw: the step state has {} elements, expected 3", ctl.elem_count());
    }
    let mut entries = Vec::with_capacity(params.len());
    let mut off = 0;
    for (i, p) in params.iter().enumerate() {
        let (a, _) = f32_addr(p.tensor, &format!("parameter {i}"))?;
        entries.push((a, off, p.tensor.elem_count(), sgd_word(p.weight_decay, p.lr_mult)));
        off += p.tensor.elem_count();
    }
    for (what, t) in [("gradient", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        if t.elem_count() != off {
            candle_core::bail!("multi-tensor adamw: {off} parameter elements, {} in {what}", t.elem_count());
        }
    }
    let tb = tables(&dev, &entries)?;
    let (pg, _) = f32_addr(grad, "gradient buffer")?;
    let (pm, _) = f32_addr(exp_avg, "exp_avg buffer")?;
    let (pv, _) = f32_addr(exp_avg_sq, "exp_avg_sq buffer")?;
    let pn = scalar_addr(decision.norm_sq, "gradient norm")?;
    let pc = scalar_addr(ctl, "step state")?;
    let plr = scalar_addr(lr, "learning rate")?;
    let (b1, b2, e) = (beta1 as f32, beta2 as f32, eps as f32);
    let (omb1, omb2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
    let lp = LowpTable::new(&dev, params, lowp)?;
    let f = dev.get_or_load_custom_func("mt_adamw_f32", MODULE, ptx::OPTIM_01_MULTI_TENSOR)?;
    let mut b = f.builder();
    b.arg(&tb.tab).arg(&tb.chunks).arg(&pg).arg(&pm).arg(&pv).arg(&pn).arg(&decision.clip).arg(&pc).arg(&plr);
    b.arg(&b1).arg(&b2).arg(&e).arg(&omb1).arg(&omb2).arg(&lp.addr).arg(&lp.ltab).arg(&lp.f16);
    // SAFETY: (tab, chunks, grad, exp_avg, exp_avg_sq, norm_sq, clip, ctl, lr, beta1, beta2, eps, omb1, omb2, lowp,
    // ltab, lowp_f16) as mt_adamw_f32 takes them; every chunk lies inside its parameter and the three flat buffers
    // (off elements each); norm_sq and lr are one float each, ctl three; lowp is null or holds every (offset +
    // length) of ltab (LowpTable::new checks).
    unsafe { b.launch(cfg(tb.blocks)) }.w()?;
    Ok(())
}

/// The convolution weights of the training step, kept between steps: every weight in the activation dtype (bf16 or
/// f16) and the kernels' (k, r, s, c) layout, views of one flat buffer laid out by [`krsc_offsets`]. Made whole
/// from the FP32 masters by [`ConvWeights::new`] and [`ConvWeights::refresh`] (`mt_weights_krsc`, one launch);
/// then [`sgd_step`] and [`adamw_step`], given it, write each weight they update as they update its master (the
/// values `mt_weights_krsc` would make from the new master, bit for bit), so that a step needs no cast and
/// permute of its weights. Whatever writes a master any other way must call [`ConvWeights::refresh`].
pub struct ConvWeights {
    flat: Tensor,
    dtype: DType,
    masters: Vec<Tensor>,
    /// Every weight's view in `flat` ((k, r, s, c)), keyed by its master's tensor id.
    views: HashMap<TensorId, Tensor>,
    /// Per master: its offset in `flat`, its length and the kernels' (c | r s << 32) word.
    layout: HashMap<TensorId, (usize, usize, u64)>,
}

impl ConvWeights {
    /// `masters`: FP32 (k, c, r, s) weights, contiguous, on one CUDA device; `dtype`: bf16 or f16.
    pub fn new(masters: &[&Tensor], dtype: DType) -> Result<Self> {
        if masters.is_empty() {
            candle_core::bail!("conv weights: no weights");
        }
        if !matches!(dtype, DType::BF16 | DType::F16) {
            candle_core::bail!("conv weights: dtype {dtype:?} (bf16 or f16 only)");
        }
        for (i, w) in masters.iter().enumerate() {
            if w.dtype() != DType::F32 || !w.is_contiguous() || w.rank() != 4 {
                candle_core::bail!(
                    "conv weights: weight {i} is {:?} {:?}, expected contiguous 4-d F32",
                    w.dims(),
                    w.dtype()
                );
            }
        }
        // The step's own conversion (one launch into one flat buffer), kept.
        let (flat, made) = crate::ops::weights::conv_weights_krsc_flat(masters, dtype)?;
        let lens: Vec<usize> = masters.iter().map(|w| w.elem_count()).collect();
        let (offs, _) = krsc_offsets(&lens);
        let mut views = HashMap::with_capacity(masters.len());
        let mut layout = HashMap::with_capacity(masters.len());
        for (((w, view), off), len) in masters.iter().zip(made).zip(offs).zip(lens) {
            let (_, c, r, s) = w.dims4()?;
            views.insert(w.id(), view);
            layout.insert(w.id(), (off, len, c as u64 | ((r * s) as u64) << 32));
        }
        if views.len() != masters.len() {
            candle_core::bail!("conv weights: a weight is listed twice");
        }
        Ok(Self { flat, dtype, masters: masters.iter().map(|&w| w.clone()).collect(), views, layout })
    }

    /// Writes every weight again from its master (one launch).
    pub fn refresh(&self) -> Result<()> {
        let refs: Vec<&Tensor> = self.masters.iter().collect();
        let (st, _) = self.flat.storage_and_layout();
        let candle_core::Storage::Cuda(out) = &*st else { candle_core::bail!("conv weights: not on a CUDA device") };
        weights_krsc(&refs, out)
    }

    /// The activation dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The flat buffer that holds every weight (a captured graph has its address baked in).
    pub fn buffer(&self) -> &Tensor {
        &self.flat
    }

    /// The weight of `master` (by its tensor id) in the kernels' layout: (k, r, s, c) in [`Self::dtype`].
    pub fn get(&self, master: TensorId) -> Option<&Tensor> {
        self.views.get(&master)
    }

    /// How many weights it holds.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// Whether it holds no weight (never: [`Self::new`] refuses an empty list).
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// Every weight, keyed by its master's tensor id (as the explicit step's `StepArgs::weights` takes them).
    pub fn views(&self) -> &HashMap<TensorId, Tensor> {
        &self.views
    }
}

/// The update kernels' arguments for a [`ConvWeights`]: its address (0: none), the per-parameter table (offset or
/// u64::MAX, then the (c | r s << 32) word) and the dtype flag.
struct LowpTable {
    addr: u64,
    ltab: candle_core::cuda_backend::cudarc::driver::CudaSlice<u64>,
    f16: i32,
}

impl LowpTable {
    fn new(dev: &CudaDevice, params: &[SgdParam<'_>], lowp: Option<&ConvWeights>) -> Result<Self> {
        let mut words = Vec::with_capacity(2 * params.len());
        let (mut addr, mut f16) = (0u64, 0i32);
        if let Some(cw) = lowp {
            let total = cw.flat.elem_count();
            addr = match cw.dtype {
                DType::BF16 => super::addr_of::<half::bf16>(&cw.flat, total, "conv weights")?,
                _ => super::addr_of::<half::f16>(&cw.flat, total, "conv weights")?,
            };
            f16 = i32::from(cw.dtype == DType::F16);
            for (i, p) in params.iter().enumerate() {
                match cw.layout.get(&p.tensor.id()) {
                    Some(&(off, len, word)) => {
                        if len != p.tensor.elem_count() || off + len > total {
                            candle_core::bail!(
                                "multi-tensor: parameter {i} has {} elements, its conv weight {len} at {off} of {total}",
                                p.tensor.elem_count()
                            );
                        }
                        words.extend([off as u64, word]);
                    }
                    None => words.extend([u64::MAX, 0]),
                }
            }
        } else {
            words.extend([u64::MAX, 0]);
        }
        // SAFETY: written in full by the copy below before the kernel reads it.
        let mut ltab = unsafe { dev.alloc::<u64>(words.len())? };
        super::graph::htod(dev, &words, &mut ltab)?;
        Ok(Self { addr, ltab, f16 })
    }
}

/// torch.amp.GradScaler's update, and the step count, on the device (`amp_update_f32`, one thread): `ctl` = FP32
/// [scale, growth tracker, optimizer steps taken] updated in place from `norm_sq` (not finite: the step was
/// skipped); `out` (5 FP32) receives [scale used, found inf (0/1), scale, tracker, steps after].
pub fn amp_update(ctl: &Tensor, norm_sq: &Tensor, out: &Tensor, rule: &AmpRule) -> Result<()> {
    let (pc, dev) = f32_addr(ctl, "step state")?;
    if ctl.elem_count() < 3 || out.elem_count() < 5 {
        candle_core::bail!("amp update: state of {} and report of {} elements", ctl.elem_count(), out.elem_count());
    }
    let pn = scalar_addr(norm_sq, "gradient norm")?;
    let po = scalar_addr(out, "step report")?;
    let (g, bo, mn, mx) = (rule.growth as f32, rule.backoff as f32, rule.min_scale as f32, rule.max_scale as f32);
    let interval = i32::try_from(rule.interval).unwrap_or(i32::MAX);
    let enabled = i32::from(rule.enabled);
    let f = dev.get_or_load_custom_func("amp_update_f32", MODULE, ptx::OPTIM_01_MULTI_TENSOR)?;
    let mut b = f.builder();
    b.arg(&pc).arg(&pn).arg(&po).arg(&g).arg(&bo).arg(&interval).arg(&mn).arg(&mx).arg(&enabled);
    // SAFETY: (ctl, norm_sq, out, growth, backoff, interval, min, max, enabled) as amp_update_f32 takes them; ctl
    // holds 3 floats, norm_sq 1, out 5; one thread.
    unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) }.w()?;
    Ok(())
}

/// The loss-scale rule of [`amp_update`] (torch.amp.GradScaler's): grow by `growth` after `interval` clean steps,
/// back off by `backoff` on inf/NaN, clamp to [min_scale, max_scale] where those are > 0; `enabled` false: the
/// scale stays.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AmpRule {
    pub enabled: bool,
    pub growth: f64,
    pub backoff: f64,
    pub interval: usize,
    pub min_scale: f64,
    pub max_scale: f64,
}

/// Alignment of each weight in [`weights_krsc`]'s flat output, in elements (128 bytes in bf16/f16: the TMA and
/// 16-byte vector loads of the convolution kernels need at least 16).
pub const KRSC_ALIGN: usize = 64;

/// Offsets of [`weights_krsc`]'s outputs in its flat buffer and the buffer's length, for weights of `lens` elements.
pub fn krsc_offsets(lens: &[usize]) -> (Vec<usize>, usize) {
    let mut offs = Vec::with_capacity(lens.len());
    let mut off = 0;
    for &len in lens {
        offs.push(off);
        off += len.next_multiple_of(KRSC_ALIGN);
    }
    (offs, off.max(KRSC_ALIGN))
}

/// Writes every FP32 convolution weight of `weights` ((k, c, r, s), contiguous, one CUDA device) into `out` (a
/// flat bf16/f16 buffer of [`krsc_offsets`]' length) in the (k, r, s, c) layout at its offset: one launch.
pub fn weights_krsc(weights: &[&Tensor], out: &candle_core::CudaStorage) -> Result<()> {
    use candle_core::backend::BackendStorage;
    let Some(first) = weights.first() else { candle_core::bail!("weights_krsc: no weights") };
    let (_, dev) = f32_addr(first, "weight 0")?;
    let lens: Vec<usize> = weights.iter().map(|w| w.elem_count()).collect();
    let (offs, total) = krsc_offsets(&lens);
    let mut entries = Vec::with_capacity(weights.len());
    for (i, w) in weights.iter().enumerate() {
        let (k, c, r, s) = w.dims4()?;
        if k * c * r * s == 0 {
            candle_core::bail!("weights_krsc: weight {i} is empty");
        }
        let (a, _) = f32_addr(w, &format!("weight {i}"))?;
        entries.push((a, offs[i], lens[i], c as u64 | ((r * s) as u64) << 32));
    }
    let stream = dev.cuda_stream();
    let (name, dst, held) = match out.dtype() {
        DType::BF16 => {
            let o = out.as_cuda_slice::<half::bf16>()?;
            ("mt_weights_krsc_bf16", o.device_ptr(&stream).0, o.len())
        }
        DType::F16 => {
            let o = out.as_cuda_slice::<half::f16>()?;
            ("mt_weights_krsc_f16", o.device_ptr(&stream).0, o.len())
        }
        other => candle_core::bail!("weights_krsc: output dtype {other:?} (bf16 or f16 only)"),
    };
    if held < total {
        candle_core::bail!("weights_krsc: output holds {held} elements, {total} needed");
    }
    // Every chunk lies inside its weight, and each weight's output (offset + len) inside `out` (checked above).
    relayout(&dev, name, &entries, dst)
}

/// Launches the relayout kernel `name` (mt_weights_krsc_* / mt_grads_kcrs_*: arguments tab, chunks, out) over
/// `entries` into the flat buffer at `dst`. The callers check that every entry's source holds its length and
/// that every (offset + length) lies inside the buffer.
fn relayout(dev: &CudaDevice, name: &str, entries: &[(u64, usize, usize, u64)], dst: u64) -> Result<()> {
    // The kernels index within a tensor in 32 bits.
    if let Some((i, e)) = entries.iter().enumerate().find(|(_, e)| e.2 > i32::MAX as usize) {
        candle_core::bail!("{name}: tensor {i} has {} elements, more than the relayout's 2^31 - 1", e.2);
    }
    let tb = tables(dev, entries)?;
    let f = dev.get_or_load_custom_func(name, MODULE, ptx::OPTIM_01_MULTI_TENSOR)?;
    let mut b = f.builder();
    b.arg(&tb.tab).arg(&tb.chunks).arg(&dst);
    // SAFETY: (tab, chunks, out) as the mt_weights_krsc_* / mt_grads_kcrs_* kernels take them; the bounds are the
    // callers' (see above).
    unsafe { b.launch(cfg(tb.blocks)) }.w()?;
    Ok(())
}

/// The reverse of [`weights_krsc`] for gradients: every `grads` tensor ((k, r, s, c) in bf16/f16, contiguous, one
/// CUDA device; the (k, c, r, s) shape of its weight in `shapes`) as FP32 (k, c, r, s) into `out` (a flat FP32
/// buffer of [`krsc_offsets`]' length) at its offset: one launch.
pub fn grads_kcrs(grads: &[&Tensor], shapes: &[(usize, usize, usize, usize)], out: &Tensor) -> Result<()> {
    let Some(first) = grads.first() else { candle_core::bail!("grads_kcrs: no gradients") };
    if grads.len() != shapes.len() {
        candle_core::bail!("grads_kcrs: {} gradients, {} shapes", grads.len(), shapes.len());
    }
    let dtype = first.dtype();
    let lens: Vec<usize> = grads.iter().map(|g| g.elem_count()).collect();
    let (offs, total) = krsc_offsets(&lens);
    if out.elem_count() < total {
        candle_core::bail!("grads_kcrs: output holds {} elements, {total} needed", out.elem_count());
    }
    let (po, dev) = f32_addr(out, "flat gradient buffer")?;
    let mut entries = Vec::with_capacity(grads.len());
    for (i, (g, &(k, c, r, s))) in grads.iter().zip(shapes).enumerate() {
        if g.dims() != [k, r, s, c] || g.dtype() != dtype {
            candle_core::bail!(
                "grads_kcrs: gradient {i} is {:?} {:?}, expected {:?} {dtype:?}",
                g.dims(),
                g.dtype(),
                [k, r, s, c]
            );
        }
        let a = match dtype {
            DType::BF16 => super::addr_of::<half::bf16>(g, lens[i], "gradient")?,
            DType::F16 => super::addr_of::<half::f16>(g, lens[i], "gradient")?,
            other => candle_core::bail!("grads_kcrs: dtype {other:?} (bf16 or f16 only)"),
        };
        entries.push((a, offs[i], lens[i], c as u64 | ((r * s) as u64) << 32));
    }
    let name = if dtype == DType::BF16 { "mt_grads_kcrs_bf16" } else { "mt_grads_kcrs_f16" };
    // Every chunk lies inside its gradient (len elements at its address, checked by addr_of) and inside `out`
    // (offset + len <= total <= its length).
    relayout(&dev, name, &entries, po)
}
