//! Autocast policy: which dtype each op computes in (PyTorch autocast's rules for ResNet's ops).
//!
//! | op | compute dtype |
//! |---|---|
//! | conv2d, linear (matmul) | the low-precision dtype (weights cast from FP32 masters each forward) |
//! | BatchNorm statistics and normalisation | FP32, result returned in the activation dtype |
//! | ReLU, max-pool, residual add | activation dtype |
//! | global average pool | FP32 accumulation |
//! | softmax, cross-entropy, loss, gradient reductions | FP32 |
//!
//! On the CPU, candle has no BF16 matmul; a low-precision conv/matmul there is emulated exactly as the tensor
//! cores compute it: operands rounded to the low dtype, products accumulated in FP32, the result rounded.

use candle_core::{DType, Device, Result, Tensor};

/// Execution precision of a training or evaluation step; in configs `fp32`, `bf16` or `fp16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Precision {
    #[serde(rename = "fp32")]
    F32,
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "fp16")]
    F16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Precision {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "fp32" | "f32" => Some(Self::F32),
            "bf16" => Some(Self::Bf16),
            "fp16" | "f16" => Some(Self::F16),
            _ => None,
        }
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::F32 => "fp32",
            Self::Bf16 => "bf16",
            Self::F16 => "fp16",
        }
    }
    /// Every precision, in config order.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    /// Dtype of activations between layers.
    pub fn act_dtype(&self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }
}

/// Whether `device` runs low-precision convolutions and matmuls natively (else emulated in FP32).
pub fn native_low_precision(device: &Device) -> bool {
    device.is_cuda()
}

/// Rounds `t` to `dt` and, where the device lacks native low-precision kernels, back to FP32 for compute.
/// Returns the operand to feed a conv/matmul whose output should then go through [`finish`].
pub fn operand(t: &Tensor, dt: DType) -> Result<Tensor> {
    if dt == DType::F32 {
        return t.to_dtype(DType::F32);
    }
    let low = t.to_dtype(dt)?;
    if native_low_precision(t.device()) {
        Ok(low)
    } else {
        low.to_dtype(DType::F32)
    }
}

/// Casts a conv/matmul result to the activation dtype.
pub fn finish(t: &Tensor, dt: DType) -> Result<Tensor> {
    t.to_dtype(dt)
}
