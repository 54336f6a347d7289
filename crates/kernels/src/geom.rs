//! Plain geometry shared by the ops and the CUDA launchers: output sizes, convolution and pooling parameters,
//! GEMM operand layouts. Nothing here touches a device, so both layers import it and neither imports the other
//! upwards.

/// Output size of one spatial dimension of a convolution or pooling window (floor mode, dilation 1): the one
/// formula every layer of this crate, the model and the benchmarks use.
pub fn conv_out_size(input: usize, k: usize, stride: usize, padding: usize) -> usize {
    (input + 2 * padding - k) / stride + 1
}

/// Geometry of a channels-last convolution: x (n, h, w, c), w (ko, r, r, c), y (n, p, q, ko).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeom {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub ko: usize,
    pub r: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvGeom {
    pub fn p(&self) -> usize {
        conv_out_size(self.h, self.r, self.stride, self.pad)
    }
    pub fn q(&self) -> usize {
        conv_out_size(self.w, self.r, self.stride, self.pad)
    }
    /// FLOPs of the forward pass (2 per multiply-add); grad-input and grad-weight cost the same.
    pub fn flops(&self) -> f64 {
        2.0 * (self.n * self.p() * self.q() * self.ko * self.r * self.r * self.c) as f64
    }
    /// 1x1, stride 1, no padding: a plain GEMM over channels-last rows.
    pub fn is_plain(&self) -> bool {
        self.r == 1 && self.stride == 1 && self.pad == 0
    }
}

/// A pass of a convolution: forward, grad-input, grad-weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvPass {
    Fwd,
    Dgrad,
    Wgrad,
}

impl ConvPass {
    pub const ALL: [ConvPass; 3] = [ConvPass::Fwd, ConvPass::Dgrad, ConvPass::Wgrad];

    pub fn name(self) -> &'static str {
        match self {
            ConvPass::Fwd => "fwd",
            ConvPass::Dgrad => "dgrad",
            ConvPass::Wgrad => "wgrad",
        }
    }
}

/// Operand layouts of the GEMM kernels (row-major storage): see kernels/gemm/01_mma_cp_async.cu.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmLayout {
    /// C[M][N] = A[M][K] B[N][K]^T (+ bias)
    Nt,
    /// C[M][N] = A[M][K] B[K][N]
    Nn,
    /// C[M][N] = A[K][M]^T B[K][N]
    Tn,
}

impl GemmLayout {
    pub fn tag(self) -> &'static str {
        match self {
            GemmLayout::Nt => "nt",
            GemmLayout::Nn => "nn",
            GemmLayout::Tn => "tn",
        }
    }
}

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
        conv_out_size(input, self.kernel, self.stride, self.padding)
    }

    fn check_params(&self, dims: &[usize], op: &str, layout: &str, spatial: (usize, usize)) -> Result<(), String> {
        if dims.len() != 4 {
            return Err(format!("{op} expects a {layout} tensor, got shape {dims:?}"));
        }
        if self.kernel == 0 || self.stride == 0 || 2 * self.padding > self.kernel {
            return Err(format!("{op}: invalid parameters {self:?} (padding must be at most half the kernel)"));
        }
        let (h, w) = (dims[spatial.0], dims[spatial.1]);
        if h + 2 * self.padding < self.kernel || w + 2 * self.padding < self.kernel {
            return Err(format!("{op}: input {dims:?} is smaller than the {}x{} window", self.kernel, self.kernel));
        }
        Ok(())
    }

    /// (n, c, h, w) of an NCHW input, checked against the window.
    pub fn check(&self, dims: &[usize]) -> candle_core::Result<(usize, usize, usize, usize)> {
        self.check_params(dims, "max_pool2d", "(n, c, h, w)", (2, 3)).map_err(candle_core::Error::Msg)?;
        Ok((dims[0], dims[1], dims[2], dims[3]))
    }

    /// (n, h, w, c) of a channels-last input, checked against the window.
    pub fn check_nhwc(&self, dims: &[usize]) -> candle_core::Result<(usize, usize, usize, usize)> {
        self.check_params(dims, "max_pool2d_nhwc", "(n, h, w, c)", (1, 2)).map_err(candle_core::Error::Msg)?;
        Ok((dims[0], dims[1], dims[2], dims[3]))
    }

    /// Output shape (n, oh, ow, c) of a channels-last input (n, h, w, c).
    pub fn out_shape_nhwc(&self, (n, h, w, c): (usize, usize, usize, usize)) -> (usize, usize, usize, usize) {
        (n, self.out_size(h), self.out_size(w), c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_sizes() {
        assert_eq!(conv_out_size(224, 7, 2, 3), 112);
        assert_eq!(conv_out_size(112, 3, 2, 1), 56);
        assert_eq!(conv_out_size(56, 1, 1, 0), 56);
        assert_eq!(conv_out_size(7, 3, 2, 1), 4);
        let g = ConvGeom { n: 2, h: 56, w: 28, c: 64, ko: 128, r: 3, stride: 2, pad: 1 };
        assert_eq!((g.p(), g.q()), (28, 14));
        assert_eq!(g.flops(), 2.0 * (2 * 28 * 14 * 128 * 9 * 64) as f64);
        assert!(!g.is_plain());
    }

    #[test]
    fn maxpool_checks_name_the_problem() {
        let p = MaxPool2d { kernel: 3, stride: 2, padding: 1 };
        assert_eq!(p.check(&[1, 2, 5, 5]).unwrap(), (1, 2, 5, 5));
        assert!(p.check(&[1, 2, 5]).unwrap_err().to_string().contains("(n, c, h, w)"));
        let bad = MaxPool2d { kernel: 2, stride: 2, padding: 2 };
        assert!(bad.check_nhwc(&[1, 4, 4, 3]).unwrap_err().to_string().contains("padding"));
        assert!(p.check_nhwc(&[1, 1, 0, 3]).unwrap_err().to_string().contains("smaller"));
        assert_eq!(p.out_shape_nhwc((2, 7, 7, 8)), (2, 4, 4, 8));
    }
}
