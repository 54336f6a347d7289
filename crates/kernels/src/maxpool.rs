//! 2D max-pooling (any kernel/stride/padding, NCHW) with a backward pass, as a candle custom op.
//!
//! candle's own `max_pool2d` has no backward unless kernel == stride, so ResNet's 3x3/s2/p1 stem pool
//! cannot train with it. The backward recomputes each window's argmax (first maximum, as PyTorch) from the
//! input instead of storing indices, so no extra activation memory is kept.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};
use half::{bf16, f16};

/// Max-pool parameters: square kernel, stride and padding (padded cells never win).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2d {
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl MaxPool2d {
    /// Output size of one spatial dimension (floor mode, as PyTorch's default).
    pub fn out_size(&self, input: usize) -> usize {
        (input + 2 * self.padding - self.kernel) / self.stride + 1
    }

    fn check(&self, dims: &[usize]) -> Result<(usize, usize, usize, usize)> {
        if dims.len() != 4 {
            candle_core::bail!("max_pool2d expects a (n, c, h, w) tensor, got shape {dims:?}");
        }
        if self.kernel == 0 || self.stride == 0 || 2 * self.padding > self.kernel {
            candle_core::bail!("max_pool2d: invalid parameters {self:?} (padding must be at most half the kernel)");
        }
        if dims[2] + 2 * self.padding < self.kernel || dims[3] + 2 * self.padding < self.kernel {
            candle_core::bail!("max_pool2d: input {dims:?} is smaller than the {}x{} window", self.kernel, self.kernel);
        }
        Ok((dims[0], dims[1], dims[2], dims[3]))
    }
}

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
    acc.into_iter().map(|v| T::from_f64(v as f64)).collect()
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
        crate::cuda::maxpool_fwd(self, s, l, dims)
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
        crate::cuda::maxpool_bwd(&self.0, s1, l1, s2, l2, dims)
    }
}
