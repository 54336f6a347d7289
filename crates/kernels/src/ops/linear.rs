//! Fully connected layer y = x w^T + b on our tensor-core GEMM (`kernels/gemm/`, CUDA BF16/FP16, launchers in
//! [`crate::cuda::gemm`]) or on candle's matmul (cuBLAS on CUDA, gemm on the CPU), as the policy says.

use crate::policy::{KernelPolicy, MatmulImpl};
use candle_core::{DType, Result, Tensor};

/// Whether our GEMM runs this input (CUDA, BF16/FP16).
pub fn kernels_apply(x: &Tensor) -> bool {
    x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16)
}

/// y = x w^T + b with backward. x: (m, k), w: (n, k), b: (n) -> (m, n), all of one dtype.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor, policy: &KernelPolicy) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (n, wk) = w.dims2()?;
    if wk != k || b.dims() != [n] {
        candle_core::bail!(
            "linear: x {:?}, weight {:?}, bias {:?} do not fit (expected (m, k), (n, k), (n))",
            x.dims(),
            w.dims(),
            b.dims()
        );
    }
    match policy.matmul {
        #[cfg(feature = "cuda")]
        MatmulImpl::Custom if kernels_apply(x) => cuda_ops::linear(x, w, b, policy),
        MatmulImpl::Custom | MatmulImpl::Cublas => x.matmul(&w.t()?)?.broadcast_add(b),
    }
}

#[cfg(feature = "cuda")]
pub use cuda_ops::{matmul, matmul_bias};

/// The candle ops over the GEMM launcher.
#[cfg(feature = "cuda")]
mod cuda_ops {
    use crate::cuda::gemm::gemm_storage;
    use crate::geom::GemmLayout;
    use crate::ops::aligned;
    use crate::policy::{KernelPolicy, Tuning};
    use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

    /// C = A B in one layout (no backward).
    #[derive(Debug, Clone)]
    struct GemmOp {
        layout: GemmLayout,
        m: usize,
        n: usize,
        k: usize,
        tuning: Tuning,
    }

    impl CustomOp2 for GemmOp {
        fn name(&self) -> &'static str {
            "matmul"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("our matmul runs on CUDA only (candle's matmul is the CPU path)")
        }
        fn cuda_fwd(
            &self,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let c = gemm_storage(&self.tuning, self.layout, (self.m, self.n, self.k), (s1, l1), (s2, l2), None)?;
            Ok((c, Shape::from((self.m, self.n))))
        }
    }

    /// The differentiable Linear op: (x, w, b) -> x w^T + b, the bias fused into the GEMM's epilogue.
    #[derive(Debug, Clone)]
    struct LinearOp {
        m: usize,
        n: usize,
        k: usize,
        tuning: Tuning,
    }

    impl CustomOp3 for LinearOp {
        fn name(&self) -> &'static str {
            "linear"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("our linear runs on CUDA only (candle's matmul is the CPU path)")
        }
        fn cuda_fwd(
            &self,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let mnk = (self.m, self.n, self.k);
            let c = gemm_storage(&self.tuning, GemmLayout::Nt, mnk, (s1, l1), (s2, l2), Some((s3, l3)))?;
            Ok((c, Shape::from((self.m, self.n))))
        }
        fn bwd(
            &self,
            x: &Tensor,
            w: &Tensor,
            b: &Tensor,
            _y: &Tensor,
            dy: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let dy = aligned(&dy.to_dtype(x.dtype())?)?;
            let dx = if x.track_op() { Some(gemm(&dy, w, GemmLayout::Nn, &self.tuning)?) } else { None };
            let dw = gemm(&dy, x, GemmLayout::Tn, &self.tuning)?;
            let db = dy.to_dtype(DType::F32)?.sum(0)?.to_dtype(b.dtype())?;
            Ok((dx, Some(dw), Some(db)))
        }
    }

    /// Differentiable x w^T + b on our GEMM.
    pub(super) fn linear(x: &Tensor, w: &Tensor, b: &Tensor, policy: &KernelPolicy) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        let n = w.dim(0)?;
        let op = LinearOp { m, n, k, tuning: policy.tuning.clone() };
        aligned(x)?.apply_op3(&aligned(w)?, &aligned(b)?, op)
    }

    fn gemm(a: &Tensor, b: &Tensor, layout: GemmLayout, tuning: &Tuning) -> Result<Tensor> {
        let (a0, a1) = a.dims2()?;
        let (b0, b1) = b.dims2()?;
        let (m, k, kb, n) = match layout {
            GemmLayout::Nt => (a0, a1, b1, b0),
            GemmLayout::Nn => (a0, a1, b0, b1),
            GemmLayout::Tn => (a1, a0, b0, b1),
        };
        if k != kb {
            candle_core::bail!("matmul ({layout:?}): inner dimensions differ, a {:?} b {:?}", a.dims(), b.dims());
        }
        aligned(a)?.apply_op2_no_bwd(&aligned(b)?, &GemmOp { layout, m, n, k, tuning: tuning.clone() })
    }

    /// C = A B in one of the three layouts (no backward), tiles as `policy.tuning` picks. Nt: a (m, k), b (n, k);
    /// Nn: a (m, k), b (k, n); Tn: a (k, m), b (k, n).
    pub fn matmul(a: &Tensor, b: &Tensor, layout: GemmLayout, policy: &KernelPolicy) -> Result<Tensor> {
        gemm(a, b, layout, &policy.tuning)
    }

    /// Nt matmul with the fused bias (no backward).
    pub fn matmul_bias(a: &Tensor, b: &Tensor, bias: &Tensor, policy: &KernelPolicy) -> Result<Tensor> {
        let (m, k) = a.dims2()?;
        let n = b.dim(0)?;
        let op = LinearOp { m, n, k, tuning: policy.tuning.clone() };
        aligned(a)?.apply_op3_no_bwd(&aligned(b)?, &aligned(bias)?, &op)
    }
}
