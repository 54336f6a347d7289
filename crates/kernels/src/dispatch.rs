//! Per-dtype dispatch of the custom ops, written once: the CPU references match a `CpuStorage` on the float dtypes
//! they support ([`cpu_float!`], [`cpu_float2!`]) and the CUDA launchers pick their generic launcher by `DType`
//! ([`cuda_float!`]). Any other dtype ends in a one-line error naming the op. [`contiguous`] is the CPU ops' view
//! of an operand.

use candle_core::{Layout, Result};

/// The elements of a contiguous operand (`what` of op `op`), or a one-line error naming both.
pub(crate) fn contiguous<'a, T>(data: &'a [T], l: &Layout, op: &str, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{op}: {what} must be contiguous"),
    }
}

/// `cpu_float!(op, storage, [F32, BF16, F16], |v| body)` evaluates `body` with `v` bound to the storage's
/// elements (`&Vec<T>`) for each listed `CpuStorage` variant; `|v, wrap| body` also binds `wrap` to that variant's
/// constructor, to put a `Vec<T>` result back in a storage of the same dtype. Other dtypes: "{op}: unsupported
/// dtype {dtype:?}".
macro_rules! cpu_float {
    ($op:expr, $s:expr, [$($d:ident),+], |$v:ident| $body:expr) => {
        match $s {
            $(candle_core::CpuStorage::$d($v) => $body,)+
            other => candle_core::bail!("{}: unsupported dtype {:?}", $op, other.dtype()),
        }
    };
    ($op:expr, $s:expr, [$($d:ident),+], |$v:ident, $wrap:ident| $body:expr) => {
        match $s {
            $(candle_core::CpuStorage::$d($v) => {
                let $wrap = candle_core::CpuStorage::$d;
                $body
            })+
            other => candle_core::bail!("{}: unsupported dtype {:?}", $op, other.dtype()),
        }
    };
}

/// [`cpu_float!`] over two storages of one dtype: `cpu_float2!(op, (s1, s2), [F32, BF16], |a, b, wrap| body)`.
/// Other or mixed dtypes: "{op}: unsupported dtypes {dtype1:?}/{dtype2:?}".
macro_rules! cpu_float2 {
    ($op:expr, ($s1:expr, $s2:expr), [$($d:ident),+], |$a:ident, $b:ident, $wrap:ident| $body:expr) => {
        match ($s1, $s2) {
            $((candle_core::CpuStorage::$d($a), candle_core::CpuStorage::$d($b)) => {
                #[allow(unused_variables)]
                let $wrap = candle_core::CpuStorage::$d;
                $body
            })+
            (x, y) => candle_core::bail!("{}: unsupported dtypes {:?}/{:?}", $op, x.dtype(), y.dtype()),
        }
    };
}

/// `cuda_float!(dtype, op, [F32: f32, BF16: bf16, F16: f16], |T| body)` evaluates `body` with the type `T` set to
/// the element type of `dtype` (a `DType`), for each listed pair; other dtypes: "{op} (cuda): unsupported dtype
/// {dtype:?} (f32, bf16, f16 only)", naming the listed types.
#[cfg(feature = "cuda")]
macro_rules! cuda_float {
    ($dt:expr, $op:expr, [$($d:ident: $ty:ty),+], |$t:ident| $body:expr) => {
        match $dt {
            $(candle_core::DType::$d => {
                type $t = $ty;
                $body
            })+
            other => candle_core::bail!(
                "{} (cuda): unsupported dtype {other:?} ({} only)",
                $op,
                [$(stringify!($ty)),+].join(", ")
            ),
        }
    };
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Layout, Shape, Tensor};

    fn err(r: candle_core::Result<Tensor>) -> String {
        match r {
            Ok(t) => panic!("expected an error, got a {:?} tensor", t.dims()),
            Err(e) => e.to_string(),
        }
    }

    /// The dispatch macros name the op and the dtypes they refuse, through three ops that use them.
    #[test]
    fn unsupported_dtypes_name_the_op() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 4, 4, 8), DType::U32, &dev)?;
        let e = err(crate::max_pool2d_nhwc(&x, 3, 2, 1));
        assert!(e.contains("max_pool2d_nhwc: unsupported dtype U32"), "{e}");

        let z = Tensor::zeros((2, 8), DType::F32, &dev)?;
        let r = Tensor::zeros((2, 8), DType::BF16, &dev)?;
        let p = crate::BnParams {
            stats: Tensor::zeros((3, 8), DType::F32, &dev)?,
            weight: Tensor::ones(8, DType::F32, &dev)?,
            bias: Tensor::zeros(8, DType::F32, &dev)?,
        };
        let e = err(crate::bn_add_relu(&z, &r, &p, None));
        assert!(e.contains("bn_add_relu: unsupported dtypes F32/BF16"), "{e}");

        // f64 is a dtype the max-pool takes and the BatchNorm statistics do not.
        let x = Tensor::zeros((4, 8), DType::F64, &dev)?;
        let e = err(x.apply_op1_no_bwd(&crate::ops::batchnorm::BnStats { eps: 1e-5 }));
        assert!(e.contains("unsupported dtype F64"), "{e}");
        let x = Tensor::zeros((1, 4, 4, 8), DType::F64, &dev)?;
        assert_eq!(crate::max_pool2d_nhwc(&x, 3, 2, 1)?.dims(), [1, 2, 2, 8]);
        Ok(())
    }

    #[test]
    fn contiguous_names_the_operand() {
        let data: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let l = Layout::contiguous(Shape::from((2, 3)));
        assert_eq!(super::contiguous(&data, &l, "op", "x").unwrap(), &data[..]);
        let t = l.transpose(0, 1).unwrap();
        let e = super::contiguous(&data, &t, "some_op", "grad").unwrap_err().to_string();
        assert!(e.contains("some_op: grad must be contiguous"), "{e}");
    }
}
