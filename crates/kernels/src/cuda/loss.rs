//! Fused softmax cross-entropy (`kernels/loss/01_softmax_xent.cu`): one block per row writes the row's loss and
//! its gradient row.

use super::{alloc_out, ptx, suffix};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, WithDType};
use half::{bf16, f16};

const MODULE: &str = "loss/01_softmax_xent";

fn launch<T: CudaDType + DeviceRepr + WithDType + 'static>(
    s: &CudaStorage,
    l: &Layout,
    labels: &CudaStorage,
    lab: &Layout,
    (n, k): (usize, usize),
    eps: f32,
    scale: f32,
) -> Result<CudaStorage> {
    const OP: &str = "softmax_xent (cuda)";
    let range = |l: &Layout, what: &str| {
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{OP}: {what} must be contiguous")))
    };
    let (ni, ki) = match (i32::try_from(n), i32::try_from(k)) {
        (Ok(a), Ok(b)) => (a, b),
        _ => candle_core::bail!("{OP}: ({n}, {k}) exceeds i32"),
    };
    let dev = &s.device;
    let (a, b) = range(l, "logits")?;
    let x = s.as_cuda_slice::<T>()?.slice(a..b);
    let (c, d) = range(lab, "labels")?;
    let y = labels.as_cuda_slice::<u32>()?.slice(c..d);
    let out = alloc_out::<f32>(dev, n * k + n)?;
    let f = dev.get_or_load_custom_func(
        &format!("softmax_xent_{}", suffix(T::DTYPE, OP)?),
        MODULE,
        ptx::LOSS_01_SOFTMAX_XENT,
    )?;
    let mut bld = f.builder();
    bld.arg(&x).arg(&y).arg(&out).arg(&ni).arg(&ki).arg(&eps).arg(&scale);
    // SAFETY: (logits, labels, out, n, k, eps, scale) as softmax_xent_* takes them; logits hold n*k elements,
    // labels n, out n*k + n; one block of 256 threads per row writes its k gradient values and its loss.
    unsafe { bld.launch(LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }
        .w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// The fused softmax cross-entropy of [`crate::ops::xent`] on CUDA: f32 (n k + n) = [gradient rows, row losses].
pub fn softmax_xent(
    s: &CudaStorage,
    l: &Layout,
    labels: &CudaStorage,
    lab: &Layout,
    nk: (usize, usize),
    eps: f32,
    scale: f32,
) -> Result<CudaStorage> {
    if labels.dtype() != DType::U32 {
        candle_core::bail!("softmax_xent (cuda): labels must be u32, got {:?}", labels.dtype());
    }
    cuda_float!(s.dtype(), "softmax_xent", [F32: f32, BF16: bf16, F16: f16], |T| {
        launch::<T>(s, l, labels, lab, nk, eps, scale)
    })
}
