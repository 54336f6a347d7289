//! Custom ops for ResNet training, swapped in for candle's defaults: each a candle custom op with a CPU
//! reference and (feature `cuda`) CUDA kernels.
//!
//! Layout (kernels/README.md has the whole map and how to add a kernel):
//! - [`policy`]: which implementation runs ([`KernelPolicy`]), passed with every call that has a choice;
//! - [`variants`]: the table of kernel variants (entry 0: candle's built-in path, then our tiles);
//! - [`geom`]: plain geometry shared by the ops and the launchers;
//! - [`ops`]: one module per op (CPU reference, candle op, dispatch);
//! - [`cuda`] (feature `cuda`): the backend: loader, autotune, TMA descriptors, launchers.
//!
//! The CPU implementations are the references the CUDA kernels are tested against, and they are what the
//! default (CPU-only) build runs.

#[macro_use]
mod dispatch;

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod geom;
pub mod ops;
pub mod policy;
pub mod shapes;
pub mod variants;

pub use geom::{conv_out_size, ConvGeom, ConvPass, GemmLayout};
pub use ops::avgpool::global_avg_pool_nhwc;
pub use ops::batchnorm::batch_norm_nhwc_train;
pub use ops::conv::conv2d;
pub use ops::conv_nhwc::{
    bn_relu_in_launches, conv2d_nhwc, conv2d_nhwc_forward, conv2d_nhwc_forward_bn_relu,
    conv2d_nhwc_forward_bn_relu_stats, conv2d_nhwc_forward_stats, conv2d_nhwc_grad_input,
    conv2d_nhwc_grad_input_bwd_sums, conv2d_nhwc_grad_input_join, conv2d_nhwc_grad_input_join_sums,
    conv2d_nhwc_grad_input_sums, conv2d_nhwc_grad_weight, conv2d_nhwc_grad_weight_bn_relu, conv2d_nhwc_reference,
    join_sums_launches, BwdSums,
};
pub use ops::input;
pub use ops::linear::linear;
pub use ops::maxpool::{max_pool2d, max_pool2d_nhwc, MaxPool2d, MaxPool2dNhwc};
pub use ops::residual::{add_relu_grad, bn_add_relu, relu_grad, BnParams};
pub use policy::{Autotuner, BnApplyInConv, ConvChoice, ConvImpl, KernelPolicy, MatmulChoice, MatmulImpl, Tuning};
