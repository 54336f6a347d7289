//! 2D max-pooling (any kernel/stride/padding, NCHW or channels-last NHWC) with a backward pass, as candle custom ops.
//!
//! candle's own `max_pool2d` has no backward unless kernel == stride, so ResNet's 3x3/s2/p1 stem pool
//! cannot train with it. The backward recomputes each window's argmax (first maximum, as PyTorch) from the
//! input instead of storing indices, so no extra activation memory is kept.

use super::round_f32;
use crate::dispatch::contiguous;
pub use crate::geom::MaxPool2d;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

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

impl CustomOp1 for MaxPool2d {
    fn name(&self) -> &'static str {
        "max_pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.check(l.dims())?;
        let out_shape = Shape::from((dims.0, dims.1, self.out_size(dims.2), self.out_size(dims.3)));
        let op = self.name();
        let out =
            cpu_float!(op, s, [F32, BF16, F16, F64], |v, wrap| wrap(fwd_t(self, contiguous(v, l, op, "input")?, dims)));
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
        let op = self.name();
        let out = cpu_float2!(op, (s1, s2), [F32, BF16, F16, F64], |x, g, wrap| {
            wrap(bwd_t(p, contiguous(x, l1, op, "x")?, contiguous(g, l2, op, "grad")?, dims))
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
        let op = self.name();
        let out = cpu_float!(op, s, [F32, BF16, F16, F64], |v, wrap| wrap(fwd_nhwc_t(
            p,
            contiguous(v, l, op, "input")?,
            dims
        )));
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
        let op = self.name();
        let out = cpu_float2!(op, (s1, s2), [F32, BF16, F16, F64], |x, g, wrap| {
            wrap(bwd_nhwc_t(p, contiguous(x, l1, op, "x")?, contiguous(g, l2, op, "grad")?, dims))
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
        let dims = self.0.check_nhwc(l1.dims())?;
        crate::cuda::pool::maxpool_nhwc_bwd(&self.0, s1, l1, s2, l2, dims)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Channels-last max-pool backward from stored window offsets: the training step keeps these (one byte per output
// element) instead of the pool's input (ResNet's stem: 4x the output's elements at 2 bytes each, 411 MB at batch
// 256), so the input is freed right after the forward.
// ---------------------------------------------------------------------------------------------------------------

/// The argmax of every window of a channels-last max-pool as its offset in the window, `ky * kernel + kx`:
/// `x (n, h, w, c) -> offsets (n, oh, ow, c) U8`, the same argmax as [`MaxPool2dNhwc`] (the first maximum wins
/// ties, a NaN wins). Needs kernel^2 <= 255. No backward: [`MaxPool2dNhwcBackwardOffsets`] is the pool's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2dNhwcOffsets(pub MaxPool2d);

impl MaxPool2dNhwcOffsets {
    fn check(&self, dims: &[usize]) -> Result<(usize, usize, usize, usize)> {
        let dims = self.0.check_nhwc(dims)?;
        if self.0.kernel * self.0.kernel > 255 {
            candle_core::bail!(
                "max_pool2d_nhwc_offsets: a {0}x{0} window has more cells than a byte counts",
                self.0.kernel
            );
        }
        Ok(dims)
    }
}

fn offsets_nhwc_t<T: WithDType>(p: &MaxPool2d, x: &[T], dims: (usize, usize, usize, usize)) -> Vec<u8> {
    let (n, oh, ow, c) = p.out_shape_nhwc(dims);
    let (h, w) = (dims.1, dims.2);
    let mut out = vec![0u8; n * oh * ow * c];
    argmax_windows_nhwc(p, x, dims, |o, i, _v| {
        let (po, pi) = (o / c, i / c);
        let (oy, ox) = ((po / ow) % oh, po % ow);
        let (iy, ix) = ((pi / w) % h, pi % w);
        let ky = iy + p.padding - oy * p.stride;
        let kx = ix + p.padding - ox * p.stride;
        out[o] = (ky * p.kernel + kx) as u8;
    });
    out
}

impl CustomOp1 for MaxPool2dNhwcOffsets {
    fn name(&self) -> &'static str {
        "max_pool2d_nhwc_offsets"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = &self.0;
        let dims = self.check(l.dims())?;
        let op = self.name();
        let out = cpu_float!(op, s, [F32, BF16, F16, F64], |v| offsets_nhwc_t(p, contiguous(v, l, op, "input")?, dims));
        Ok((CpuStorage::U8(out), Shape::from(p.out_shape_nhwc(dims))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.check(l.dims())?;
        crate::cuda::pool::maxpool_nhwc_offsets(&self.0, s, l, dims)
    }
}

/// Gradient of [`MaxPool2dNhwc`] from the window offsets of [`MaxPool2dNhwcOffsets`]: `(offsets (n, oh, ow, c)
/// U8, grad_out (n, oh, ow, c)) -> grad_in (n, h, w, c)` with (h, w) the pool's input size. Bit for bit
/// [`MaxPool2dNhwcBackward`]'s result: each input cell sums, in FP32 and in (oy, ox) order, the gradients of the
/// windows whose argmax it is, rounded once. `in_hw` must be the size the offsets were taken at (several input
/// sizes pool to one output size, so the op cannot tell): an offset that points outside the input, or the
/// sentinel 255, is an error on the CPU, while the CUDA gather never visits such a cell and drops its gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2dNhwcBackwardOffsets {
    pub pool: MaxPool2d,
    /// The pool's input height and width.
    pub in_hw: (usize, usize),
}

impl MaxPool2dNhwcBackwardOffsets {
    /// (n, h, w, c) of the input gradient, after checking both operands' shapes.
    fn dims(&self, off: &[usize], grad: &[usize]) -> Result<(usize, usize, usize, usize)> {
        const OP: &str = "max_pool2d_nhwc_backward_offsets";
        let [n, _, _, c] = off else { candle_core::bail!("{OP}: offsets of shape {off:?}, expected (n, oh, ow, c)") };
        let dims = (*n, self.in_hw.0, self.in_hw.1, *c);
        let want = self.pool.out_shape_nhwc(MaxPool2dNhwcOffsets(self.pool).check(&[dims.0, dims.1, dims.2, dims.3])?);
        let want = [want.0, want.1, want.2, want.3];
        if off != want || grad != want {
            candle_core::bail!("{OP}: offsets {off:?} and grad {grad:?} for an input of {dims:?}, expected {want:?}");
        }
        Ok(dims)
    }
}

fn bwd_offsets_nhwc_t<T: WithDType>(
    p: &MaxPool2d,
    off: &[u8],
    g: &[T],
    (n, h, w, c): (usize, usize, usize, usize),
) -> Result<Vec<T>> {
    let (oh, ow) = (p.out_size(h), p.out_size(w));
    let mut acc = vec![0f32; n * h * w * c];
    // Outputs in order, as the reference's argmax walk: every input cell receives its windows in (oy, ox) order.
    for img in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                let o = ((img * oh + oy) * ow + ox) * c;
                for ch in 0..c {
                    let k = off[o + ch] as usize;
                    let iy = (oy * p.stride + k / p.kernel).checked_sub(p.padding).filter(|&v| v < h);
                    let ix = (ox * p.stride + k % p.kernel).checked_sub(p.padding).filter(|&v| v < w);
                    let (Some(iy), Some(ix), true) = (iy, ix, k < p.kernel * p.kernel) else {
                        candle_core::bail!(
                            "max_pool2d_nhwc_backward_offsets: offset {k} of window ({oy}, {ox}) is outside the input"
                        )
                    };
                    acc[((img * h + iy) * w + ix) * c + ch] += g[o + ch].to_f64() as f32;
                }
            }
        }
    }
    Ok(acc.into_iter().map(round_f32).collect())
}

impl CustomOp2 for MaxPool2dNhwcBackwardOffsets {
    fn name(&self) -> &'static str {
        "max_pool2d_nhwc_backward_offsets"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (p, dims) = (&self.pool, self.dims(l1.dims(), l2.dims())?);
        let op = self.name();
        let CpuStorage::U8(off) = s1 else {
            candle_core::bail!("{op}: offsets of dtype {:?}, expected u8", s1.dtype())
        };
        let off = contiguous(off, l1, op, "offsets")?;
        let out = cpu_float!(op, s2, [F32, BF16, F16, F64], |g, wrap| {
            wrap(bwd_offsets_nhwc_t(p, off, contiguous(g, l2, op, "grad")?, dims)?)
        });
        Ok((out, Shape::from(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(l1.dims(), l2.dims())?;
        let dx = crate::cuda::pool::maxpool_nhwc_bwd_offsets(&self.pool, s1, l1, s2, l2, dims)?;
        Ok((dx, Shape::from(dims)))
    }
}

/// [`MaxPool2dNhwcBackwardOffsets`] of the sum of two gradients: (offsets, g1, g2) -> dx for the gradient
/// g1 + g2 (each element rounded once to the dtype, as candle's add rounds it), equal to the two-operand op on
/// `g1 + g2` bit for bit. On CUDA the stem's pool (kernel 3, stride 2, padding 1, 8-channel multiples) reads both
/// gradients in its one pass (the ResNet stem's gradient is the first block's main path plus its shortcut: the
/// separate add moved 3 x 103 MB at ResNet-152's batch 256); use [`max_pool2d_nhwc_backward_offsets_sum`], which
/// takes this op where it applies and adds first elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2dNhwcBackwardOffsetsSum(pub MaxPool2dNhwcBackwardOffsets);

/// dx of the max-pool with offsets `off` for the gradient g1 + g2 (see [`MaxPool2dNhwcBackwardOffsetsSum`]).
pub fn max_pool2d_nhwc_backward_offsets_sum(
    off: &Tensor,
    g1: &Tensor,
    g2: &Tensor,
    op: MaxPool2dNhwcBackwardOffsets,
) -> Result<Tensor> {
    let fused = g1.device().is_cuda()
        && g1.dims().last().is_some_and(|&c| MaxPool2dNhwcBackwardOffsetsSum::applies(&op.pool, c))
        && g1.dtype() == g2.dtype();
    if fused {
        #[cfg(feature = "cuda")]
        {
            let (g1, g2) = (super::aligned(g1)?, super::aligned(g2)?);
            let off = off.contiguous()?;
            if off.layout().start_offset() % 8 == 0 {
                return off.apply_op3_no_bwd(&g1, &g2, &MaxPool2dNhwcBackwardOffsetsSum(op));
            }
        }
    }
    off.apply_op2_no_bwd(&(g1 + g2)?, &op)
}

impl MaxPool2dNhwcBackwardOffsetsSum {
    /// Whether the one-pass CUDA kernel serves pool `p` at `c` channels: the stem's pool (kernel 3, stride 2,
    /// padding 1) and c % 8 == 0. Its operands must also start on 16-byte boundaries (the offsets on 8-byte ones).
    pub fn applies(p: &MaxPool2d, c: usize) -> bool {
        (p.kernel, p.stride, p.padding) == (3, 2, 1) && c.is_multiple_of(8)
    }

    /// (n, h, w, c) of the input gradient: both gradients of one shape, checked with the offsets as the
    /// one-gradient op checks them.
    fn dims(&self, off: &Layout, g1: &Layout, g2: &Layout) -> Result<(usize, usize, usize, usize)> {
        if g1.dims() != g2.dims() {
            candle_core::bail!("{}: gradients of shapes {:?} and {:?}", self.name(), g1.dims(), g2.dims());
        }
        self.0.dims(off.dims(), g1.dims())
    }
}

impl CustomOp3 for MaxPool2dNhwcBackwardOffsetsSum {
    fn name(&self) -> &'static str {
        "max_pool2d_nhwc_backward_offsets_sum"
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
        let op = self.name();
        let (p, dims) = (&self.0.pool, self.dims(l1, l2, l3)?);
        let CpuStorage::U8(off) = s1 else {
            candle_core::bail!("{op}: offsets of dtype {:?}, expected u8", s1.dtype())
        };
        let off = contiguous(off, l1, op, "offsets")?;
        let out = cpu_float2!(op, (s2, s3), [F32, BF16, F16, F64], |a, b, wrap| {
            let (a, b) = (contiguous(a, l2, op, "grad")?, contiguous(b, l3, op, "second grad")?);
            let g: Vec<_> = a.iter().zip(b).map(|(&x, &y)| x + y).collect();
            wrap(bwd_offsets_nhwc_t(p, off, &g, dims)?)
        });
        Ok((out, Shape::from(dims)))
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
        let dims = self.dims(l1, l2, l3)?;
        let dx = crate::cuda::pool::maxpool_nhwc_bwd_offsets_sum(&self.0.pool, s1, l1, (s2, l2), (s3, l3), dims)?;
        Ok((dx, Shape::from(dims)))
    }
}
