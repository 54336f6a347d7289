//! CUDA launchers of the fused residual-block ops (`ops/residual.rs`) on `kernels/residual/01_fused.cu`:
//! BatchNorm + residual add + ReLU, and the ReLU gradient joined with the residual gradient.
//!
//! One thread per group of 8 elements (16-byte loads of bf16/f16 and of the per-channel constants) when the channel
//! count is a multiple of 8 and every operand starts on a 16-byte boundary; one element per thread otherwise.
//! Grid-stride, 256 threads a block.

use super::bn::{held, held_view, view, Arg};
use super::{alloc_out, grid_for, ptx, suffix};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result, WithDType};
use half::{bf16, f16};

const MODULE: &str = "residual/01_fused";

/// A training-mode BatchNorm's per-channel f32 tensors: statistics (3, c) = [mean, var, invstd], weight and
/// bias (c).
#[derive(Debug, Clone, Copy)]
pub struct BnTensors<'a> {
    pub stats: &'a candle_core::Tensor,
    pub weight: &'a candle_core::Tensor,
    pub bias: &'a candle_core::Tensor,
}

/// Elements per thread: 8 when every operand starts on a multiple of 8 elements and `group` (the channel count,
/// or 8 for the channel-free gradient kernels) is a multiple of 8 (the element count then is too).
fn vec_width(layouts: &[&Layout], group: usize, len: usize) -> usize {
    let starts_aligned = layouts.iter().all(|l| l.start_offset() % 8 == 0);
    if starts_aligned && group.is_multiple_of(8) && len.is_multiple_of(8) {
        8
    } else {
        1
    }
}

fn len_of(l: &Layout) -> usize {
    l.shape().elem_count()
}

fn bn_add_relu_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    z: Arg,
    r: Arg,
    bn: BnTensors,
    res_bn: Option<BnTensors>,
    c: usize,
) -> Result<CudaStorage> {
    const OP: &str = "bn_add_relu";
    let dev: &CudaDevice = &z.0.device;
    let n = len_of(z.1);
    let zv = view::<T>(z, n, dev, OP, "z")?;
    let rv = view::<T>(r, n, dev, OP, "r")?;
    let (zs, zl) = held(bn.stats);
    let (zw, zwl) = held(bn.weight);
    let (zb, zbl) = held(bn.bias);
    let sz = held_view(&zs, zl, 3 * c, dev, OP, "stats")?;
    let wz = held_view(&zw, zwl, c, dev, OP, "weight")?;
    let bz = held_view(&zb, zbl, c, dev, OP, "bias")?;
    // The residual BatchNorm's tensors, or the main one's as unread placeholders.
    let rp = res_bn.unwrap_or(bn);
    let (rs, rl) = held(rp.stats);
    let (rw, rwl) = held(rp.weight);
    let (rb, rbl) = held(rp.bias);
    let sr: CudaView<f32> = held_view(&rs, rl, 3 * c, dev, OP, "residual stats")?;
    let wr = held_view(&rw, rwl, c, dev, OP, "residual weight")?;
    let br = held_view(&rb, rbl, c, dev, OP, "residual bias")?;
    let y = alloc_out::<T>(dev, n)?;
    // The per-channel tensors are read 4 floats at a time on the 8-wide path.
    let consts_aligned = [zl, zwl, zbl, rl, rwl, rbl].iter().all(|l| l.start_offset() % 4 == 0);
    let v = if consts_aligned { vec_width(&[z.1, r.1], c, n) } else { 1 };
    let kind = if res_bn.is_some() { "bn" } else { "raw" };
    let name = format!("bn_add_relu_{kind}_v{v}_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx::RESIDUAL_01_FUSED)?;
    let (n64, c32) = (n as i64, super::i32_of(c, OP, "c")?);
    let mut b = f.builder();
    b.arg(&zv).arg(&rv).arg(&sz).arg(&wz).arg(&bz).arg(&sr).arg(&wr).arg(&br).arg(&y).arg(&n64).arg(&c32);
    // SAFETY: matches bn_add_relu_* (z, r, sz, wz, bz, sr, wr, br, y, n, c): z, r and y hold n elements, the
    // stats 3*c and weights/biases c; with v = 8, c % 8 == 0 and z, r, y start 16-byte aligned (y is a fresh
    // allocation). The grid-stride loop covers every group of v elements.
    unsafe { b.launch(grid_for(n / v)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// y = relu(bn(z) + r) or relu(bn(z) + bn_r(r)) on CUDA; z, r (rows, c) contiguous of one dtype.
pub fn bn_add_relu(z: Arg, r: Arg, bn: BnTensors, res_bn: Option<BnTensors>, c: usize) -> Result<CudaStorage> {
    const OP: &str = "bn_add_relu";
    if z.0.dtype() != r.0.dtype() {
        candle_core::bail!("{OP} (cuda): z is {:?} but r is {:?}", z.0.dtype(), r.0.dtype());
    }
    cuda_float!(z.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| bn_add_relu_t::<T>(z, r, bn, res_bn, c))
}

fn relu_grad_t<T: CudaDType + DeviceRepr + WithDType + 'static>(a: Arg, b: Option<Arg>, y: Arg) -> Result<CudaStorage> {
    let op = if b.is_some() { "add_relu_grad" } else { "relu_grad" };
    let dev: &CudaDevice = &a.0.device;
    let n = len_of(a.1);
    let av = view::<T>(a, n, dev, op, "a")?;
    let yv = view::<T>(y, n, dev, op, "y")?;
    // Without b the kernel never reads its b argument: pass a.
    let bv = match b {
        Some(b) => view::<T>(b, n, dev, op, "b")?,
        None => view::<T>(a, n, dev, op, "a")?,
    };
    let out = alloc_out::<T>(dev, n)?;
    let layouts: Vec<&Layout> = [Some(a.1), b.map(|b| b.1), Some(y.1)].into_iter().flatten().collect();
    let v = vec_width(&layouts, 8, n);
    let name = format!("relu_grad_{}_v{v}_{}", if b.is_some() { 2 } else { 1 }, suffix(T::DTYPE, op)?);
    let f = dev.get_or_load_custom_func(&name, MODULE, ptx::RESIDUAL_01_FUSED)?;
    let n64 = n as i64;
    let mut bld = f.builder();
    bld.arg(&av).arg(&bv).arg(&yv).arg(&out).arg(&n64);
    // SAFETY: matches relu_grad_* (a, b, y, out, n): every operand holds n elements; with v = 8, n % 8 == 0 and
    // the operands start 16-byte aligned. The grid-stride loop covers every group of v elements.
    unsafe { bld.launch(grid_for(n / v)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// out = (a [+ b]) where y > 0, else 0, on CUDA; operands contiguous of one shape and dtype.
pub fn relu_grad(a: Arg, b: Option<Arg>, y: Arg) -> Result<CudaStorage> {
    const OP: &str = "relu_grad";
    let dt = a.0.dtype();
    if y.0.dtype() != dt || b.is_some_and(|b| b.0.dtype() != dt) {
        candle_core::bail!("{OP} (cuda): operands of mixed dtypes");
    }
    cuda_float!(dt, OP, [F32: f32, BF16: bf16, F16: f16], |T| relu_grad_t::<T>(a, b, y))
}
