//! CUDA launchers of the pooling ops: max-pool NCHW (`kernels/maxpool/01_direct.cu`) and channels-last
//! (`kernels/maxpool/02_nhwc.cu`, backward in two passes: `03_nhwc_argmax.cu`; both with 8 channels per thread in
//! `04_nhwc_vec.cu` where C % 8 == 0), global average pool (`kernels/pool/01_avgpool.cu`). PTX modules loaded
//! through candle's device; grid-stride launches of 256 threads.

use super::{alloc_out, grid_for, ptx, suffix};
use crate::geom::MaxPool2d;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};
use half::{bf16, f16};

/// Module name under which candle caches the max-pool PTX (path under kernels/ without `.cu`).
const MAXPOOL_MODULE: &str = "maxpool/01_direct";

fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("max_pool2d (cuda): {what} = {v} exceeds i32")))
}

/// Kernel arguments shared by forward and backward: `nc, h, w, oh, ow, k, s, p`.
fn geom_args(p: &MaxPool2d, dims: (usize, usize, usize, usize)) -> Result<[i32; 8]> {
    let (n, c, h, w) = dims;
    let (oh, ow) = (p.out_size(h), p.out_size(w));
    // The kernels index a plane with i32.
    to_i32(h * w, "h * w")?;
    Ok([
        to_i32(n * c, "n * c")?,
        to_i32(h, "h")?,
        to_i32(w, "w")?,
        to_i32(oh, "oh")?,
        to_i32(ow, "ow")?,
        to_i32(p.kernel, "kernel")?,
        to_i32(p.stride, "stride")?,
        to_i32(p.padding, "padding")?,
    ])
}

fn input_range(l: &Layout, op: &str, what: &str) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op} (cuda): {what} must be contiguous, got {l:?}")))
}

fn fwd_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    p: &MaxPool2d,
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = &s.device;
    let (a, b) = input_range(l, "max_pool2d", "input")?;
    let x = s.as_cuda_slice::<T>()?.slice(a..b);
    let args = geom_args(p, dims)?;
    let out_len = dims.0 * dims.1 * p.out_size(dims.2) * p.out_size(dims.3);
    let y = alloc_out::<T>(dev, out_len)?;
    let name = format!("maxpool2d_fwd_{}", suffix(T::DTYPE, "max_pool2d")?);
    let func = dev.get_or_load_custom_func(&name, MAXPOOL_MODULE, ptx::MAXPOOL_01_DIRECT)?;
    let mut builder = func.builder();
    builder.arg(&x);
    builder.arg(&y);
    for v in &args {
        builder.arg(v);
    }
    // SAFETY: argument types and count match maxpool2d_fwd_* (x, y, nc, h, w, oh, ow, k, s, p); x holds
    // nc*h*w elements and y nc*oh*ow.
    unsafe { builder.launch(grid_for(out_len)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

fn bwd_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    p: &MaxPool2d,
    xs: &CudaStorage,
    xl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = &xs.device;
    let (a, b) = input_range(xl, "max_pool2d", "x")?;
    let x = xs.as_cuda_slice::<T>()?.slice(a..b);
    let (a, b) = input_range(gl, "max_pool2d", "grad")?;
    let g = gs.as_cuda_slice::<T>()?.slice(a..b);
    let args = geom_args(p, dims)?;
    let in_len = dims.0 * dims.1 * dims.2 * dims.3;
    let dx = alloc_out::<T>(dev, in_len)?;
    let name = format!("maxpool2d_bwd_{}", suffix(T::DTYPE, "max_pool2d_backward")?);
    let func = dev.get_or_load_custom_func(&name, MAXPOOL_MODULE, ptx::MAXPOOL_01_DIRECT)?;
    let mut builder = func.builder();
    builder.arg(&x);
    builder.arg(&g);
    builder.arg(&dx);
    for v in &args {
        builder.arg(v);
    }
    // SAFETY: argument types and count match maxpool2d_bwd_* (x, dy, dx, nc, h, w, oh, ow, k, s, p); x and dx
    // hold nc*h*w elements, dy nc*oh*ow (checked by the caller against the layouts).
    unsafe { builder.launch(grid_for(in_len)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

/// Max-pool forward on CUDA. `s`: (n, c, h, w) contiguous -> (n, c, oh, ow).
pub fn maxpool_fwd(
    p: &MaxPool2d,
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let out = cuda_float!(s.dtype(), "max_pool2d", [F32: f32, BF16: bf16, F16: f16], |T| fwd_t::<T>(p, s, l, dims))?;
    Ok((out, Shape::from((dims.0, dims.1, p.out_size(dims.2), p.out_size(dims.3)))))
}

/// Max-pool backward on CUDA. `x`: (n, c, h, w), `grad`: (n, c, oh, ow), both contiguous -> (n, c, h, w).
pub fn maxpool_bwd(
    p: &MaxPool2d,
    x: &CudaStorage,
    xl: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let expect = [dims.0, dims.1, p.out_size(dims.2), p.out_size(dims.3)];
    if gl.dims() != expect {
        candle_core::bail!("max_pool2d_backward (cuda): grad shape {:?}, expected {expect:?}", gl.dims());
    }
    if x.dtype() != grad.dtype() {
        candle_core::bail!("max_pool2d_backward (cuda): x is {:?} but grad is {:?}", x.dtype(), grad.dtype());
    }
    let out = cuda_float!(x.dtype(), "max_pool2d_backward", [F32: f32, BF16: bf16, F16: f16], |T| {
        bwd_t::<T>(p, x, xl, grad, gl, dims)
    })?;
    Ok((out, xl.shape().clone()))
}

// ---------------------------------------------------------------------------------------------------------------
// Channels-last max-pool (kernels/maxpool/02_nhwc.cu) and global average pool (kernels/pool/01_avgpool.cu).
// ---------------------------------------------------------------------------------------------------------------

/// Module name under which candle caches the NHWC max-pool PTX.
const MAXPOOL_NHWC_MODULE: &str = "maxpool/02_nhwc";
/// Module name under which candle caches the two-pass NHWC max-pool backward PTX.
const MAXPOOL_NHWC_ARGMAX_MODULE: &str = "maxpool/03_nhwc_argmax";
/// 8 channels per thread (kernels/maxpool/04_nhwc_vec.cu), where [`nhwc_v8`] allows.
const MAXPOOL_NHWC_VEC_MODULE: &str = "maxpool/04_nhwc_vec";

/// Whether 04 (8 channels per thread) runs: c % 8 == 0, every operand starting on a 16-byte boundary (`offsets` in
/// elements), a window of at most 255 cells and at most 65,535 images (one per blockIdx.y).
fn nhwc_v8(p: &MaxPool2d, dims: (usize, usize, usize, usize), offsets: &[usize]) -> bool {
    dims.3.is_multiple_of(8) && offsets.iter().all(|o| o % 8 == 0) && p.kernel * p.kernel <= 255 && dims.0 <= 65535
}

/// 04's launch: 256 threads, grid (blocks over one image's `groups` 8-channel groups, n).
fn nhwc_v8_cfg(groups: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (groups.div_ceil(256).clamp(1, 1024) as u32, n as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
/// Module name under which candle caches the global-average-pool PTX.
const AVGPOOL_MODULE: &str = "pool/01_avgpool";

fn i32_arg(v: usize, op: &str, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{op} (cuda): {what} = {v} exceeds i32")))
}

/// Kernel arguments of the NHWC max-pool, forward and backward: `n, h, w, c, oh, ow, k, s, p`.
fn nhwc_geom_args(p: &MaxPool2d, dims: (usize, usize, usize, usize)) -> Result<[i32; 9]> {
    const OP: &str = "max_pool2d_nhwc";
    let (n, h, w, c) = dims;
    let (oh, ow) = (p.out_size(h), p.out_size(w));
    // The kernels index within one image with i32.
    i32_arg(h * w * c, OP, "h * w * c")?;
    i32_arg(oh * ow * c, OP, "oh * ow * c")?;
    Ok([
        i32_arg(n, OP, "n")?,
        i32_arg(h, OP, "h")?,
        i32_arg(w, OP, "w")?,
        i32_arg(c, OP, "c")?,
        i32_arg(oh, OP, "oh")?,
        i32_arg(ow, OP, "ow")?,
        i32_arg(p.kernel, OP, "kernel")?,
        i32_arg(p.stride, OP, "stride")?,
        i32_arg(p.padding, OP, "padding")?,
    ])
}

fn maxpool_nhwc_fwd_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    p: &MaxPool2d,
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = &s.device;
    let (a, b) = input_range(l, "max_pool2d_nhwc", "input")?;
    let x = s.as_cuda_slice::<T>()?.slice(a..b);
    let args = nhwc_geom_args(p, dims)?;
    let out_len = dims.0 * p.out_size(dims.1) * p.out_size(dims.2) * dims.3;
    let y = alloc_out::<T>(dev, out_len)?;
    let v8 = nhwc_v8(p, dims, &[a]);
    let (module, image, v, cfg) = if v8 {
        (MAXPOOL_NHWC_VEC_MODULE, ptx::MAXPOOL_04_NHWC_VEC, "_v8", nhwc_v8_cfg(out_len / dims.0 / 8, dims.0))
    } else {
        (MAXPOOL_NHWC_MODULE, ptx::MAXPOOL_02_NHWC, "", grid_for(out_len))
    };
    let name = format!("maxpool2d_nhwc_fwd{v}_{}", suffix(T::DTYPE, "max_pool2d_nhwc")?);
    let func = dev.get_or_load_custom_func(&name, module, image)?;
    let mut builder = func.builder();
    builder.arg(&x).arg(&y);
    for v in &args {
        builder.arg(v);
    }
    // SAFETY: argument types and count match maxpool2d_nhwc_fwd[_v8]_* (x, y, n, h, w, c, oh, ow, k, s, p); x holds
    // n*h*w*c elements and y n*oh*ow*c (v8: both 16-byte aligned with c % 8 == 0 (nhwc_v8), gridDim.y = n).
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

fn maxpool_nhwc_bwd_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    p: &MaxPool2d,
    xs: &CudaStorage,
    xl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    const OP: &str = "max_pool2d_nhwc_backward";
    let dev = &xs.device;
    let (a, b) = input_range(xl, OP, "x")?;
    let x = xs.as_cuda_slice::<T>()?.slice(a..b);
    let x_offset = a;
    let (a, b) = input_range(gl, OP, "grad")?;
    let g = gs.as_cuda_slice::<T>()?.slice(a..b);
    let v8 = nhwc_v8(p, dims, &[x_offset, a]);
    let args = nhwc_geom_args(p, dims)?;
    let in_len = dims.0 * dims.1 * dims.2 * dims.3;
    let dx = alloc_out::<T>(dev, in_len)?;
    let sfx = suffix(T::DTYPE, OP)?;
    if p.kernel * p.kernel > 255 {
        // Window offsets do not fit a byte: 02's single pass, which recomputes every window's argmax.
        let func = dev.get_or_load_custom_func(
            &format!("maxpool2d_nhwc_bwd_{sfx}"),
            MAXPOOL_NHWC_MODULE,
            ptx::MAXPOOL_02_NHWC,
        )?;
        let mut builder = func.builder();
        builder.arg(&x).arg(&g).arg(&dx);
        for v in &args {
            builder.arg(v);
        }
        // SAFETY: argument types and count match maxpool2d_nhwc_bwd_* (x, dy, dx, n, h, w, c, oh, ow, k, s, p); x
        // and dx hold n*h*w*c elements, dy n*oh*ow*c (checked by the caller against the layouts).
        unsafe { builder.launch(grid_for(in_len)) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()));
    }
    // Pass 1: each window's argmax as its offset in the window; pass 2: the gather of 02, reading the offsets.
    let arg = offsets_t::<T>(dev, p, &x, v8, dims)?;
    bwd_offsets_t::<T>(dev, p, &arg.as_view(), (&g, None), &dx, v8, dims)?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

/// NHWC max-pool forward on CUDA. `s`: (n, h, w, c) contiguous -> (n, oh, ow, c).
pub fn maxpool_nhwc_fwd(
    p: &MaxPool2d,
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let out = cuda_float!(s.dtype(), "max_pool2d_nhwc", [F32: f32, BF16: bf16, F16: f16], |T| {
        maxpool_nhwc_fwd_t::<T>(p, s, l, dims)
    })?;
    Ok((out, Shape::from(p.out_shape_nhwc(dims))))
}

/// NHWC max-pool backward on CUDA. `x`: (n, h, w, c), `grad`: (n, oh, ow, c), both contiguous -> (n, h, w, c).
pub fn maxpool_nhwc_bwd(
    p: &MaxPool2d,
    x: &CudaStorage,
    xl: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let (n, oh, ow, c) = p.out_shape_nhwc(dims);
    if gl.dims() != [n, oh, ow, c] {
        candle_core::bail!(
            "max_pool2d_nhwc_backward (cuda): grad shape {:?}, expected {:?}",
            gl.dims(),
            [n, oh, ow, c]
        );
    }
    if x.dtype() != grad.dtype() {
        candle_core::bail!("max_pool2d_nhwc_backward (cuda): x is {:?} but grad is {:?}", x.dtype(), grad.dtype());
    }
    let out = cuda_float!(x.dtype(), "max_pool2d_nhwc_backward", [F32: f32, BF16: bf16, F16: f16], |T| {
        maxpool_nhwc_bwd_t::<T>(p, x, xl, grad, gl, dims)
    })?;
    Ok((out, xl.shape().clone()))
}

/// Launches `avgpool_nhwc_{fwd,bwd}_*` (`dir`) on `s` (x for the forward, dy for the backward) with an output
/// of `out_len` elements.
fn avgpool_launch<T: CudaDType + DeviceRepr + WithDType + 'static>(
    dir: &str,
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
    out_len: usize,
) -> Result<CudaStorage> {
    let op = if dir == "fwd" { "global_avg_pool_nhwc" } else { "global_avg_pool_nhwc_backward" };
    let (n, h, w, c) = dims;
    let args = [i32_arg(n, op, "n")?, i32_arg(h * w, op, "h * w")?, i32_arg(c, op, "c")?];
    let dev = &s.device;
    let (a, b) = input_range(l, op, "input")?;
    let src = s.as_cuda_slice::<T>()?.slice(a..b);
    let dst = alloc_out::<T>(dev, out_len)?;
    // The backward of a 16-bit dtype with c % 8 == 0 and dy on a 16-byte boundary (dx is fresh): 8 channels a
    // thread, images over grid y.
    let v8 = dir == "bwd" && std::mem::size_of::<T>() == 2 && c.is_multiple_of(8) && a.is_multiple_of(8) && n <= 65535;
    let name = format!("avgpool_nhwc_{dir}{}_{}", if v8 { "_v8" } else { "" }, suffix(T::DTYPE, op)?);
    let func = dev.get_or_load_custom_func(&name, AVGPOOL_MODULE, ptx::POOL_01_AVGPOOL)?;
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&dst);
    for v in &args {
        builder.arg(v);
    }
    // SAFETY: argument types and count match avgpool_nhwc_{fwd,bwd}_* (src, dst, n, hw, c). Forward: src holds
    // n*h*w*c elements, dst n*c; backward: src n*c, dst n*h*w*c (the callers pass out_len accordingly). The launch
    // covers every output element (one thread each, or each 8-channel group, grid-stride).
    // avgpool_nhwc_bwd_v8: one thread per (pixel, 8 channels) of image blockIdx.y.
    unsafe { builder.launch(if v8 { nhwc_v8_cfg(h * w * c / 8, n) } else { grid_for(out_len) }) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
}

/// Global average pool forward on CUDA. `s`: (n, h, w, c) contiguous -> (n, c).
pub fn avgpool_nhwc_fwd(
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let (n, _, _, c) = dims;
    let out = cuda_float!(s.dtype(), "global_avg_pool_nhwc", [F32: f32, BF16: bf16, F16: f16], |T| {
        avgpool_launch::<T>("fwd", s, l, dims, n * c)
    })?;
    Ok((out, Shape::from((n, c))))
}

/// Global average pool backward on CUDA. `s`: dy (n, c) contiguous -> dx (n, h, w, c) with `dims` = (n, h, w, c).
pub fn avgpool_nhwc_bwd(
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let (n, h, w, c) = dims;
    if l.dims() != [n, c] {
        candle_core::bail!("global_avg_pool_nhwc_backward (cuda): grad shape {:?}, expected {:?}", l.dims(), [n, c]);
    }
    let len = n * h * w * c;
    let out = cuda_float!(s.dtype(), "global_avg_pool_nhwc_backward", [F32: f32, BF16: bf16, F16: f16], |T| {
        avgpool_launch::<T>("bwd", s, l, dims, len)
    })?;
    Ok((out, Shape::from(dims)))
}

/// The module of 03/04's two passes (module name, image, kernel-name infix): 04 with `v8`, else 03.
fn argmax_module(v8: bool) -> (&'static str, &'static str, &'static str) {
    if v8 {
        (MAXPOOL_NHWC_VEC_MODULE, ptx::MAXPOOL_04_NHWC_VEC, "_v8")
    } else {
        (MAXPOOL_NHWC_ARGMAX_MODULE, ptx::MAXPOOL_03_NHWC_ARGMAX, "")
    }
}

/// 03/04's pass 1 (kernels/maxpool/03_nhwc_argmax.cu, 04_nhwc_vec.cu): every window's argmax as its offset in the
/// window, one byte per output element. `v8`: x on a 16-byte boundary and c % 8 == 0 ([`nhwc_v8`]).
fn offsets_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    dev: &CudaDevice,
    p: &MaxPool2d,
    x: &CudaView<T>,
    v8: bool,
    dims: (usize, usize, usize, usize),
) -> Result<CudaSlice<u8>> {
    let (n, oh, ow, c) = p.out_shape_nhwc(dims);
    let out_len = n * oh * ow * c;
    let args = nhwc_geom_args(p, dims)?;
    // SAFETY: every element is written by maxpool2d_nhwc_argmax_* (one thread per output element or 8-group).
    let arg = unsafe { dev.alloc::<u8>(out_len)? };
    let (module, image, v) = argmax_module(v8);
    let sfx = suffix(T::DTYPE, "max_pool2d_nhwc_offsets")?;
    let func = dev.get_or_load_custom_func(&format!("maxpool2d_nhwc_argmax{v}_{sfx}"), module, image)?;
    let mut builder = func.builder();
    builder.arg(x).arg(&arg);
    for v in &args {
        builder.arg(v);
    }
    // SAFETY: argument types and count match maxpool2d_nhwc_argmax[_v8]_* (x, arg, n, h, w, c, oh, ow, k, s, p); x
    // holds n*h*w*c elements, arg n*oh*ow*c bytes (v8: 16-byte aligned x, c % 8 == 0, a fresh arg buffer).
    unsafe { builder.launch(if v8 { nhwc_v8_cfg(oh * ow * c / 8, n) } else { grid_for(out_len) }) }.w()?;
    Ok(arg)
}

/// 03/04's pass 2: dx (n, h, w, c) from the window offsets `arg` and dy (both (n, oh, ow, c)); with `g2`, of the
/// gradient dy + g2 read in the same pass (`maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8`: the stem's pool only, `v8`).
/// `v8`: every operand on a 16-byte boundary and c % 8 == 0.
fn bwd_offsets_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    dev: &CudaDevice,
    p: &MaxPool2d,
    arg: &CudaView<u8>,
    (g, g2): (&CudaView<T>, Option<&CudaView<T>>),
    dx: &CudaSlice<T>,
    v8: bool,
    dims: (usize, usize, usize, usize),
) -> Result<()> {
    let (n, h, w, c) = dims;
    let args = nhwc_geom_args(p, dims)?;
    let (module, image, v) = argmax_module(v8);
    let op = if g2.is_some() { "max_pool2d_nhwc_backward_offsets_sum" } else { "max_pool2d_nhwc_backward" };
    let sfx = suffix(T::DTYPE, op)?;
    // The stem's pool (kernel 3, stride 2, padding 1): one thread per 2 x 2 block of input cells (the same sums).
    let stem = v8 && crate::ops::maxpool::MaxPool2dNhwcBackwardOffsetsSum::applies(p, c);
    if g2.is_some() && !stem {
        candle_core::bail!(
            "{op} (cuda): needs the 3x3 stride-2 padding-1 pool, c % 8 == 0 and aligned operands, got {p:?}, {dims:?}"
        );
    }
    let (v, cells) = if stem { ("_k3s2p1_v8", h.div_ceil(2) * w.div_ceil(2)) } else { (v, h * w) };
    let two = if g2.is_some() { "2" } else { "" };
    let func = dev.get_or_load_custom_func(&format!("maxpool2d_nhwc_bwd{two}_argmax{v}_{sfx}"), module, image)?;
    let mut builder = func.builder();
    builder.arg(arg).arg(g);
    if let Some(g2) = g2 {
        builder.arg(g2);
    }
    builder.arg(dx);
    for v in &args {
        builder.arg(v);
    }
    // SAFETY: argument types and count match maxpool2d_nhwc_bwd_argmax[_v8|_k3s2p1_v8]_* (arg, dy, dx, n, h, w, c,
    // oh, ow, k, s, p) or, with g2, maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8_* (arg, dy, dy2, dx, ...); arg, dy (and
    // dy2) hold n*oh*ow*c elements, dx n*h*w*c (v8: all 16-byte aligned, offsets 8-byte, c % 8 == 0); the grid
    // covers one image's cells (or 2 x 2 blocks of cells) in 8-channel groups a thread, y over images.
    unsafe { builder.launch(if v8 { nhwc_v8_cfg(cells * c / 8, n) } else { grid_for(n * h * w * c) }) }.w()?;
    Ok(())
}

/// [`crate::ops::maxpool::MaxPool2dNhwcOffsets`] on CUDA: x (n, h, w, c) contiguous -> offsets (n, oh, ow, c) u8.
pub fn maxpool_nhwc_offsets(
    p: &MaxPool2d,
    s: &CudaStorage,
    l: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "max_pool2d_nhwc_offsets";
    let (a, b) = input_range(l, OP, "input")?;
    let v8 = nhwc_v8(p, dims, &[a]);
    let dev = &s.device;
    let arg = cuda_float!(s.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| {
        offsets_t::<T>(dev, p, &s.as_cuda_slice::<T>()?.slice(a..b), v8, dims)
    })?;
    Ok((CudaStorage::wrap_cuda_slice(arg, s.device.clone()), Shape::from(p.out_shape_nhwc(dims))))
}

fn bwd_offsets_run<T: CudaDType + DeviceRepr + WithDType + 'static>(
    dev: &CudaDevice,
    p: &MaxPool2d,
    arg: &CudaView<u8>,
    grads: (&CudaView<T>, Option<&CudaView<T>>),
    v8: bool,
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let dx = alloc_out::<T>(dev, dims.0 * dims.1 * dims.2 * dims.3)?;
    bwd_offsets_t::<T>(dev, p, arg, grads, &dx, v8, dims)?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

/// [`crate::ops::maxpool::MaxPool2dNhwcBackwardOffsets`] on CUDA: (offsets u8, dy), both (n, oh, ow, c) and
/// contiguous (shapes checked by the caller) -> dx (n, h, w, c).
pub fn maxpool_nhwc_bwd_offsets(
    p: &MaxPool2d,
    os: &CudaStorage,
    ol: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    const OP: &str = "max_pool2d_nhwc_backward_offsets";
    let (oa, ob) = input_range(ol, OP, "offsets")?;
    let arg = os.as_cuda_slice::<u8>()?.slice(oa..ob);
    let (a, b) = input_range(gl, OP, "grad")?;
    let dev = &gs.device;
    // 04 reads the offsets 8 at a time: their start on an 8-byte boundary too.
    let v8 = nhwc_v8(p, dims, &[a]) && oa % 8 == 0;
    cuda_float!(gs.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| {
        bwd_offsets_run(dev, p, &arg, (&gs.as_cuda_slice::<T>()?.slice(a..b), None), v8, dims)
    })
}

/// [`crate::ops::maxpool::MaxPool2dNhwcBackwardOffsetsSum`] on CUDA: (offsets u8, dy, dy2), all (n, oh, ow, c),
/// contiguous and on 16-byte (offsets 8-byte) boundaries, for the stem's pool (kernel 3, stride 2, padding 1) ->
/// dx (n, h, w, c) of the gradient dy + dy2 (`maxpool2d_nhwc_bwd2_argmax_k3s2p1_v8`). Other pools or layouts are
/// an error: the op's wrapper adds the gradients first for them.
pub fn maxpool_nhwc_bwd_offsets_sum(
    p: &MaxPool2d,
    os: &CudaStorage,
    ol: &Layout,
    (gs, gl): (&CudaStorage, &Layout),
    (gs2, gl2): (&CudaStorage, &Layout),
    dims: (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    const OP: &str = "max_pool2d_nhwc_backward_offsets_sum";
    let (oa, ob) = input_range(ol, OP, "offsets")?;
    let arg = os.as_cuda_slice::<u8>()?.slice(oa..ob);
    let (a, b) = input_range(gl, OP, "grad")?;
    let (a2, b2) = input_range(gl2, OP, "second grad")?;
    if gs.dtype() != gs2.dtype() {
        candle_core::bail!("{OP} (cuda): gradients of dtypes {:?} and {:?}", gs.dtype(), gs2.dtype());
    }
    let dev = &gs.device;
    // bwd_offsets_t checks the pool and the channel count (the stem's kernel only).
    let v8 = nhwc_v8(p, dims, &[a, a2]) && oa % 8 == 0;
    cuda_float!(gs.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| {
        let (g, g2) = (gs.as_cuda_slice::<T>()?.slice(a..b), gs2.as_cuda_slice::<T>()?.slice(a2..b2));
        bwd_offsets_run(dev, p, &arg, (&g, Some(&g2)), v8, dims)
    })
}
