//! 2D convolution whose backward pass uses only forward convolutions (im2col + GEMM on either backend).
//!
//! candle's own conv2d backward computes grad-input with `conv_transpose2d`, a direct (naive) kernel on CUDA and
//! a loop nest on the CPU. Here grad-input is a forward conv of the zero-dilated, padded output gradient with the
//! flipped, transposed kernel, and grad-weight is a forward conv of the transposed input with the transposed
//! gradient (as candle does). The forward result is computed by candle's conv2d outside the graph and attached
//! to (x, w) by a custom op, so the backward is ours.

use crate::policy::ConvImpl;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// Stride and symmetric zero padding of a square-kernel convolution (dilation 1, one group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dParams {
    pub stride: usize,
    pub padding: usize,
}

/// Convolution with the backward described above, or candle's own under [`ConvImpl::Candle`].
/// x: (n, c_in, h, w), w: (c_out, c_in, k, k). NCHW always: a model under [`ConvImpl::Custom`] runs channels-last
/// through [`super::conv_nhwc::conv2d_nhwc`], whose CPU reference comes here with the forward-conv backward.
pub fn conv2d(x: &Tensor, w: &Tensor, stride: usize, padding: usize, imp: ConvImpl) -> Result<Tensor> {
    match imp {
        ConvImpl::Candle => return x.conv2d(w, padding, stride, 1, 1),
        ConvImpl::FwdConv | ConvImpl::Custom => {}
    }
    let y = x.detach().conv2d(&w.detach(), padding, stride, 1, 1)?;
    if !(x.track_op() || w.track_op()) {
        return Ok(y);
    }
    x.apply_op3_arc(w, &y, std::sync::Arc::new(Box::new(Conv2dParams { stride, padding })))
}

/// grad-input of a conv: `g` (n, c_out, oh, ow) -> (n, c_in, h, w) through forward convs only.
pub fn conv2d_grad_input(g: &Tensor, w: &Tensor, p: Conv2dParams, in_hw: (usize, usize)) -> Result<Tensor> {
    let (n, c_out, oh, ow) = g.dims4()?;
    let k = w.dim(2)?;
    let s = p.stride;
    // Zero-dilate by the stride: (oh-1)*s+1 rows.
    let g = if s > 1 {
        let z = g.zeros_like()?;
        let mut parts = vec![g.unsqueeze(4)?];
        for _ in 1..s {
            parts.push(z.unsqueeze(4)?);
        }
        let g = Tensor::cat(&parts, 4)?.reshape((n, c_out, oh, ow * s))?.narrow(3, 0, (ow - 1) * s + 1)?;
        let zr = g.zeros_like()?;
        let mut parts = vec![g.unsqueeze(3)?];
        for _ in 1..s {
            parts.push(zr.unsqueeze(3)?);
        }
        let dw = (ow - 1) * s + 1;
        Tensor::cat(&parts, 3)?.reshape((n, c_out, oh * s, dw))?.narrow(2, 0, (oh - 1) * s + 1)?
    } else {
        g.clone()
    };
    // Full padding k-1-p, plus the rows/cols the strided forward never reached (bottom/right).
    let (h, wd) = in_hw;
    let base = k - 1 - p.padding;
    let extra_h = h + 2 * p.padding - k - (oh - 1) * s;
    let extra_w = wd + 2 * p.padding - k - (ow - 1) * s;
    let g = g.pad_with_zeros(2, base, base + extra_h)?.pad_with_zeros(3, base, base + extra_w)?;
    let wf = w.flip(&[2, 3])?.transpose(0, 1)?.contiguous()?; // (c_in, c_out, k, k)
    g.conv2d(&wf, 0, 1, 1, 1)
}

/// grad-weight of a conv: x (n, c_in, h, w), g (n, c_out, oh, ow) -> (c_out, c_in, k, k).
pub fn conv2d_grad_weight(x: &Tensor, g: &Tensor, p: Conv2dParams, k: usize) -> Result<Tensor> {
    // Correlate each input channel with each output-gradient channel over the batch: the batch becomes the
    // channel dimension and the stride becomes the dilation.
    let xt = x.transpose(0, 1)?.contiguous()?; // (c_in, n, h, w)
    let gt = g.transpose(0, 1)?.contiguous()?; // (c_out, n, oh, ow)
    let gw = xt.conv2d(&gt, p.padding, 1, p.stride, 1)?; // (c_in, c_out, k', k')
    let gw = gw.narrow(2, 0, k)?.narrow(3, 0, k)?;
    gw.transpose(0, 1)?.contiguous()
}

impl CustomOp3 for Conv2dParams {
    fn name(&self) -> &'static str {
        "conv2d_fwd_conv_bwd"
    }

    // The third argument is the already computed output: pass it through.
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((y.try_clone(ly)?, ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((y.try_clone(ly)?, ly.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_, _, h, wd) = x.dims4()?;
        let k = w.dim(2)?;
        let g = g.to_dtype(x.dtype())?;
        let gx = if x.track_op() { Some(conv2d_grad_input(&g, w, *self, (h, wd))?) } else { None };
        let gw = conv2d_grad_weight(x, &g, *self, k)?;
        Ok((gx, Some(gw), None))
    }
}
