//! Channels-last (NHWC) convolution: implicit-GEMM tensor-core kernels on CUDA for BF16/FP16 (forward,
//! grad-input and grad-weight, `kernels/conv/`), candle's convolution through permutes elsewhere (CPU, FP32).
//!
//! Layouts: activations x (n, h, w, c), weights (k, r, s, c) ("KRSC": output channel, kernel row, kernel column,
//! input channel), outputs (n, p, q, k). The model keeps its FP32 master weights in torchvision's (k, c, r, s)
//! order and permutes the low-precision copy it makes each step.

use crate::conv::conv2d;
use candle_core::{Result, Tensor};

/// Output size of one spatial dimension of a convolution.
pub fn conv_out_size(input: usize, k: usize, stride: usize, padding: usize) -> usize {
    (input + 2 * padding - k) / stride + 1
}

fn check_nhwc(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<()> {
    let (_, h, wd, c) = x.dims4()?;
    let (_, r, s, wc) = w.dims4()?;
    if wc != c || r != s {
        candle_core::bail!(
            "conv2d_nhwc: weight {:?} does not match input {:?} (expected (k, r, r, {c}))",
            w.dims(),
            x.dims()
        );
    }
    if stride == 0 || h + 2 * padding < r || wd + 2 * padding < s {
        candle_core::bail!(
            "conv2d_nhwc: input {:?} too small for a {r}x{s} kernel (stride {stride}, padding {padding})",
            x.dims()
        );
    }
    if x.dtype() != w.dtype() {
        candle_core::bail!("conv2d_nhwc: input is {:?} but weight is {:?}", x.dtype(), w.dtype());
    }
    Ok(())
}

/// Convolution over channels-last tensors with backward. x: (n, h, w, c), w: (k, r, r, c) -> (n, p, q, k).
pub fn conv2d_nhwc(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    check_nhwc(x, w, stride, padding)?;
    #[cfg(feature = "cuda")]
    if crate::cuda_gemm::conv_supported(x) {
        return crate::cuda_gemm::conv2d_nhwc(x, w, stride, padding);
    }
    conv2d_nhwc_reference(x, w, stride, padding)
}

/// The same convolution through candle's NCHW conv2d and permutes (differentiable): the CPU path and the
/// reference the CUDA kernels are tested against.
pub fn conv2d_nhwc_reference(x: &Tensor, w: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    let xn = x.permute((0, 3, 1, 2))?.contiguous()?;
    let wn = w.permute((0, 3, 1, 2))?.contiguous()?;
    conv2d(&xn, &wn, stride, padding)?.permute((0, 2, 3, 1))?.contiguous()
}
