//! 2D max-pooling (any kernel/stride/padding, NCHW or channels-last NHWC) with a backward pass, as candle custom ops.
//!
//! candle's own `max_pool2d` has no backward unless kernel == stride, so ResNet's 3x3/s2/p1 stem pool
//! cannot train with it. The backward recomputes each window's argmax (first maximum, as PyTorch) from the
//! input instead of storing indices, so no extra activation memory is kept.

use super::round_f32;
pub use crate::geom::MaxPool2d;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};
use half::{bf16, f16};

/// Applies max-pooling with backward support. `x`: (n, c, h, w).
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let op = MaxPool2d { kernel, stride, padding };
    op.check(x.dims())?;
    x.contiguous()?.apply_op1(op)
}

/// Visits every output element: `f(out_index, window input indices iterator)` via argmax search.
/// Returns for each output the flat input index of the first maximum of its window.
fn argmax_windows<T: WithDType>(
    p: &MaxPool2d,
    x: &[T],
    dims: (usize, usize, usize, usize),
    mut f: impl FnMut(usize, usize, T),
) {
    let (n, c, h, w) = dims;
    let (oh, ow) = (p.out_size(h), p.out_size(w));
    for plane in 0..n * c {
        let xin = &x[plane * h * w..(plane + 1) * h * w];
        for oy in 0..oh {
            let y0 = (oy * p.stride) as isize - p.padding as isize;
            for ox in 0..ow {
                let x0 = (ox * p.stride) as isize - p.padding as isize;
                let mut best: Option<(usize, T)> = None;
                for ky in 0..p.kernel as isize {
                    let yy = y0 + ky;
                    if yy < 0 || yy >= h as isize {
                        continue;
                    }
                    for kx in 0..p.kernel as isize {
                        let xx = x0 + kx;
                        if xx < 0 || xx >= w as isize {
                            continue;
                        }
                        let idx = yy as usize * w + xx as usize;
                        let v = xin[idx];
                        // `!(v <= best)` also lets a NaN win, so NaNs propagate as in PyTorch.
                        match best {
                            Some((_, b)) if !(v.to_f64() > b.to_f64() || v.to_f64().is_nan()) => {}
                            _ => best = Some((idx, v)),
                        }
                    }
                }
                // check() guarantees every window overlaps the input.
                let (idx, v) = best.expect("window overlaps the input");
                f(plane * oh * ow + oy * ow + ox, plane * h * w + idx, v);
            }
        }
    }
}

fn fwd_t<T: WithDType>(p: &MaxPool2d, x: &[T], dims: (usize, usize, usize, usize)) -> Vec<T> {
    let (n, c, h, w) = dims;
    let mut out = vec![T::zero(); n * c * p.out_size(h) * p.out_size(w)];
    argmax_windows(p, x, dims, |o, _i, v| out[o] = v);
    out
}

fn bwd_t<T: WithDType>(p: &MaxPool2d, x: &[T], g: &[T], dims: (usize, usize, usize, usize)) -> Vec<T> {
    let mut acc = vec![0f32; x.len()];
    argmax_windows(p, x, dims, |o, i, _v| acc[i] += g[o].to_f64() as f32);
    acc.into_iter().map(round_f32).collect()
}

fn contiguous_slice<'a, T>(data: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("max_pool2d: {what} must be contiguous"),
    }
}

impl CustomOp1 for MaxPool2d {
    fn name(&self) -> &'static str {
        "max_pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.check(l.dims())?;
        let out_shape = Shape::from((dims.0, dims.1, self.out_size(dims.2), self.out_size(dims.3)));
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(fwd_t(self, contiguous_slice(v, l, "input")?, dims)),
            CpuStorage::BF16(v) => CpuStorage::BF16(fwd_t::<bf16>(self, contiguous_slice(v, l, "input")?, dims)),
            CpuStorage::F16(v) => CpuStorage::F16(fwd_t::<f16>(self, contiguous_slice(v, l, "input")?, dims)),
            CpuStorage::F64(v) => CpuStorage::F64(fwd_t(self, contiguous_slice(v, l, "input")?, dims)),
            other => candle_core::bail!("max_pool2d: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, out_shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.check(l.dims())?;
        crate::cuda::pool::maxpool_fwd(self, s, l, dims)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.to_dtype(arg.dtype())?.contiguous()?;
        Ok(Some(arg.contiguous()?.apply_op2_no_bwd(&g, &MaxPool2dBackward(*self))?))
    }
}

/// Gradient of [`MaxPool2d`] with respect to its input: `(x, grad_out) -> grad_in`.
#[derive(Debug, Clone, Copy)]
pub struct MaxPool2dBackward(pub MaxPool2d);

impl CustomOp2 for MaxPool2dBackward {
    fn name(&self) -> &'static str {
        "max_pool2d_backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = &self.0;
        let dims = p.check(l1.dims())?;
        let expect = [dims.0, dims.1, p.out_size(dims.2), p.out_size(dims.3)];
        if l2.dims() != expect {
            candle_core::bail!("max_pool2d_backward: grad shape {:?}, expected {expect:?}", l2.dims());
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(bwd_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(bwd_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (CpuStorage::F16(x), CpuStorage::F16(g)) => {
                CpuStorage::F16(bwd_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (CpuStorage::F64(x), CpuStorage::F64(g)) => {
                CpuStorage::F64(bwd_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (a, b) => candle_core::bail!("max_pool2d_backward: unsupported dtypes {:?}/{:?}", a.dtype(), b.dtype()),
        };
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
        let dims = self.0.check(l1.dims())?;
        crate::cuda::pool::maxpool_bwd(&self.0, s1, l1, s2, l2, dims)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Channels-last (NHWC) max-pool: the same op over (n, h, w, c) tensors.
// ---------------------------------------------------------------------------------------------------------------

/// Max-pooling over a channels-last tensor with backward support. `x`: (n, h, w, c) -> (n, oh, ow, c).
///
/// Same semantics as [`max_pool2d`] on the permuted tensor: the first maximum of a window (scanned row by row)
/// wins ties, padded cells never win, NaNs propagate, and the backward recomputes each window's argmax.
pub fn max_pool2d_nhwc(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let op = MaxPool2dNhwc(MaxPool2d { kernel, stride, padding });
    op.0.check_nhwc(x.dims())?;
    x.contiguous()?.apply_op1(op)
}

/// NHWC counterpart of `argmax_windows`: for every output element (n, oy, ox, ch) in order, calls
/// `f(out_index, input_index_of_the_window_argmax, value)`. The window of every channel is scanned in the same
/// (ky, kx) order as the NCHW reference, so ties and NaNs resolve identically.
fn argmax_windows_nhwc<T: WithDType>(
    p: &MaxPool2d,
    x: &[T],
    dims: (usize, usize, usize, usize),
    mut f: impl FnMut(usize, usize, T),
) {
    let (n, h, w, c) = dims;
    let (oh, ow) = (p.out_size(h), p.out_size(w));
    let mut best_idx = vec![usize::MAX; c];
    let mut best_val = vec![T::zero(); c];
    for img in 0..n {
        let xin = &x[img * h * w * c..(img + 1) * h * w * c];
        for oy in 0..oh {
            let y0 = (oy * p.stride) as isize - p.padding as isize;
            for ox in 0..ow {
                let x0 = (ox * p.stride) as isize - p.padding as isize;
                best_idx.fill(usize::MAX);
                for ky in 0..p.kernel as isize {
                    let yy = y0 + ky;
                    if yy < 0 || yy >= h as isize {
                        continue;
                    }
                    for kx in 0..p.kernel as isize {
                        let xx = x0 + kx;
                        if xx < 0 || xx >= w as isize {
                            continue;
                        }
                        let base = (yy as usize * w + xx as usize) * c;
                        for ch in 0..c {
                            let v = xin[base + ch];
                            // Replace when empty, larger, or NaN (as the NCHW reference: NaNs propagate).
                            if best_idx[ch] == usize::MAX || v.to_f64() > best_val[ch].to_f64() || v.to_f64().is_nan() {
                                best_idx[ch] = base + ch;
                                best_val[ch] = v;
                            }
                        }
                    }
                }
                let o = ((img * oh + oy) * ow + ox) * c;
                for ch in 0..c {
                    // check_nhwc() guarantees every window overlaps the input.
                    debug_assert!(best_idx[ch] != usize::MAX, "window overlaps the input");
                    f(o + ch, img * h * w * c + best_idx[ch], best_val[ch]);
                }
            }
        }
    }
}

fn fwd_nhwc_t<T: WithDType>(p: &MaxPool2d, x: &[T], dims: (usize, usize, usize, usize)) -> Vec<T> {
    let (n, oh, ow, c) = p.out_shape_nhwc(dims);
    let mut out = vec![T::zero(); n * oh * ow * c];
    argmax_windows_nhwc(p, x, dims, |o, _i, v| out[o] = v);
    out
}

/// FP32 sums in output order ((oy, ox) ascending for every input element, as the NCHW reference and the CUDA
/// gather), rounded once to `T`.
fn bwd_nhwc_t<T: WithDType>(p: &MaxPool2d, x: &[T], g: &[T], dims: (usize, usize, usize, usize)) -> Vec<T> {
    let mut acc = vec![0f32; x.len()];
    argmax_windows_nhwc(p, x, dims, |o, i, _v| acc[i] += g[o].to_f64() as f32);
    acc.into_iter().map(round_f32).collect()
}

/// [`max_pool2d_nhwc`] as a candle custom op (forward; its backward is [`MaxPool2dNhwcBackward`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2dNhwc(pub MaxPool2d);

impl CustomOp1 for MaxPool2dNhwc {
    fn name(&self) -> &'static str {
        "max_pool2d_nhwc"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = &self.0;
        let dims = p.check_nhwc(l.dims())?;
        let out_shape = Shape::from(p.out_shape_nhwc(dims));
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(fwd_nhwc_t(p, contiguous_slice(v, l, "input")?, dims)),
            CpuStorage::BF16(v) => CpuStorage::BF16(fwd_nhwc_t::<bf16>(p, contiguous_slice(v, l, "input")?, dims)),
            CpuStorage::F16(v) => CpuStorage::F16(fwd_nhwc_t::<f16>(p, contiguous_slice(v, l, "input")?, dims)),
            CpuStorage::F64(v) => CpuStorage::F64(fwd_nhwc_t(p, contiguous_slice(v, l, "input")?, dims)),
            other => candle_core::bail!("max_pool2d_nhwc: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, out_shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.0.check_nhwc(l.dims())?;
        crate::cuda::pool::maxpool_nhwc_fwd(&self.0, s, l, dims)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.to_dtype(arg.dtype())?.contiguous()?;
        Ok(Some(arg.contiguous()?.apply_op2_no_bwd(&g, &MaxPool2dNhwcBackward(self.0))?))
    }
}

/// Gradient of [`MaxPool2dNhwc`] with respect to its input: `(x (n, h, w, c), grad_out (n, oh, ow, c)) -> grad_in`.
#[derive(Debug, Clone, Copy)]
pub struct MaxPool2dNhwcBackward(pub MaxPool2d);

impl CustomOp2 for MaxPool2dNhwcBackward {
    fn name(&self) -> &'static str {
        "max_pool2d_nhwc_backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = &self.0;
        let dims = p.check_nhwc(l1.dims())?;
        let (n, oh, ow, c) = p.out_shape_nhwc(dims);
        if l2.dims() != [n, oh, ow, c] {
            candle_core::bail!("max_pool2d_nhwc_backward: grad shape {:?}, expected {:?}", l2.dims(), [n, oh, ow, c]);
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(bwd_nhwc_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(bwd_nhwc_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (CpuStorage::F16(x), CpuStorage::F16(g)) => {
                CpuStorage::F16(bwd_nhwc_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (CpuStorage::F64(x), CpuStorage::F64(g)) => {
                CpuStorage::F64(bwd_nhwc_t(p, contiguous_slice(x, l1, "x")?, contiguous_slice(g, l2, "grad")?, dims))
            }
            (a, b) => {
                candle_core::bail!("max_pool2d_nhwc_backward: unsupported dtypes {:?}/{:?}", a.dtype(), b.dtype())
            }
        };
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
        let dims = self.0.check_nhwc(l1.dims())?;
        crate::cuda::pool::maxpool_nhwc_bwd(&self.0, s1, l1, s2, l2, dims)
    }
}
