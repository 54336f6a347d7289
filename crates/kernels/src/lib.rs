//! Custom ops for ResNet training, each a candle custom op with a CPU reference and (feature `cuda`) a CUDA kernel.
//!
//! The CPU implementations are the references the CUDA kernels are tested against, and they are what the
//! default (CPU-only) build runs.

pub mod avgpool;
pub mod batchnorm;
pub mod conv;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_bn;
#[cfg(feature = "cuda")]
pub mod cuda_gemm;
pub mod igemm;
pub mod matmul;
pub mod maxpool;
#[cfg(feature = "cuda")]
pub mod multi_tensor;
pub mod shapes;

pub use avgpool::global_avg_pool_nhwc;
pub use batchnorm::batch_norm_nhwc_train;
pub use conv::{conv2d, conv_impl, set_conv_impl, ConvImpl};
pub use igemm::{conv2d_nhwc, conv2d_nhwc_reference};
pub use matmul::{linear, matmul_impl, set_matmul_impl, MatmulImpl};
pub use maxpool::{max_pool2d, MaxPool2d};
pub use maxpool::{max_pool2d_nhwc, MaxPool2dNhwc};

/// Errors of this crate's ops.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {msg}")]
    Invalid { op: &'static str, msg: String },
}
