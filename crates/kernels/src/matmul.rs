//! Fully connected layer y = x w^T + b on our tensor-core GEMM (`kernels/gemm/`, CUDA BF16/FP16) or on
//! candle's matmul (cuBLAS on CUDA, gemm on the CPU), chosen by [`set_matmul_impl`].

use candle_core::{Result, Tensor};
use std::sync::atomic::{AtomicU8, Ordering};

/// Which matmul [`linear`] runs (`kernels.matmul` in the trainer's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulImpl {
    /// candle's matmul (cuBLAS on CUDA). The default.
    Cublas = 0,
    /// Our tensor-core GEMM with the bias add fused into its epilogue (CUDA, BF16/FP16; candle's matmul
    /// otherwise).
    Custom = 1,
}

static MATMUL_IMPL: AtomicU8 = AtomicU8::new(MatmulImpl::Cublas as u8);

/// Selects the matmul of every later [`linear`] call in this process.
pub fn set_matmul_impl(m: MatmulImpl) {
    MATMUL_IMPL.store(m as u8, Ordering::Relaxed);
}

pub fn matmul_impl() -> MatmulImpl {
    if MATMUL_IMPL.load(Ordering::Relaxed) == MatmulImpl::Custom as u8 {
        MatmulImpl::Custom
    } else {
        MatmulImpl::Cublas
    }
}

/// y = x w^T + b with backward. x: (m, k), w: (n, k), b: (n) -> (m, n), all of one dtype.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
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
    #[cfg(feature = "cuda")]
    if matmul_impl() == MatmulImpl::Custom && crate::cuda_gemm::gemm_supported(x) {
        return crate::cuda_gemm::linear(x, w, b);
    }
    x.matmul(&w.t()?)?.broadcast_add(b)
}
