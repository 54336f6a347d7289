//! The ops, one module per op: the CPU reference, the candle custom op, and the dispatch to the CUDA launchers
//! of [`crate::cuda`] (feature `cuda`). Which implementation runs is a value ([`crate::KernelPolicy`]) passed
//! with the call, never process state.

pub mod avgpool;
pub mod batchnorm;
pub mod conv;
pub mod conv_nhwc;
pub mod im2col;
pub mod input;
pub mod linear;
pub mod maxpool;
pub mod residual;
pub mod weights;
pub mod xent;

use candle_core::WithDType;

/// `t` contiguous and starting on a 16-byte boundary (what the vectorised kernels' loads need).
#[cfg(feature = "cuda")]
pub(crate) fn aligned(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    let t = t.contiguous()?;
    if t.layout().start_offset() % 8 == 0 {
        Ok(t)
    } else {
        // A new storage from offset 0 (`copy` keeps the view's offset, and clones its whole storage).
        t.force_contiguous()
    }
}
use half::{bf16, f16};

/// Rounds an FP32 value to `T` to nearest even, as the CUDA kernels' `__float2bfloat16_rn`/`__float2half_rn` do.
/// (`T::from_f64` is not enough: half's f64 -> bf16 conversion drops the low 32 mantissa bits before rounding, so
/// an FP32 value just above a tie, e.g. 0x3f808001, rounds down to even.)
pub(crate) fn round_f32<T: WithDType>(v: f32) -> T {
    match T::DTYPE {
        candle_core::DType::BF16 => T::from_f64(bf16::from_f32(v).to_f64()),
        candle_core::DType::F16 => T::from_f64(f16::from_f32(v).to_f64()),
        _ => T::from_f64(v as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::round_f32;
    use half::{bf16, f16};

    /// FP32 values just above a bf16/f16 rounding tie by their lowest mantissa bits: `round_f32` rounds them up,
    /// as `__float2bfloat16_rn`/`__float2half_rn` do (half 2.7's `bf16::from_f64` returned 0x3f80 for the first).
    #[test]
    fn round_f32_is_round_to_nearest_even() {
        let v = f32::from_bits(0x3f80_8001); // 1 + 2^-8 + 2^-23: above the tie between two bf16 values
        assert_eq!(round_f32::<bf16>(v), bf16::from_f32(v));
        assert_eq!(round_f32::<bf16>(v).to_bits(), 0x3f81);
        let v = f32::from_bits(0x3f80_1001); // 1 + 2^-11 + 2^-23: above the tie between two f16 values
        assert_eq!(round_f32::<f16>(v), f16::from_f32(v));
        assert_eq!(round_f32::<f16>(v).to_bits(), 0x3c01);
        assert_eq!(round_f32::<f32>(v), v);
    }
}
