//! Optimizers on FP32 master weights: SGD (momentum, Nesterov, weight decay) and AdamW, PyTorch's update rules.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor, Var};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimKind {
    Sgd { momentum: f64, nesterov: bool },
    AdamW { beta1: f64, beta2: f64, eps: f64 },
}

/// One trained tensor with its optimizer state.
struct Slot {
    name: String,
    var: Var,
    weight_decay: f64,
    lr_mult: f64,
    /// SGD: [momentum_buffer]; AdamW: [exp_avg, exp_avg_sq]. Created lazily at the first step.
    state: Vec<Tensor>,
}

pub struct Optimizer {
    kind: OptimKind,
    slots: Vec<Slot>,
    /// Optimizer steps taken (skipped steps excluded): the runner counts them as it reads each step's report
    /// (`StepRunner::resolve`); checkpoints keep it.
    pub steps: u64,
    /// The multi-tensor path of [`Optimizer::step_flat`] on CUDA: each kind of state (SGD's momentum buffer,
    /// AdamW's two moments) as one flat FP32 tensor over all parameters; the slots' states are views of them.
    /// Empty until the first multi-tensor step.
    flat_state: Vec<Tensor>,
    /// CUDA, fused step: the training step's conv weights in the activation dtype and the kernels' layout, which
    /// the multi-tensor update writes as it updates their masters ([`Optimizer::keep_conv_weights`]).
    #[cfg(feature = "cuda")]
    conv_weights: Option<kernels::cuda::optim::ConvWeights>,
}

impl Optimizer {
    /// The tensors the optimizer keeps and writes in place between steps (the flat state buffers of the
    /// multi-tensor path, the kept conv weights): a captured CUDA graph has their addresses baked in.
    pub fn persistent_state(&self) -> Vec<Tensor> {
        #[allow(unused_mut)]
        let mut out = self.flat_state.clone();
        #[cfg(feature = "cuda")]
        out.extend(self.conv_weights.iter().map(|w| w.buffer().clone()));
        out
    }

    /// The conv weights the update keeps (made from `masters`, FP32 (k, c, r, s) on one CUDA device, in `dtype`,
    /// bf16 or f16, when not kept yet or kept for other weights or another dtype). From then on every multi-tensor
    /// update writes each weight it changes, so the fused step reads them instead of casting and permuting its
    /// weights each step. Whatever writes a master outside the optimizer must call
    /// [`Self::forget_conv_weights`] (or refresh them).
    #[cfg(feature = "cuda")]
    pub fn keep_conv_weights(
        &mut self,
        masters: &[&Tensor],
        dtype: DType,
    ) -> Result<&kernels::cuda::optim::ConvWeights> {
        let same = self.conv_weights.as_ref().is_some_and(|w| {
            w.dtype() == dtype && masters.iter().all(|m| w.get(m.id()).is_some()) && w.len() == masters.len()
        });
        if !same {
            self.conv_weights = None;
            self.conv_weights = Some(kernels::cuda::optim::ConvWeights::new(masters, dtype)?);
        }
        Ok(self.conv_weights.as_ref().expect("made above"))
    }

    /// The conv weights kept by [`Self::keep_conv_weights`], if any.
    #[cfg(feature = "cuda")]
    pub fn conv_weights(&self) -> Option<&kernels::cuda::optim::ConvWeights> {
        self.conv_weights.as_ref()
    }

    /// Drops the kept conv weights (the masters were written outside the optimizer: a loaded checkpoint); the next
    /// [`Self::keep_conv_weights`] makes them again.
    pub fn forget_conv_weights(&mut self) {
        #[cfg(feature = "cuda")]
        {
            self.conv_weights = None;
        }
    }
}

/// Per-parameter options, decided by the trainer from the config.
pub struct ParamOptions {
    pub weight_decay: f64,
    pub lr_mult: f64,
}

impl Optimizer {
    pub fn new(kind: OptimKind, params: Vec<(String, Var, ParamOptions)>) -> Self {
        let slots = params
            .into_iter()
            .map(|(name, var, o)| Slot { name, var, weight_decay: o.weight_decay, lr_mult: o.lr_mult, state: vec![] })
            .collect();
        Self {
            kind,
            slots,
            steps: 0,
            flat_state: vec![],
            #[cfg(feature = "cuda")]
            conv_weights: None,
        }
    }

    pub fn vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Applies one update from `flat`: every parameter's unscaled FP32 gradient concatenated in order. The step is
    /// decided where the data lives, so the host never waits for the gradient norm on CUDA: `norm_sq` (scalar
    /// FP32) is the sum of squares of `flat`; when it is not finite (inf/NaN, fp16 overflow) nothing changes;
    /// otherwise the gradient is clipped to global norm `clip` (0: off) and applied. The bias-correction count of
    /// AdamW is `ctl[2] + 1` (`ctl`: the runner's [scale, growth tracker, steps taken] state on the same device).
    /// [`Self::steps`] is not touched here: the runner counts the steps taken when it reads the step's report.
    /// On a CUDA device SGD and AdamW run as one multi-tensor kernel over all parameters
    /// (kernels/optim/01_multi_tensor.cu), which reads the learning rate from `lr_dev` (one FP32 on the device,
    /// written by the host before the step: a captured CUDA graph replays with each step's rate; None: a copy of
    /// `lr` made here); otherwise the per-parameter [`Optimizer::step`] with `lr`.
    pub fn step_flat(
        &mut self,
        flat: &Tensor,
        norm_sq: &Tensor,
        clip: f64,
        (lr, lr_dev): (f64, Option<&Tensor>),
        ctl: &Tensor,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        if flat.device().is_cuda() {
            let made;
            let lr_dev = match lr_dev {
                Some(t) => t,
                None => {
                    made = Tensor::new(&[lr as f32], flat.device())?;
                    &made
                }
            };
            return self.step_multi_tensor(flat, norm_sq, clip, lr_dev, ctl);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = lr_dev;
        let norm_sq = norm_sq.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?[0] as f64;
        if !norm_sq.is_finite() {
            return Ok(());
        }
        let norm = norm_sq.sqrt();
        let coef = if clip > 0.0 && norm > clip { clip / (norm + 1e-6) } else { 1.0 };
        let taken = ctl.to_vec1::<f32>()?[2] as u64;
        let flat = if coef != 1.0 { (flat * coef)? } else { flat.clone() };
        let mut offset = 0;
        let mut grads = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let n = s.var.elem_count();
            grads.push(flat.narrow(0, offset, n)?.reshape(s.var.dims())?);
            offset += n;
        }
        self.step(&grads, lr, taken + 1)
    }

    /// The flat state buffers of the multi-tensor path (`kinds` of them), made on first use: zeros for a fresh
    /// optimizer (`true` returned), or the per-slot states of a resumed one concatenated; the slots' states become
    /// views of them.
    #[cfg(feature = "cuda")]
    fn flat_states(&mut self, kinds: usize, device: &candle_core::Device) -> Result<bool> {
        if self.flat_state.len() == kinds {
            return Ok(false);
        }
        let total: usize = self.slots.iter().map(|s| s.var.elem_count()).sum();
        let fresh = self.slots.iter().all(|s| s.state.is_empty());
        let mut bufs = Vec::with_capacity(kinds);
        for k in 0..kinds {
            let buf = if fresh {
                Tensor::zeros(total, DType::F32, device)?
            } else {
                let parts = self
                    .slots
                    .iter()
                    .map(|s| match s.state.get(k) {
                        Some(b) => Ok(b.flatten_all()?),
                        // A parameter without saved state starts at zero (PyTorch would start SGD's buffer at the
                        // gradient; this differs only in this step).
                        None => Ok(s.var.as_tensor().zeros_like()?.flatten_all()?),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)?.contiguous()?
            };
            bufs.push(buf);
        }
        let mut off = 0;
        for s in &mut self.slots {
            let n = s.var.elem_count();
            s.state =
                bufs.iter().map(|b| b.narrow(0, off, n)?.reshape(s.var.dims())).collect::<candle_core::Result<_>>()?;
            off += n;
        }
        self.flat_state = bufs;
        Ok(fresh)
    }

    #[cfg(feature = "cuda")]
    fn step_multi_tensor(
        &mut self,
        flat: &Tensor,
        norm_sq: &Tensor,
        clip: f64,
        lr: &Tensor,
        ctl: &Tensor,
    ) -> Result<()> {
        let decision = kernels::cuda::optim::DeviceDecision { norm_sq, clip: clip as f32 };
        match self.kind {
            OptimKind::Sgd { momentum, nesterov } => {
                if momentum > 0.0 {
                    // Zeros when fresh: the first update's buffer is then the gradient, as PyTorch starts it.
                    self.flat_states(1, flat.device())?;
                }
                let params = self.sgd_params();
                let mom = if momentum > 0.0 { &self.flat_state[0] } else { flat };
                let kept = self.conv_weights.as_ref();
                kernels::cuda::optim::sgd_step(&params, flat, mom, decision, lr, momentum as f32, nesterov, kept)?;
            }
            OptimKind::AdamW { beta1, beta2, eps } => {
                self.flat_states(2, flat.device())?;
                let params = self.sgd_params();
                let (m, v) = (&self.flat_state[0], &self.flat_state[1]);
                let kept = self.conv_weights.as_ref();
                kernels::cuda::optim::adamw_step(&params, flat, m, v, decision, ctl, lr, (beta1, beta2, eps), kept)?;
            }
        }
        Ok(())
    }

    /// The parameters as the multi-tensor kernels take them.
    #[cfg(feature = "cuda")]
    fn sgd_params(&self) -> Vec<kernels::cuda::optim::SgdParam<'_>> {
        self.slots
            .iter()
            .map(|s| kernels::cuda::optim::SgdParam {
                tensor: s.var.as_tensor(),
                weight_decay: s.weight_decay as f32,
                lr_mult: s.lr_mult as f32,
            })
            .collect()
    }

    /// Applies one update. `grads[i]` is the (unscaled, clipped) FP32 gradient of the i-th parameter; `t` the
    /// 1-based number of this update (AdamW's bias corrections). [`Self::steps`] is the caller's to count.
    pub fn step(&mut self, grads: &[Tensor], lr: f64, t: u64) -> Result<()> {
        // The per-parameter update writes the masters only: the kept conv weights would be stale.
        self.forget_conv_weights();
        if grads.len() != self.slots.len() {
            bail!("optimizer: {} gradients for {} parameters", grads.len(), self.slots.len());
        }
        let t = i32::try_from(t.max(1)).unwrap_or(i32::MAX);
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            // Detached: an update must not record an autograd graph, or each step's state would keep the previous
            // step's tensors alive through it.
            let p = &slot.var.as_tensor().detach();
            let g = g.to_dtype(DType::F32)?.detach();
            let lr = lr * slot.lr_mult;
            match self.kind {
                OptimKind::Sgd { momentum, nesterov } => {
                    let g = if slot.weight_decay > 0.0 { (g + (p * slot.weight_decay)?)? } else { g };
                    let d = if momentum > 0.0 {
                        let buf = match slot.state.first() {
                            // PyTorch: the first step's buffer is the gradient itself (its own storage: `g` may be
                            // a view of the flat gradient, which `copy` would clone whole for every parameter).
                            None => g.force_contiguous()?,
                            Some(b) => ((b * momentum)? + &g)?,
                        };
                        slot.state = vec![buf.clone()];
                        if nesterov {
                            (g + (buf * momentum)?)?
                        } else {
                            buf
                        }
                    } else {
                        g
                    };
                    slot.var.set(&(p - (d * lr)?)?)?;
                }
                OptimKind::AdamW { beta1, beta2, eps } => {
                    if slot.state.is_empty() {
                        slot.state = vec![p.zeros_like()?, p.zeros_like()?];
                    }
                    let p = if slot.weight_decay > 0.0 { (p * (1.0 - lr * slot.weight_decay))? } else { p.clone() };
                    let m = ((&slot.state[0] * beta1)? + (&g * (1.0 - beta1))?)?;
                    let v = ((&slot.state[1] * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let bc1 = 1.0 - beta1.powi(t);
                    let bc2 = 1.0 - beta2.powi(t);
                    let denom = ((v.clone() / bc2)?.sqrt()? + eps)?;
                    let upd = ((m.clone() / bc1)? / denom)?;
                    slot.var.set(&(p - (upd * lr)?)?)?;
                    slot.state = vec![m, v];
                }
            }
        }
        Ok(())
    }

    fn state_names(&self) -> &'static [&'static str] {
        match self.kind {
            OptimKind::Sgd { .. } => &["momentum_buffer"],
            OptimKind::AdamW { .. } => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// State tensors keyed `<param>.<slot>` (for checkpoints).
    pub fn state_tensors(&self) -> Result<BTreeMap<String, Tensor>> {
        let names = self.state_names();
        let mut out = BTreeMap::new();
        for s in &self.slots {
            for (t, n) in s.state.iter().zip(names) {
                // Its own storage of its own size: on CUDA the states are views of one flat buffer per kind,
                // which `copy` would clone whole for every parameter (ResNet-152: 466 copies of 241 MB, the
                // checkpoint that ran an H100 out of memory).
                out.insert(format!("{}.{n}", s.name), t.force_contiguous()?.detach());
            }
        }
        Ok(out)
    }

    /// Restores state saved by [`state_tensors`]. A checkpoint with no optimizer state at all starts every
    /// parameter fresh (as PyTorch's optimizers do for parameters without state, e.g. after a run without
    /// momentum); otherwise every parameter's state must be there and every saved tensor must be one of this
    /// optimizer's (another optimizer's state, state of a parameter this run does not train, or a partial
    /// checkpoint is an error naming the tensor).
    pub fn load_state(&mut self, tensors: &BTreeMap<String, Tensor>, steps: u64) -> Result<()> {
        // A resume loads the masters as well: the kept conv weights are made again from them at the next step.
        self.forget_conv_weights();
        let names = self.state_names();
        let known: std::collections::HashSet<String> =
            self.slots.iter().flat_map(|s| names.iter().map(move |n| format!("{}.{n}", s.name))).collect();
        if let Some(k) = tensors.keys().find(|k| !known.contains(*k)) {
            let hint = match (k.rsplit('.').next(), self.kind) {
                (Some("momentum_buffer"), OptimKind::AdamW { .. }) => ": it is SGD's; resume with optim.name = \"sgd\"",
                (Some("exp_avg" | "exp_avg_sq"), OptimKind::Sgd { .. }) => {
                    ": it is AdamW's; resume with optim.name = \"adamw\""
                }
                _ => " (a parameter this run does not train, or another optimizer's state)",
            };
            bail!("optimizer state {k} does not belong to this run's optimizer{hint}");
        }
        self.flat_state.clear();
        for s in &mut self.slots {
            let found: Vec<Option<&Tensor>> = names.iter().map(|n| tensors.get(&format!("{}.{n}", s.name))).collect();
            s.state.clear();
            if tensors.is_empty() {
                continue;
            }
            for (t, n) in found.into_iter().zip(names) {
                let Some(t) = t else {
                    bail!("optimizer state {}.{n} is missing (the checkpoint has other parameters' state)", s.name)
                };
                if t.dims() != s.var.dims() {
                    bail!("optimizer state {}.{n} has shape {:?}, parameter has {:?}", s.name, t.dims(), s.var.dims());
                }
                if !t.dtype().is_float() {
                    bail!("optimizer state {}.{n} is {:?}, not floating point", s.name, t.dtype());
                }
                let t = t.to_dtype(DType::F32)?;
                if let Some(x) = t.flatten_all()?.to_vec1::<f32>()?.into_iter().find(|x| !x.is_finite()) {
                    bail!("optimizer state {}.{n} holds {x} (not a finite number)", s.name);
                }
                s.state.push(t.to_device(s.var.device())?);
            }
        }
        self.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn opt(kind: OptimKind) -> Optimizer {
        let p = |n: usize| Var::from_tensor(&Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let o = || ParamOptions { weight_decay: 0.0, lr_mult: 1.0 };
        Optimizer::new(kind, vec![("a".into(), p(2), o()), ("b".into(), p(3), o())])
    }

    fn stepped(kind: OptimKind) -> BTreeMap<String, Tensor> {
        let mut o = opt(kind);
        let g =
            [Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(), Tensor::ones(3, DType::F32, &Device::Cpu).unwrap()];
        o.step(&g, 0.1, 1).unwrap();
        o.state_tensors().unwrap()
    }

    const SGD: OptimKind = OptimKind::Sgd { momentum: 0.9, nesterov: false };
    const ADAMW: OptimKind = OptimKind::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8 };

    /// Elements held by `t`'s storage (CPU), against its own element count.
    fn storage_len(t: &Tensor) -> usize {
        let (s, _) = t.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(c) => c.as_slice::<f32>().unwrap().len(),
            _ => unreachable!("CPU tensors only"),
        }
    }

    /// A flat gradient's per-parameter views give momentum buffers and saved state of their own size: each is its
    /// own storage of exactly its parameter's elements (before: a clone of the whole flat buffer each).
    #[test]
    fn states_from_a_flat_gradient_hold_only_their_own_elements() {
        let mut o = opt(SGD);
        let flat = Tensor::arange(0f32, 5.0, &Device::Cpu).unwrap();
        let norm_sq = (&flat * &flat).unwrap().sum_all().unwrap();
        let ctl = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        o.step_flat(&flat, &norm_sq, 0.0, (0.1, None), &ctl).unwrap();
        for s in &o.slots {
            assert_eq!(storage_len(&s.state[0]), s.var.elem_count(), "{}: momentum buffer", s.name);
        }
        let saved = o.state_tensors().unwrap();
        assert_eq!(saved["a.momentum_buffer"].to_vec1::<f32>().unwrap(), [0.0, 1.0]);
        assert_eq!(saved["b.momentum_buffer"].to_vec1::<f32>().unwrap(), [2.0, 3.0, 4.0]);
        // Views of one flat buffer, as the CUDA multi-tensor path keeps them: saved one parameter's worth each.
        let buf = Tensor::arange(0f32, 5.0, &Device::Cpu).unwrap();
        o.slots[0].state = vec![buf.narrow(0, 0, 2).unwrap()];
        o.slots[1].state = vec![buf.narrow(0, 2, 3).unwrap()];
        for (name, t) in o.state_tensors().unwrap() {
            assert_eq!(storage_len(&t), t.elem_count(), "{name}");
        }
    }

    /// A resume takes the whole state, or none (a checkpoint without optimizer state); a partial state, another
    /// optimizer's state or state of an untrained parameter is an error naming the tensor.
    #[test]
    fn load_state_takes_all_or_nothing() {
        let full = stepped(SGD);
        assert_eq!(full.len(), 2);
        opt(SGD).load_state(&full, 1).unwrap();
        opt(SGD).load_state(&BTreeMap::new(), 1).unwrap();

        let mut partial = full.clone();
        partial.remove("b.momentum_buffer");
        let e = opt(SGD).load_state(&partial, 1).unwrap_err().to_string();
        assert!(e.contains("b.momentum_buffer is missing"), "{e}");

        let e = opt(ADAMW).load_state(&full, 1).unwrap_err().to_string();
        assert!(e.contains("a.momentum_buffer") && e.contains("optim.name = \"sgd\""), "{e}");
        let e = opt(SGD).load_state(&stepped(ADAMW), 1).unwrap_err().to_string();
        assert!(e.contains("a.exp_avg") && e.contains("optim.name = \"adamw\""), "{e}");

        let mut extra = full.clone();
        extra.insert("c.momentum_buffer".into(), Tensor::ones(1, DType::F32, &Device::Cpu).unwrap());
        let e = opt(SGD).load_state(&extra, 1).unwrap_err().to_string();
        assert!(e.contains("c.momentum_buffer does not belong"), "{e}");

        let mut nan = full.clone();
        nan.insert(
            "b.momentum_buffer".into(),
            (Tensor::ones(3, DType::F32, &Device::Cpu).unwrap() * f64::NAN).unwrap(),
        );
        let e = opt(SGD).load_state(&nan, 1).unwrap_err().to_string();
        assert!(e.contains("b.momentum_buffer holds NaN"), "{e}");

        let mut ints = full;
        ints.insert("a.momentum_buffer".into(), Tensor::ones(2, DType::I64, &Device::Cpu).unwrap());
        let e = opt(SGD).load_state(&ints, 1).unwrap_err().to_string();
        assert!(e.contains("a.momentum_buffer is I64"), "{e}");
    }
}
