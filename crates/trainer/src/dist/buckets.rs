//! The data-parallel gradient all-reduce in buckets, as PyTorch DDP does it: the trainable parameters are split
//! into buckets of about `train.bucket_mb` MB in the order the fused step's backward completes their gradients
//! ([`resnet::ResNet::grad_buckets`]); each bucket is gathered into one flat buffer and its all-reduce started as
//! soon as it is final, so the communication overlaps the rest of the backward (NCCL runs it on a stream of its
//! own, [`super::nccl::NcclComm`]). Every rank starts the same buckets in the same order with the same sizes:
//! a rank without images in its last micro-batch, or a step that cannot hand out buckets during the backward
//! (autograd, synchronised BatchNorm), starts them all after the backward from what it has.

use super::Collective;
use crate::config::GradAllreduce;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, TensorId, Var};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// The model's bucket plan in the optimizer's terms.
#[derive(Debug, Clone)]
pub struct BucketPlan {
    /// The parameters' tensor ids per bucket (the explicit step's [`resnet::step::StepArgs::buckets`]).
    pub ids: Vec<Vec<TensorId>>,
    /// The same parameters as positions in the optimizer's variable list.
    pub members: Vec<Vec<usize>>,
}

impl BucketPlan {
    /// `ids`: the model's plan ([`resnet::ResNet::grad_buckets`]); `vars`: the tensor ids of the optimizer's
    /// variables, in its order. Every variable must be in exactly one bucket.
    pub fn new(ids: Vec<Vec<TensorId>>, vars: &[TensorId]) -> Result<Self> {
        let pos: HashMap<TensorId, usize> = vars.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let mut seen = vec![false; vars.len()];
        let mut members = Vec::with_capacity(ids.len());
        for bucket in &ids {
            let mut m = Vec::with_capacity(bucket.len());
            for id in bucket {
                let Some(&p) = pos.get(id) else { bail!("gradient buckets: a parameter the optimizer does not train") };
                if std::mem::replace(&mut seen[p], true) {
                    bail!("gradient buckets: a parameter in two buckets");
                }
                m.push(p);
            }
            members.push(m);
        }
        if let Some(p) = seen.iter().position(|s| !s) {
            bail!("gradient buckets: trainable parameter {p} is in no bucket");
        }
        Ok(Self { ids, members })
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// One optimizer step's gradient all-reduce. Each bucket's gradients (plus what earlier micro-batches
/// accumulated for them) are gathered into one flat FP32 buffer multiplied by `factor` (this rank's sample count)
/// and divided by the device loss scale `div` (the ranks' sum is then the global-batch sum of per-sample
/// gradients), cast to bf16 when
/// `train.grad_allreduce = "bf16"`, and started. [`Self::finish`] waits for all and returns every variable's
/// summed gradient.
pub struct BucketReducer<'a> {
    plan: &'a BucketPlan,
    collective: &'a dyn Collective,
    progress: Option<&'a AtomicU64>,
    dtype: GradAllreduce,
    factor: f64,
    /// The loss scale on the device (one FP32 element): the gathered gradients are divided by it.
    div: Option<Tensor>,
    /// Earlier micro-batches' FP32 gradient sums by variable position (taken as their buckets start).
    acc: Vec<Option<Tensor>>,
    /// The started buckets, in plan order, with the lengths of their members.
    started: Vec<(Tensor, Vec<usize>)>,
}

impl<'a> BucketReducer<'a> {
    pub fn new(
        plan: &'a BucketPlan,
        collective: &'a dyn Collective,
        progress: Option<&'a AtomicU64>,
        dtype: GradAllreduce,
        (factor, div): (f64, Option<Tensor>),
        vars: usize,
    ) -> Self {
        let acc = vec![None; vars];
        Self { plan, collective, progress, dtype, factor, div, acc, started: Vec::with_capacity(plan.len()) }
    }

    /// The gradients accumulated over the step's micro-batches before their buckets start (FP32, by variable
    /// position in the optimizer's order): the training loop adds each micro-batch's here.
    pub fn acc_mut(&mut self) -> &mut [Option<Tensor>] {
        &mut self.acc
    }

    /// Starts bucket `index` (the next one in plan order) from its members' gradients `grads` (FP32, plan order).
    pub fn start(&mut self, index: usize, grads: Vec<Tensor>) -> Result<()> {
        let members = &self.plan.members[index];
        if index != self.started.len() || grads.len() != members.len() {
            bail!(
                "gradient buckets: bucket {index} with {} gradients, expected bucket {} with {}",
                grads.len(),
                self.started.len(),
                members.len()
            );
        }
        let mut flat = Vec::with_capacity(grads.len());
        for (g, &p) in grads.into_iter().zip(members) {
            let g = g.to_dtype(DType::F32)?.flatten_all()?;
            flat.push(match self.acc[p].take() {
                Some(a) => (a.flatten_all()? + g)?,
                None => g,
            });
        }
        let lens = flat.iter().map(Tensor::elem_count).collect();
        let (all, _) = gather_scaled(&flat, self.factor, self.div.as_ref())?;
        drop(flat);
        let wire = match self.dtype {
            GradAllreduce::Fp32 => all,
            GradAllreduce::Bf16 => all.to_dtype(DType::BF16)?,
        };
        if let Some(p) = self.progress {
            p.fetch_add(1, Ordering::Relaxed);
        }
        self.collective.start_all_reduce_sum(&wire)?;
        self.started.push((wire, lens));
        Ok(())
    }

    /// Starts every bucket not started yet from the accumulated gradients alone (zeros where there are none: a
    /// rank with no images this step). `vars`: the optimizer's variables, in its order.
    pub fn start_rest(&mut self, vars: &[Var]) -> Result<()> {
        for k in self.started.len()..self.plan.len() {
            let grads = self.plan.members[k]
                .iter()
                .map(|&p| match self.acc[p].take() {
                    Some(a) => Ok(a),
                    None => vars[p].as_tensor().zeros_like()?.to_dtype(DType::F32),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            self.start(k, grads)?;
        }
        Ok(())
    }

    /// Waits for every bucket (the device's later work, that is; no host synchronisation) and returns each
    /// variable's summed gradient, flat FP32, in the optimizer's order.
    pub fn finish(self) -> Result<Vec<Tensor>> {
        if self.started.len() != self.plan.len() {
            bail!("gradient buckets: {} of {} buckets started", self.started.len(), self.plan.len());
        }
        self.collective.join()?;
        let mut out: Vec<Option<Tensor>> = vec![None; self.acc.len()];
        for ((wire, lens), members) in self.started.into_iter().zip(&self.plan.members) {
            let sum = wire.to_dtype(DType::F32)?;
            let mut off = 0;
            for (&len, &p) in lens.iter().zip(members) {
                out[p] = Some(sum.narrow(0, off, len)?);
                off += len;
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(p, t)| t.ok_or_else(|| anyhow::anyhow!("gradient buckets: no gradient for parameter {p}")))
            .collect()
    }
}

impl resnet::step::GradSink for BucketReducer<'_> {
    fn bucket(&mut self, index: usize, grads: Vec<Tensor>) -> candle_core::Result<()> {
        self.start(index, grads).map_err(|e| candle_core::Error::Msg(format!("gradient all-reduce: {e:#}")))
    }
}

/// The tensors (FP32, flattened) concatenated and multiplied by `scale` / `div` (`div`: a one-element FP32 device
/// tensor, the loss scale, or None), and the sum of squares of the result (shape ()). On CUDA one multi-tensor
/// kernel gathers, scales and squares (kernels/optim/01_multi_tensor.cu), reading `div` on the device.
pub fn gather_scaled(flat: &[Tensor], scale: f64, div: Option<&Tensor>) -> candle_core::Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if flat.first().is_some_and(|t| t.device().is_cuda()) {
        let ts = flat.iter().map(|t| t.contiguous()).collect::<candle_core::Result<Vec<_>>>()?;
        let div = div.map(|d| d.to_dtype(DType::F32)?.contiguous()).transpose()?;
        return kernels::cuda::optim::gather_scaled_div(&ts, scale as f32, div.as_ref());
    }
    let mut all = (Tensor::cat(flat, 0)? * scale)?;
    if let Some(d) = div {
        all = all.broadcast_div(&d.to_dtype(DType::F32)?.reshape(1)?)?;
    }
    let sq = all.sqr()?.sum_all()?;
    Ok((all, sq))
}
