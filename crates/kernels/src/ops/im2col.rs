//! Explicit im2col of a channels-last tensor as a candle custom op: the rows the stem's convolution multiplies
//! (`crate::cuda::im2col`), exposed so the two CUDA kernels that write them can be checked against this CPU
//! reference and benchmarked on their own.
//!
//! x (n, h, w, c) -> cols (n * p * q, K'): row (img, oh, ow), column k' = (r * R + s) * C + ch for k' < K = R*R*C
//! holds x[img][oh * stride - pad + r][ow * stride - pad + s][ch] (0 outside the image), columns K..K' (K rounded up
//! to 8) are 0. Pure data movement: every kernel matches this reference bit for bit.

use crate::dispatch::contiguous;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};

/// Which CUDA kernel writes the rows (`kernels/conv/06_im2col.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Im2colKernel {
    /// The launcher's choice: [`Im2colKernel::Rows`] where its shared-memory tile fits, else `Gather`.
    Auto,
    /// `im2col_rows`: one block per output row, the input rows staged in shared memory.
    Rows,
    /// `im2col_nhwc`: one thread per 16-byte chunk, each element gathered from global memory.
    Gather,
}

/// [`im2col_nhwc`]'s geometry and kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Im2colNhwc {
    pub r: usize,
    pub stride: usize,
    pub pad: usize,
    pub kernel: Im2colKernel,
}

/// im2col of x (n, h, w, c) for an r x r window at `stride` and `pad`: (n * p * q, K') with K' = r*r*c rounded up
/// to 8 (see the module docs). The CUDA path takes bf16/f16 and `kernel`; the CPU path any float dtype.
pub fn im2col_nhwc(x: &Tensor, r: usize, stride: usize, pad: usize, kernel: Im2colKernel) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&Im2colNhwc { r, stride, pad, kernel })
}

impl Im2colNhwc {
    /// (n, h, w, c, p, q, K') of an input of shape `dims`, or a one-line error naming what is wrong.
    pub(crate) fn geometry(&self, dims: &[usize]) -> Result<(usize, usize, usize, usize, usize, usize, usize)> {
        let [n, h, w, c] = *dims else {
            candle_core::bail!("im2col_nhwc: input of shape {dims:?}, expected (n, h, w, c)")
        };
        if self.r == 0 || self.stride == 0 || c == 0 || h + 2 * self.pad < self.r || w + 2 * self.pad < self.r {
            candle_core::bail!(
                "im2col_nhwc: a {0}x{0} window at stride {1}, padding {2} does not fit an input of shape {dims:?}",
                self.r,
                self.stride,
                self.pad
            );
        }
        let p = (h + 2 * self.pad - self.r) / self.stride + 1;
        let q = (w + 2 * self.pad - self.r) / self.stride + 1;
        Ok((n, h, w, c, p, q, (self.r * self.r * c).next_multiple_of(8)))
    }
}

fn cpu_t<T: WithDType>(
    x: &[T],
    g: &Im2colNhwc,
    (n, h, w, c, p, q, kp): (usize, usize, usize, usize, usize, usize, usize),
) -> Vec<T> {
    let k = g.r * g.r * c;
    let mut out = vec![T::zero(); n * p * q * kp];
    for (row, dst) in out.chunks_exact_mut(kp).enumerate() {
        let (img, oh, ow) = (row / (p * q), row / q % p, row % q);
        for (kk, d) in dst.iter_mut().enumerate().take(k) {
            let (tap, ch) = (kk / c, kk % c);
            let (ih, iw) = (
                (oh * g.stride + tap / g.r) as isize - g.pad as isize,
                (ow * g.stride + tap % g.r) as isize - g.pad as isize,
            );
            if ih >= 0 && iw >= 0 && (ih as usize) < h && (iw as usize) < w {
                *d = x[((img * h + ih as usize) * w + iw as usize) * c + ch];
            }
        }
    }
    out
}

impl CustomOp1 for Im2colNhwc {
    fn name(&self) -> &'static str {
        "im2col_nhwc"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let geo = self.geometry(l.dims())?;
        let op = self.name();
        let out =
            cpu_float!(op, s, [F32, BF16, F16, F64], |v, wrap| wrap(cpu_t(contiguous(v, l, op, "input")?, self, geo)));
        Ok((out, Shape::from((geo.0 * geo.4 * geo.5, geo.6))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let geo = self.geometry(l.dims())?;
        crate::cuda::im2col::im2col_op(self, s, l, geo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A 1-channel 3x3 image, 2x2 window, stride 1, padding 1: (3 + 2 - 2) + 1 = 4 outputs a side, K = 4 -> K' = 8.
    #[test]
    fn rows_hold_the_windows_with_zero_padding() -> Result<()> {
        let x = Tensor::arange(1f32, 10., &Device::Cpu)?.reshape((1, 3, 3, 1))?;
        let cols = im2col_nhwc(&x, 2, 1, 1, Im2colKernel::Auto)?;
        assert_eq!(cols.dims(), &[16, 8]);
        let v = cols.to_vec2::<f32>()?;
        // Output (0, 0): window rows -1..0, columns -1..0: only x[0][0] = 1 inside, at tap (1, 1).
        assert_eq!(v[0], [0., 0., 0., 1., 0., 0., 0., 0.]);
        // Output (1, 1): rows 0..1, columns 0..1.
        assert_eq!(v[5], [1., 2., 4., 5., 0., 0., 0., 0.]);
        // Output (3, 3): rows 2..3, columns 2..3: only x[2][2] = 9, at tap (0, 0).
        assert_eq!(v[15], [9., 0., 0., 0., 0., 0., 0., 0.]);
        Ok(())
    }

    /// 3 channels, 7x7 at stride 2 (the ResNet stem) on two odd-sized images: every element as indexed by hand.
    #[test]
    fn stem_geometry_matches_direct_indexing() -> Result<()> {
        let (n, h, w, c) = (2, 9, 7, 3);
        let x =
            Tensor::arange(0f32, (n * h * w * c) as f32, &Device::Cpu)?.reshape((n, h, w, c))?.to_dtype(DType::BF16)?;
        let cols = im2col_nhwc(&x, 7, 2, 3, Im2colKernel::Auto)?;
        let (p, q) = ((h + 6 - 7) / 2 + 1, (w + 6 - 7) / 2 + 1);
        assert_eq!(cols.dims(), &[n * p * q, 152]);
        let v = cols.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for img in 0..n {
            for oh in 0..p {
                for ow in 0..q {
                    let row = &v[(img * p + oh) * q + ow];
                    for (kk, &got) in row.iter().enumerate() {
                        let want = if kk < 147 {
                            let (r, s, ch) = (kk / 21, kk / 3 % 7, kk % 3);
                            let (ih, iw) = ((oh * 2 + r) as isize - 3, (ow * 2 + s) as isize - 3);
                            if (0..h as isize).contains(&ih) && (0..w as isize).contains(&iw) {
                                xs[((img * h + ih as usize) * w + iw as usize) * c + ch]
                            } else {
                                0.
                            }
                        } else {
                            0.
                        };
                        assert_eq!(got, want, "img {img} ({oh}, {ow}) column {kk}");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bad_geometry_is_one_error_line() {
        let x = Tensor::zeros((1, 2, 2, 3), DType::F32, &Device::Cpu).unwrap();
        let e = im2col_nhwc(&x, 7, 2, 1, Im2colKernel::Auto).unwrap_err().to_string();
        assert!(e.contains("im2col_nhwc: a 7x7 window at stride 2, padding 1 does not fit"), "{e}");
        let e = im2col_nhwc(&x.flatten_all().unwrap(), 3, 1, 1, Im2colKernel::Auto).unwrap_err().to_string();
        assert!(e.contains("expected (n, h, w, c)"), "{e}");
    }
}
