//! The element-wise work of a residual block, fused, for the explicit training step: BatchNorm + residual add +
//! ReLU in the forward ([`bn_add_relu`]) and the ReLU gradient joined with the residual gradient in the backward
//! ([`relu_grad`], [`add_relu_grad`]). No backward of their own: the step calls them explicitly.
//!
//! Channels-last: a (.., c) tensor is viewed as (rows, c). Per-channel tensors are FP32 ([`BnParams`]). Every
//! value is computed in FP32 and rounded once to the storage dtype. CUDA kernels: `kernels/residual/01_fused.cu`
//! (launchers in `cuda/residual.rs`).

use super::round_f32;
use crate::dispatch::contiguous;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

/// A training-mode BatchNorm's per-channel tensors: the batch statistics (3, c) = [mean, var, invstd] from
/// [`super::batchnorm::BnStats`], weight and bias (c), all f32.
#[derive(Debug, Clone)]
pub struct BnParams {
    pub stats: Tensor,
    pub weight: Tensor,
    pub bias: Tensor,
}

impl BnParams {
    fn check(&self, c: usize, op: &str) -> Result<()> {
        for (t, n, what) in [(&self.stats, 3 * c, "stats"), (&self.weight, c, "weight"), (&self.bias, c, "bias")] {
            if t.elem_count() != n || t.dtype() != DType::F32 {
                candle_core::bail!("{op}: {what} must hold {n} f32 values, got {:?} {:?}", t.dims(), t.dtype());
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn tensors(&self) -> crate::cuda::residual::BnTensors<'_> {
        crate::cuda::residual::BnTensors { stats: &self.stats, weight: &self.weight, bias: &self.bias }
    }

    /// (mean, scale = invstd * weight, bias) per channel (CPU).
    fn consts(&self) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let s = self.stats.flatten_all()?.to_vec1::<f32>()?;
        let w = self.weight.flatten_all()?.to_vec1::<f32>()?;
        let b = self.bias.flatten_all()?.to_vec1::<f32>()?;
        let c = w.len();
        let scale = s[2 * c..].iter().zip(&w).map(|(i, w)| i * w).collect();
        Ok((s[..c].to_vec(), scale, b))
    }
}

/// y = relu(bn(z) + r), or relu(bn(z) + bn_r(r)) when `res_bn` is given (the downsample branch normalised in
/// the same pass). z, r: (.., c) of one dtype (f32/bf16/f16), same shape. ReLU of NaN is 0, as the BatchNorm
/// kernels' fused ReLU.
pub fn bn_add_relu(z: &Tensor, r: &Tensor, bn: &BnParams, res_bn: Option<&BnParams>) -> Result<Tensor> {
    let op = BnAddRelu { bn: bn.clone(), res_bn: res_bn.cloned() };
    z.contiguous()?.apply_op2_no_bwd(&r.contiguous()?, &op)
}

/// out = g where y > 0, else 0: the gradient through a ReLU from its saved output y (blocked at y == 0, as
/// PyTorch's `threshold_backward`).
pub fn relu_grad(g: &Tensor, y: &Tensor) -> Result<Tensor> {
    g.contiguous()?.apply_op2_no_bwd(&y.contiguous()?, &ReluGrad)
}

/// out = (a + b) where y > 0, else 0: two gradient contributions (a block's main path and its shortcut) joined
/// and passed through the ReLU whose output is y, in one pass.
pub fn add_relu_grad(a: &Tensor, b: &Tensor, y: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op3_no_bwd(&b.contiguous()?, &y.contiguous()?, &ReluGrad)
}

fn channels(l: &Layout, op: &str) -> Result<usize> {
    match l.dims().split_last() {
        Some((&c, lead)) if c > 0 && !lead.is_empty() => Ok(c),
        _ => candle_core::bail!("{op}: expects a (.., c) tensor, got {:?}", l.dims()),
    }
}

fn same_shape(ls: &[&Layout], op: &str) -> Result<()> {
    if ls.iter().any(|l| l.dims() != ls[0].dims()) {
        candle_core::bail!("{op}: operand shapes differ: {:?}", ls.iter().map(|l| l.dims()).collect::<Vec<_>>());
    }
    Ok(())
}

#[inline]
fn f32_of<T: WithDType>(v: T) -> f32 {
    v.to_f64() as f32
}

/// The fused forward (see [`bn_add_relu`]): arguments (z, r).
#[derive(Debug, Clone)]
pub struct BnAddRelu {
    pub bn: BnParams,
    pub res_bn: Option<BnParams>,
}

impl BnAddRelu {
    fn run<T: WithDType>(&self, z: &[T], r: &[T], c: usize) -> Result<Vec<T>> {
        let (m, s, b) = self.bn.consts()?;
        let res = self.res_bn.as_ref().map(|p| p.consts()).transpose()?;
        let mut out = Vec::with_capacity(z.len());
        for (zr, rr) in z.chunks_exact(c).zip(r.chunks_exact(c)) {
            for ch in 0..c {
                let v = (f32_of(zr[ch]) - m[ch]) * s[ch] + b[ch];
                let rv = match &res {
                    Some((rm, rs, rb)) => (f32_of(rr[ch]) - rm[ch]) * rs[ch] + rb[ch],
                    None => f32_of(rr[ch]),
                };
                let sum = v + rv;
                out.push(round_f32::<T>(if sum > 0.0 { sum } else { 0.0 }));
            }
        }
        Ok(out)
    }
}

impl CustomOp2 for BnAddRelu {
    fn name(&self) -> &'static str {
        "bn_add_relu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        same_shape(&[l1, l2], op)?;
        let c = channels(l1, op)?;
        self.bn.check(c, op)?;
        if let Some(p) = &self.res_bn {
            p.check(c, op)?;
        }
        let out = cpu_float2!(op, (s1, s2), [F32, BF16, F16], |z, r, wrap| {
            wrap(self.run(contiguous(z, l1, op, "z")?, contiguous(r, l2, op, "r")?, c)?)
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let op = self.name();
        same_shape(&[l1, l2], op)?;
        let c = channels(l1, op)?;
        self.bn.check(c, op)?;
        if let Some(p) = &self.res_bn {
            p.check(c, op)?;
        }
        let y = crate::cuda::residual::bn_add_relu(
            (s1, l1),
            (s2, l2),
            self.bn.tensors(),
            self.res_bn.as_ref().map(|p| p.tensors()),
            c,
        )?;
        Ok((y, l1.shape().clone()))
    }
}

/// The ReLU gradient: as a CustomOp2 (g, y) -> [`relu_grad`], as a CustomOp3 (a, b, y) -> [`add_relu_grad`].
#[derive(Debug, Clone, Copy)]
pub struct ReluGrad;

fn relu_grad_t<T: WithDType>(a: &[T], b: Option<&[T]>, y: &[T]) -> Vec<T> {
    (0..a.len())
        .map(|i| {
            let s = match b {
                Some(b) => f32_of(a[i]) + f32_of(b[i]),
                None => f32_of(a[i]),
            };
            round_f32::<T>(if f32_of(y[i]) > 0.0 { s } else { 0.0 })
        })
        .collect()
}

fn relu_grad_cpu(args: &[(&CpuStorage, &Layout)], op: &str) -> Result<CpuStorage> {
    let layouts: Vec<&Layout> = args.iter().map(|(_, l)| *l).collect();
    same_shape(&layouts, op)?;
    macro_rules! run {
        ($variant:ident) => {{
            let mut v = Vec::with_capacity(args.len());
            for (s, l) in args {
                match s {
                    CpuStorage::$variant(d) => v.push(contiguous(d, l, op, "operands")?),
                    other => candle_core::bail!("{op}: mixed dtypes ({:?})", other.dtype()),
                }
            }
            let (a, y) = (v[0], v[v.len() - 1]);
            let b = if v.len() == 3 { Some(v[1]) } else { None };
            CpuStorage::$variant(relu_grad_t(a, b, y))
        }};
    }
    Ok(match args[0].0 {
        CpuStorage::F32(_) => run!(F32),
        CpuStorage::BF16(_) => run!(BF16),
        CpuStorage::F16(_) => run!(F16),
        other => candle_core::bail!("{op}: unsupported dtype {:?}", other.dtype()),
    })
}

impl CustomOp2 for ReluGrad {
    fn name(&self) -> &'static str {
        "relu_grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((relu_grad_cpu(&[(s1, l1), (s2, l2)], "relu_grad")?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        same_shape(&[l1, l2], "relu_grad")?;
        Ok((crate::cuda::residual::relu_grad((s1, l1), None, (s2, l2))?, l1.shape().clone()))
    }
}

impl CustomOp3 for ReluGrad {
    fn name(&self) -> &'static str {
        "add_relu_grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((relu_grad_cpu(&[(s1, l1), (s2, l2), (s3, l3)], "add_relu_grad")?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        same_shape(&[l1, l2, l3], "add_relu_grad")?;
        Ok((crate::cuda::residual::relu_grad((s1, l1), Some((s2, l2)), (s3, l3))?, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bn(c: usize, seed: f32) -> Result<BnParams> {
        let d = &Device::Cpu;
        let mean: Vec<f32> = (0..c).map(|i| 0.1 * i as f32 - seed).collect();
        let var: Vec<f32> = (0..c).map(|i| 0.5 + 0.25 * i as f32).collect();
        let inv: Vec<f32> = var.iter().map(|v| 1.0 / (v + 1e-5f32).sqrt()).collect();
        let stats = Tensor::from_vec([mean, var, inv].concat(), (3, c), d)?;
        let weight = Tensor::from_vec((0..c).map(|i| 1.0 + 0.1 * i as f32).collect::<Vec<_>>(), c, d)?;
        let bias = Tensor::from_vec((0..c).map(|i| seed - 0.05 * i as f32).collect::<Vec<_>>(), c, d)?;
        Ok(BnParams { stats, weight, bias })
    }

    /// The composition the autograd model runs: bn(z) [+ bn_r(r)] + r, relu, in f32.
    fn composed(z: &Tensor, r: &Tensor, p: &BnParams, pr: Option<&BnParams>) -> Result<Tensor> {
        let c = z.dim(3)?;
        let norm = |x: &Tensor, p: &BnParams| -> Result<Tensor> {
            let mean = p.stats.get(0)?.reshape((1, 1, 1, c))?;
            let inv = p.stats.get(2)?.reshape((1, 1, 1, c))?;
            x.broadcast_sub(&mean)?
                .broadcast_mul(&inv)?
                .broadcast_mul(&p.weight.reshape((1, 1, 1, c))?)?
                .broadcast_add(&p.bias.reshape((1, 1, 1, c))?)
        };
        let res = match pr {
            Some(q) => norm(r, q)?,
            None => r.clone(),
        };
        (norm(z, p)? + res)?.relu()
    }

    #[test]
    fn bn_add_relu_matches_the_composition() -> Result<()> {
        let d = &Device::Cpu;
        let (c, shape) = (12, (2, 3, 5, 12));
        let z = Tensor::randn(0f32, 2.0, shape, d)?;
        let r = Tensor::randn(0f32, 2.0, shape, d)?;
        let (p, q) = (bn(c, 0.3)?, bn(c, -0.2)?);
        for res in [None, Some(&q)] {
            let got = bn_add_relu(&z, &r, &p, res)?;
            let want = composed(&z, &r, &p, res)?;
            let err = (got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(err < 1e-5, "residual bn {}: max error {err}", res.is_some());
            // Some outputs are clipped and some pass: the test exercises both sides of the ReLU.
            let zeros = want.eq(0f32)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
            assert!(zeros > 0.0 && zeros < want.elem_count() as f32);
        }
        // bf16: the same values rounded once.
        let (zb, rb) = (z.to_dtype(DType::BF16)?, r.to_dtype(DType::BF16)?);
        let got = bn_add_relu(&zb, &rb, &p, Some(&q))?.to_dtype(DType::F32)?;
        let want = composed(&zb.to_dtype(DType::F32)?, &rb.to_dtype(DType::F32)?, &p, Some(&q))?;
        let err = ((got - &want)?.abs()? / (want.abs()? + 1e-3)?)?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(err <= 1.0 / 128.0, "bf16 relative error {err}");
        Ok(())
    }

    #[test]
    fn relu_grad_masks_by_the_saved_output() -> Result<()> {
        let d = &Device::Cpu;
        let y = Tensor::new(&[[0f32, 1.5, 0.0, 2.0], [3.0, 0.0, 0.25, 0.0]], d)?;
        let a = Tensor::new(&[[1f32, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], d)?;
        let b = Tensor::new(&[[10f32, 20.0, 30.0, 40.0], [50.0, 60.0, 70.0, 80.0]], d)?;
        assert_eq!(relu_grad(&a, &y)?.to_vec2::<f32>()?, [[0.0, 2.0, 0.0, 4.0], [5.0, 0.0, 7.0, 0.0]]);
        assert_eq!(add_relu_grad(&a, &b, &y)?.to_vec2::<f32>()?, [[0.0, 22.0, 0.0, 44.0], [55.0, 0.0, 77.0, 0.0]]);
        let h = |t: &Tensor| t.to_dtype(DType::F16);
        let got = add_relu_grad(&h(&a)?, &h(&b)?, &h(&y)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        assert_eq!(got, [[0.0, 22.0, 0.0, 44.0], [55.0, 0.0, 77.0, 0.0]]);
        assert!(add_relu_grad(&a, &b, &y.narrow(1, 0, 2)?).is_err(), "mismatched shapes must be refused");
        Ok(())
    }
}
