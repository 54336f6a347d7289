//! Global average pool over a channels-last tensor, with backward, as candle custom ops.
//!
//! Forward: x (n, h, w, c) -> (n, c), the mean over (h, w) of every (image, channel), accumulated in FP32 (FP64
//! for FP64 inputs) in ascending spatial order and rounded once to x's dtype. Backward: dx = dy / (h * w)
//! broadcast over (h, w), computed in FP32 and rounded once. The CUDA kernels (`kernels/pool/01_avgpool.cu`)
//! sum in the same order, so they match this reference bit for bit.

use crate::dispatch::contiguous;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, WithDType};

/// Global average pool of a channels-last tensor: x (n, h, w, c) -> (n, c) in x's dtype, FP32 accumulation.
pub fn global_avg_pool_nhwc(x: &Tensor) -> Result<Tensor> {
    check(x.dims())?;
    x.contiguous()?.apply_op1(GlobalAvgPoolNhwc)
}

fn check(dims: &[usize]) -> Result<(usize, usize, usize, usize)> {
    match *dims {
        [n, h, w, c] if h * w * c > 0 => Ok((n, h, w, c)),
        _ => candle_core::bail!("global_avg_pool_nhwc expects a (n, h, w, c) tensor with h, w, c >= 1, got {dims:?}"),
    }
}

/// `v` (an `A` value) rounded once to `T`: to nearest even for bf16/f16 (as the CUDA kernels), exact otherwise.
fn round<T: WithDType, A: WithDType>(v: A) -> T {
    if A::DTYPE == DType::F32 {
        super::round_f32(v.to_f64() as f32)
    } else {
        T::from_f64(v.to_f64())
    }
}

/// Means over (h, w) accumulated in f32 (f64 for f64 inputs), in ascending spatial order per channel.
fn fwd_t<T: WithDType>(x: &[T], dims: (usize, usize, usize, usize)) -> Vec<T> {
    if T::DTYPE == DType::F64 {
        fwd_acc::<T, f64>(x, dims)
    } else {
        fwd_acc::<T, f32>(x, dims)
    }
}

/// dy / (h * w) broadcast over (h, w), computed in f32 (f64 for f64 inputs) and rounded once.
fn bwd_t<T: WithDType>(dy: &[T], dims: (usize, usize, usize, usize)) -> Vec<T> {
    if T::DTYPE == DType::F64 {
        bwd_acc::<T, f64>(dy, dims)
    } else {
        bwd_acc::<T, f32>(dy, dims)
    }
}

/// [`fwd_t`] accumulating in `A`.
fn fwd_acc<T: WithDType, A: WithDType>(x: &[T], (n, h, w, c): (usize, usize, usize, usize)) -> Vec<T> {
    let hw = h * w;
    let count = A::from_f64(hw as f64);
    let mut out = Vec::with_capacity(n * c);
    let mut acc = vec![A::zero(); c];
    for img in x.chunks_exact(hw * c).take(n) {
        acc.fill(A::zero());
        for row in img.chunks_exact(c) {
            for (a, v) in acc.iter_mut().zip(row) {
                *a += A::from_f64(v.to_f64());
            }
        }
        out.extend(acc.iter().map(|&a| round::<T, A>(a / count)));
    }
    out
}

/// dx[n, y, x, ch] = dy[n, ch] / (h * w), computed in `A` and rounded once to `T`.
fn bwd_acc<T: WithDType, A: WithDType>(dy: &[T], (n, h, w, c): (usize, usize, usize, usize)) -> Vec<T> {
    let hw = h * w;
    let count = A::from_f64(hw as f64);
    let mut out = Vec::with_capacity(n * hw * c);
    for g in dy.chunks_exact(c).take(n) {
        let row: Vec<T> = g.iter().map(|&v| round::<T, A>(A::from_f64(v.to_f64()) / count)).collect();
        for _ in 0..hw {
            out.extend_from_slice(&row);
        }
    }
    out
}

/// [`global_avg_pool_nhwc`] as a candle custom op; its backward is [`GlobalAvgPoolNhwcBackward`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalAvgPoolNhwc;

impl CustomOp1 for GlobalAvgPoolNhwc {
    fn name(&self) -> &'static str {
        "global_avg_pool_nhwc"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = check(l.dims())?;
        let op = self.name();
        let out = cpu_float!(op, s, [F32, BF16, F16, F64], |v, wrap| wrap(fwd_t(contiguous(v, l, op, "input")?, dims)));
        Ok((out, Shape::from((dims.0, dims.3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = check(l.dims())?;
        crate::cuda::pool::avgpool_nhwc_fwd(s, l, dims)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (_, h, w, _) = check(arg.dims())?;
        let g = grad_res.to_dtype(arg.dtype())?.contiguous()?;
        Ok(Some(g.apply_op1_no_bwd(&GlobalAvgPoolNhwcBackward { h, w })?))
    }
}

/// Gradient of [`GlobalAvgPoolNhwc`]: dy (n, c) -> dx (n, h, w, c) = dy / (h * w) broadcast over (h, w).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalAvgPoolNhwcBackward {
    pub h: usize,
    pub w: usize,
}

impl GlobalAvgPoolNhwcBackward {
    fn dims(&self, l: &Layout) -> Result<(usize, usize, usize, usize)> {
        match *l.dims() {
            [n, c] if self.h * self.w * c > 0 => Ok((n, self.h, self.w, c)),
            _ => candle_core::bail!(
                "global_avg_pool_nhwc_backward: grad shape {:?} is not (n, c) with c >= 1, or h x w = {} x {} is empty",
                l.dims(),
                self.h,
                self.w
            ),
        }
    }
}

impl CustomOp1 for GlobalAvgPoolNhwcBackward {
    fn name(&self) -> &'static str {
        "global_avg_pool_nhwc_backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l)?;
        let op = self.name();
        let out = cpu_float!(op, s, [F32, BF16, F16, F64], |v, wrap| wrap(bwd_t(contiguous(v, l, op, "input")?, dims)));
        Ok((out, Shape::from(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(l)?;
        crate::cuda::pool::avgpool_nhwc_bwd(s, l, dims)
    }
}
