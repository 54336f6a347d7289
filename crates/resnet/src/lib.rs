//! ResNet-18/34/50/101/152 that trains: BatchNorm in training mode, max-pool with backward, torchvision names.

pub mod autocast;
pub mod layers;
pub mod model;
pub mod step;
pub mod store;
pub mod weights;

pub use autocast::Precision;
pub use model::{Arch, ResNet, ResNetConfig, Stem};
pub use store::{no_grad, Param, ParamKind, ParamStore};

/// Errors of the model crate. Messages name the file, tensor or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown architecture `{0}` (expected resnet18, resnet34, resnet50, resnet101 or resnet152)")]
    UnknownArch(String),
    #[error("unknown stem `{0}` (expected \"imagenet\" or \"cifar\")")]
    UnknownStem(String),
    #[error("{path}: {msg}")]
    Weights { path: String, msg: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;
