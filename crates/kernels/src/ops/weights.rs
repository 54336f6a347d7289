//! The convolution weights of a training step in the kernels' layout: FP32 masters (k, c, r, s) -> the
//! activation dtype in (k, r, s, c). On CUDA in bf16/f16 one multi-tensor launch writes all of them into one flat
//! buffer (`kernels/optim/01_multi_tensor.cu`, `mt_weights_krsc_*`) and each weight is a view into it, each
//! starting on a 128-byte boundary; elsewhere each weight is cast and permuted by candle (two ops each).
//! [`conv_grads_kcrs`] is the reverse for the step's grad-weights: (k, r, s, c) in the activation dtype -> FP32
//! (k, c, r, s), on CUDA all in one launch into one flat FP32 buffer.

use candle_core::{DType, Result, Tensor};

/// `weights` ((k, c, r, s) each) in `dtype`, permuted to (k, r, s, c), contiguous, in the same order.
pub fn conv_weights_krsc(weights: &[&Tensor], dtype: DType) -> Result<Vec<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(first) = weights.first() {
        let fits = first.device().is_cuda()
            && matches!(dtype, DType::BF16 | DType::F16)
            && weights
                .iter()
                .all(|w| w.dtype() == DType::F32 && w.rank() == 4 && w.device().same_device(first.device()));
        if fits {
            return Ok(conv_weights_krsc_flat(weights, dtype)?.1);
        }
    }
    weights.iter().map(|w| w.to_dtype(dtype)?.permute((0, 2, 3, 1))?.contiguous()).collect()
}

/// [`conv_weights_krsc`] on CUDA in bf16/f16 (FP32 (k, c, r, s) weights on one CUDA device): the flat buffer of
/// [`crate::cuda::optim::krsc_offsets`]' layout, written by one launch, and each weight's (k, r, s, c) view of it.
#[cfg(feature = "cuda")]
pub fn conv_weights_krsc_flat(weights: &[&Tensor], dtype: DType) -> Result<(Tensor, Vec<Tensor>)> {
    let Some(first) = weights.first() else { candle_core::bail!("conv_weights_krsc: no weights") };
    let ws: Vec<Tensor> = weights.iter().map(|w| w.contiguous()).collect::<Result<_>>()?;
    let lens: Vec<usize> = ws.iter().map(|w| w.elem_count()).collect();
    let (offs, _) = crate::cuda::optim::krsc_offsets(&lens);
    let flat = first.apply_op1_no_bwd(&WeightsKrsc { weights: ws.clone(), dtype })?;
    let views = ws
        .iter()
        .zip(offs)
        .map(|(w, off)| {
            let (k, c, r, s) = w.dims4()?;
            flat.narrow(0, off, w.elem_count())?.reshape((k, r, s, c))
        })
        .collect::<Result<_>>()?;
    Ok((flat, views))
}

/// `grads` ((k, r, s, c) each, bf16/f16 on CUDA or any dtype elsewhere) as FP32 (k, c, r, s) contiguous tensors,
/// in the same order. On CUDA in bf16/f16 they are views of one flat buffer written by one launch.
pub fn conv_grads_kcrs(grads: &[Tensor]) -> Result<Vec<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(first) = grads.first() {
        let dtype = first.dtype();
        let fits = first.device().is_cuda()
            && matches!(dtype, DType::BF16 | DType::F16)
            && grads.iter().all(|g| g.dtype() == dtype && g.rank() == 4 && g.device().same_device(first.device()));
        if fits {
            let gs: Vec<Tensor> = grads.iter().map(|g| g.contiguous()).collect::<Result<_>>()?;
            let shapes: Vec<(usize, usize, usize, usize)> =
                gs.iter().map(|g| g.dims4().map(|(k, r, s, c)| (k, c, r, s))).collect::<Result<_>>()?;
            let lens: Vec<usize> = gs.iter().map(|g| g.elem_count()).collect();
            let (offs, total) = crate::cuda::optim::krsc_offsets(&lens);
            // Not zero-filled: the launch writes every element of every gradient's range, and only those ranges
            // are handed out (the alignment padding between them is never read). The zero fill cost a 232 MB
            // memset a ResNet-152 step.
            let flat = crate::cuda::empty_f32(first, total)?;
            let refs: Vec<&Tensor> = gs.iter().collect();
            crate::cuda::optim::grads_kcrs(&refs, &shapes, &flat)?;
            return shapes
                .iter()
                .zip(offs)
                .map(|(&(k, c, r, s), off)| flat.narrow(0, off, k * c * r * s)?.reshape((k, c, r, s)))
                .collect();
        }
    }
    grads.iter().map(|g| g.permute((0, 3, 1, 2))?.to_dtype(DType::F32)?.contiguous()).collect()
}

/// The flat output of [`conv_weights_krsc`] on CUDA; the op's argument only names the device (CUDA only).
#[cfg(feature = "cuda")]
struct WeightsKrsc {
    weights: Vec<Tensor>,
    dtype: DType,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp1 for WeightsKrsc {
    fn name(&self) -> &'static str {
        "conv_weights_krsc"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("conv_weights_krsc: the flat op is CUDA only (the CPU casts and permutes per weight)")
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let lens: Vec<usize> = self.weights.iter().map(|w| w.elem_count()).collect();
        let (_, total) = crate::cuda::optim::krsc_offsets(&lens);
        let dev = &s.device;
        // The padding between weights is never read; every weight element is written by the launch.
        let out = match self.dtype {
            DType::BF16 => candle_core::CudaStorage::wrap_cuda_slice(
                crate::cuda::alloc_out::<half::bf16>(dev, total)?,
                dev.clone(),
            ),
            DType::F16 => {
                candle_core::CudaStorage::wrap_cuda_slice(crate::cuda::alloc_out::<half::f16>(dev, total)?, dev.clone())
            }
            other => candle_core::bail!("conv_weights_krsc: dtype {other:?} (bf16 or f16 only)"),
        };
        let refs: Vec<&Tensor> = self.weights.iter().collect();
        crate::cuda::optim::weights_krsc(&refs, &out)?;
        Ok((out, candle_core::Shape::from(total)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The CPU paths: (k, c, r, s) -> (k, r, s, c) in the dtype and back to FP32 (k, c, r, s), element by element.
    #[test]
    fn weights_round_trip_on_the_cpu() -> Result<()> {
        let dev = Device::Cpu;
        let ws: Vec<Tensor> = [(4, 3, 7, 7), (8, 4, 1, 1), (2, 5, 3, 3)]
            .iter()
            .map(|&s| Tensor::randn(0f32, 1.0, s, &dev))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = ws.iter().collect();
        for dt in [DType::F32, DType::BF16] {
            let krsc = conv_weights_krsc(&refs, dt)?;
            for (w, k) in ws.iter().zip(&krsc) {
                let (ko, c, r, s) = w.dims4()?;
                assert_eq!(k.dims(), &[ko, r, s, c]);
                assert_eq!(k.dtype(), dt);
                // Element (o, ci, y, x) of the master sits at (o, y, x, ci).
                let (wv, kv) = (w.to_dtype(dt)?.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?);
                for (o, ci, y, x) in [(0, 0, 0, 0), (ko - 1, c - 1, r - 1, s - 1), (ko / 2, c / 2, r / 2, s / 2)] {
                    let a = wv.get(o)?.get(ci)?.get(y)?.get(x)?.to_scalar::<f32>()?;
                    let b = kv.get(o)?.get(y)?.get(x)?.get(ci)?.to_scalar::<f32>()?;
                    assert_eq!(a, b, "{dt:?} {:?} ({o}, {ci}, {y}, {x})", w.dims());
                }
            }
            let back = conv_grads_kcrs(&krsc)?;
            for (w, b) in ws.iter().zip(&back) {
                assert_eq!(b.dims(), w.dims());
                assert_eq!(b.dtype(), DType::F32);
                let want = w.to_dtype(dt)?.to_dtype(DType::F32)?;
                let d = (b - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert_eq!(d, 0.0, "{dt:?} {:?}: the way back differs", w.dims());
            }
        }
        Ok(())
    }
}
