//! Softmax cross-entropy with label smoothing, forward and backward fused: the loss per row and its gradient with
//! respect to the logits in one pass (on CUDA one launch, `kernels/loss/01_softmax_xent.cu`, one block per row),
//! instead of some twenty candle ops.
//!
//! For logits x (n, k) and labels (n): target q_j = eps / k + (1 - eps) [j == label] (a label >= k keeps only the
//! smoothing term, as a one-hot comparison would); loss_i = -sum_j q_j log softmax(x_i)_j; the returned loss is the
//! mean over the rows, the gradient (softmax(x_i) - q) * scale / n. Everything in FP32 (the CPU reference in FP64,
//! rounded once), from logits in f32, bf16 or f16.

use crate::dispatch::contiguous;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

/// Mean softmax cross-entropy with label smoothing `eps` of `logits` (n, k) against `labels` (n, integer), and
/// its gradient times `scale` ((n, k) f32): (scalar f32 loss, gradient).
pub fn softmax_xent(logits: &Tensor, labels: &Tensor, eps: f64, scale: f64) -> Result<(Tensor, Tensor)> {
    let (n, k) = logits.dims2()?;
    if labels.dims() != [n] {
        candle_core::bail!("softmax_xent: labels of shape {:?} for {n} rows", labels.dims());
    }
    if n == 0 || k == 0 {
        candle_core::bail!("softmax_xent: empty logits {:?}", logits.dims());
    }
    let labels = labels.to_dtype(DType::U32)?.contiguous()?;
    let out = logits.contiguous()?.apply_op2_no_bwd(&labels, &SoftmaxXent { eps, scale: scale / n as f64 })?;
    let grad = out.narrow(0, 0, n * k)?.reshape((n, k))?;
    let loss = (out.narrow(0, n * k, n)?.sum_all()? / n as f64)?;
    Ok((loss, grad))
}

/// The fused op: (logits (n, k), labels (n) u32) -> f32 (n k + n) = [gradient rows times `scale`, row losses].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftmaxXent {
    pub eps: f64,
    /// Gradient factor (already divided by the row count).
    pub scale: f64,
}

fn dims(l: &Layout, lab: &Layout) -> Result<(usize, usize)> {
    match (l.dims(), lab.dims()) {
        (&[n, k], &[m]) if n == m && n * k > 0 => Ok((n, k)),
        (a, b) => candle_core::bail!("softmax_xent: logits {a:?} and labels {b:?} are not (n, k) and (n)"),
    }
}

/// The reference: per row in FP64, rounded once to FP32.
fn cpu<T: WithDType>(x: &[T], labels: &[u32], (n, k): (usize, usize), eps: f64, scale: f64) -> Vec<f32> {
    let mut out = vec![0f32; n * k + n];
    let smooth = eps / k as f64;
    for i in 0..n {
        let row: Vec<f64> = x[i * k..(i + 1) * k].iter().map(|v| v.to_f64()).collect();
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let logz = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let label = labels[i] as usize;
        let mut loss = 0.0;
        for (j, &v) in row.iter().enumerate() {
            let q = smooth + if j == label { 1.0 - eps } else { 0.0 };
            loss -= q * (v - logz);
            out[i * k + j] = (((v - logz).exp() - q) * scale) as f32;
        }
        out[n * k + i] = loss as f32;
    }
    out
}

impl CustomOp2 for SoftmaxXent {
    fn name(&self) -> &'static str {
        "softmax_xent"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, ls: &CpuStorage, lab: &Layout) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "softmax_xent";
        let (n, k) = dims(l, lab)?;
        let CpuStorage::U32(labels) = ls else { candle_core::bail!("{OP}: labels must be u32") };
        let labels = contiguous(labels, lab, OP, "labels")?;
        let (e, sc) = (self.eps, self.scale);
        let out =
            cpu_float!(OP, s, [F32, BF16, F16, F64], |v| cpu(contiguous(v, l, OP, "logits")?, labels, (n, k), e, sc));
        Ok((CpuStorage::F32(out), Shape::from(n * k + n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        ls: &candle_core::CudaStorage,
        lab: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, k) = dims(l, lab)?;
        let out = crate::cuda::loss::softmax_xent(s, l, ls, lab, (n, k), self.eps as f32, self.scale as f32)?;
        Ok((out, Shape::from(n * k + n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// The op against the formula written with candle ops (the explicit step's former implementation).
    #[test]
    fn matches_the_candle_op_formula() {
        let dev = Device::Cpu;
        for (n, k, eps, scale) in [(4, 10, 0.1, 64.0), (3, 1000, 0.0, 1.0), (5, 7, 0.3, 0.5)] {
            let logits = (Tensor::randn(0f32, 3.0, (n, k), &dev).unwrap() + 20.0).unwrap();
            let labels = Tensor::new((0..n as u32).map(|i| (i * 3) % k as u32).collect::<Vec<_>>(), &dev).unwrap();
            let (loss, grad) = softmax_xent(&logits, &labels, eps, scale).unwrap();
            let m = logits.max_keepdim(D::Minus1).unwrap();
            let shifted = logits.broadcast_sub(&m).unwrap();
            let e = shifted.exp().unwrap();
            let sum = e.sum_keepdim(D::Minus1).unwrap();
            let logp = shifted.broadcast_sub(&sum.log().unwrap()).unwrap();
            let p = e.broadcast_div(&sum).unwrap();
            let classes = Tensor::arange(0u32, k as u32, &dev).unwrap().unsqueeze(0).unwrap();
            let onehot = labels.unsqueeze(1).unwrap().broadcast_eq(&classes).unwrap().to_dtype(DType::F32).unwrap();
            let q = ((onehot * (1.0 - eps)).unwrap() + eps / k as f64).unwrap();
            let want_loss = ((&q * &logp).unwrap().sum_all().unwrap() * (-1.0 / n as f64)).unwrap();
            let want_grad = ((p - q).unwrap() * (scale / n as f64)).unwrap();
            let (a, b) = (loss.to_scalar::<f32>().unwrap(), want_loss.to_scalar::<f32>().unwrap());
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "({n}, {k}): loss {a} vs {b}");
            let d = (grad - want_grad).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d <= 1e-6 * scale as f32, "({n}, {k}): gradient off by {d}");
        }
        // bf16 logits: the same as their f32 values.
        let x = Tensor::randn(0f32, 1.0, (2, 5), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let labels = Tensor::new(&[4u32, 0], &dev).unwrap();
        let (a, _) = softmax_xent(&x, &labels, 0.1, 1.0).unwrap();
        let (b, _) = softmax_xent(&x.to_dtype(DType::F32).unwrap(), &labels, 0.1, 1.0).unwrap();
        assert_eq!(a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
        // One line for mismatched shapes.
        let e = softmax_xent(&x, &Tensor::new(&[1u32], &dev).unwrap(), 0.0, 1.0).unwrap_err().to_string();
        assert!(e.contains("labels of shape [1] for 2 rows"), "{e}");
    }
}
