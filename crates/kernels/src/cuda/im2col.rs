//! Explicit im2col for very few input channels (the RGB stem): `kernels/conv/06_im2col.cu` writes the rows of
//! im2col(x), a chunk of whole images at a time, and the TMA GEMM multiplies them.

use super::common::reduce_cfg;
use super::loader::{function, has_wgmma, sm_count};
use super::tma::{tma_gemm, Epi};
use super::{i32_of, suffix};
use crate::geom::{ConvGeom, ConvPass, GemmLayout};
use crate::ops::im2col::{Im2colKernel, Im2colNhwc};
use crate::variants::{Tile, X64};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{Layout, Result, Shape, WithDType};
use std::sync::OnceLock;

/// Mirror of `Im2colArgs` (kernels/conv/06_im2col.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Im2colArgs {
    m0: i64,
    rows: i32,
    h: i32,
    w: i32,
    c: i32,
    p: i32,
    q: i32,
    r: i32,
    stride: i32,
    pad: i32,
    kp: i32,
}
// SAFETY: plain repr(C) integers, laid out as the CUDA struct.
unsafe impl DeviceRepr for Im2colArgs {}

/// Input channel counts below this run through [`im2col_conv`] on a wgmma device (instead of zero-padding C to 8).
const IM2COL_BELOW_C: usize = 8;
/// Whether a convolution with `c` input channels and `ko` outputs runs through [`im2col_conv`] on `dev`.
pub fn im2col_applies(dev: &CudaDevice, c: usize, ko: usize) -> bool {
    c > 0 && c < IM2COL_BELOW_C && ko.is_multiple_of(8) && has_wgmma(dev)
}

/// Forward or grad-weight of a convolution with few input channels: the rows (pixels) of im2col(x) are written,
/// a chunk of whole images at a time, to a [rows][K'] buffer (K' = R*S*C rounded up to 8, zero-filled) that a
/// TMA GEMM multiplies (`budget` bytes of im2col rows at a time, at least one image). Fwd: a = x, b = w [Ko][R*S*C] -> y [N*P*Q][Ko]. Wgrad: a = dy, b = x -> dw [Ko][R*S*C]
/// (one partial product per chunk, summed in FP32 by sum_rows; one chunk, so no partial rounding, up to the
/// budget: batch 256 of 224 x 224 images for the ResNet stem).
#[allow(clippy::too_many_arguments)]
pub fn im2col_conv<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    budget: usize,
    pass: ConvPass,
    g: &ConvGeom,
    a: &CudaView<T>,
    b: &CudaView<T>,
    out: &CudaSlice<T>,
    op: &str,
) -> Result<()> {
    let sfx = suffix(T::DTYPE, op)?;
    let stream = dev.cuda_stream();
    let (p, q) = (g.p(), g.q());
    let (k, kp) = (g.r * g.r * g.c, (g.r * g.r * g.c).next_multiple_of(8));
    let imgs = (budget / (p * q * kp * 2)).clamp(1, g.n);
    let chunks = g.n.div_ceil(imgs);
    let cols = unsafe { dev.alloc::<T>(imgs * p * q * kp)? }; // SAFETY: each chunk's rows are written by im2col first
    let f = |name: &str| function(dev, "conv/06_im2col", &format!("{name}_{sfx}"), 0);
    let (pad_rows, sum_rows) = (f("pad_rows")?, f("sum_rows")?);
    let tile = if tile.is_tma() { tile } else { X64 };
    let sms = sm_count(dev)?;
    // Forward: the weights zero-padded to K' columns; grad-weight: one Ko x K' partial product per chunk.
    enum Second<T> {
        Weights(CudaSlice<T>),
        Parts(CudaSlice<T>),
    }
    let second = match pass {
        ConvPass::Fwd => {
            // w' [Ko][K'] = w with zero columns K..K'.
            let w2 = unsafe { dev.alloc::<T>(g.ko * kp)? }; // SAFETY: written in full by pad_rows
            let (ko, ki, kpi) = (i32_of(g.ko, op, "Ko")?, i32_of(k, op, "K")?, i32_of(kp, op, "K'")?);
            let mut bld = stream.launch_builder(&pad_rows);
            bld.arg(b).arg(&w2).arg(&ko).arg(&ki).arg(&ki).arg(&kpi);
            // SAFETY: (src, dst, rows, cols, ld_src, ld_dst) as pad_rows_* takes them; w holds Ko*K, w' Ko*K'.
            unsafe { bld.launch(reduce_cfg(g.ko * kp)) }.w()?;
            Second::Weights(w2)
        }
        // SAFETY: chunk z's Ko x K' partial product is written in full by its GEMM before sum_rows reads it.
        ConvPass::Wgrad => Second::Parts(unsafe { dev.alloc::<T>(chunks * g.ko * kp)? }),
        ConvPass::Dgrad => candle_core::bail!("{op}: the im2col path has no grad-input"),
    };
    let x = if pass == ConvPass::Fwd { a } else { b };
    let rows_kernel_smem = use_rows_kernel(g, kp, std::mem::size_of::<T>(), Im2colKernel::Auto, op)?;
    for z in 0..chunks {
        let n0 = z * imgs;
        let rows = (g.n - n0).min(imgs) * p * q;
        let m0 = n0 * p * q;
        write_cols(dev, g, kp, x, &cols, (m0, rows), rows_kernel_smem, sms, op)?;
        let cv = cols.slice(..rows * kp);
        match &second {
            Second::Weights(wp) => {
                let yv = out.slice(m0 * g.ko..(m0 + rows) * g.ko);
                tma_gemm(dev, tile, GemmLayout::Nt, (rows, g.ko, kp), &cv, &wp.as_view(), &yv, None, Epi::Plain, op)?;
            }
            Second::Parts(parts) => {
                let dyv = a.slice(m0 * g.ko..(m0 + rows) * g.ko);
                let pv = parts.slice(z * g.ko * kp..(z + 1) * g.ko * kp);
                tma_gemm(dev, tile, GemmLayout::Tn, (g.ko, kp, rows), &dyv, &cv, &pv, None, Epi::Plain, op)?;
            }
        }
    }
    if let Second::Parts(parts) = &second {
        let (nz, ko, ki, kpi) = (chunks as i32, g.ko as i32, k as i32, kp as i32);
        let mut bld = stream.launch_builder(&sum_rows);
        bld.arg(parts).arg(out).arg(&nz).arg(&ko).arg(&ki).arg(&kpi);
        // SAFETY: (src, dst, parts, rows, cols, ld_src) as sum_rows_* takes them; parts holds chunks*Ko*K',
        // dw Ko*K.
        unsafe { bld.launch(reduce_cfg(g.ko * k)) }.w()?;
    }
    Ok(())
}

/// Largest shared-memory tile of `im2col_rows` (the default dynamic limit, no opt-in needed).
const ROWS_SMEM_MAX: usize = 48 * 1024;

/// Shared memory of `im2col_rows` for `g` (bytes): the K' column table (ints, rounded up to 4) and the R staged
/// input rows of Wp = (Q - 1) * stride + R columns of C elements of `elem` bytes.
fn rows_smem(g: &ConvGeom, kp: usize, elem: usize) -> usize {
    4 * kp.next_multiple_of(4) + elem * g.r * ((g.q() - 1) * g.stride + g.r) * g.c
}

/// Whether `KERNELS_IM2COL_GATHER=1` is set: the launcher's choice (`Auto`) then takes the old gather kernel
/// everywhere, for timing the two against each other in one run (scripts/gpu-step.sh's `fused-im2colgather`).
fn gather_forced() -> bool {
    static GATHER: OnceLock<bool> = OnceLock::new();
    *GATHER.get_or_init(|| std::env::var_os("KERNELS_IM2COL_GATHER").is_some_and(|v| v == "1"))
}

/// The shared memory of `im2col_rows` (bytes) where `kernel` resolves to it for `g`, None for the gather kernel:
/// `Auto` takes it wherever its tile fits in 48 KB of shared memory (unless [`gather_forced`]); `Rows` where it
/// does not fit is an error naming the need.
fn use_rows_kernel(g: &ConvGeom, kp: usize, elem: usize, kernel: Im2colKernel, op: &str) -> Result<Option<u32>> {
    let smem = rows_smem(g, kp, elem);
    let fits = smem <= ROWS_SMEM_MAX;
    let rows = Some(smem as u32);
    match kernel {
        Im2colKernel::Auto => Ok(if fits && !gather_forced() { rows } else { None }),
        Im2colKernel::Gather => Ok(None),
        Im2colKernel::Rows if fits => Ok(rows),
        Im2colKernel::Rows => candle_core::bail!(
            "{op} (cuda): im2col_rows needs {smem} bytes of shared memory for this input, more than {ROWS_SMEM_MAX}"
        ),
    }
}

/// Writes the rows [m0, m0 + rows) of im2col(x) (whole images) to cols[0 .. rows * K'] with `im2col_rows` (one
/// block per output row, the input rows staged in `rows_kernel_smem` bytes of shared memory, as
/// [`use_rows_kernel`] gives them) or, with None, `im2col_nhwc` (one thread per 16-byte chunk).
#[allow(clippy::too_many_arguments)]
fn write_cols<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    g: &ConvGeom,
    kp: usize,
    x: &CudaView<T>,
    cols: &CudaSlice<T>,
    (m0, rows): (usize, usize),
    rows_kernel_smem: Option<u32>,
    sms: usize,
    op: &str,
) -> Result<()> {
    let sfx = suffix(T::DTYPE, op)?;
    let (p, q) = (g.p(), g.q());
    let args = Im2colArgs {
        m0: m0 as i64,
        rows: i32_of(rows, op, "rows")?,
        h: i32_of(g.h, op, "H")?,
        w: i32_of(g.w, op, "W")?,
        c: i32_of(g.c, op, "C")?,
        p: i32_of(p, op, "P")?,
        q: i32_of(q, op, "Q")?,
        r: i32_of(g.r, op, "R")?,
        stride: i32_of(g.stride, op, "stride")?,
        pad: i32_of(g.pad, op, "padding")?,
        kp: i32_of(kp, op, "K'")?,
    };
    let (name, cfg) = if let Some(smem) = rows_kernel_smem {
        // One block per output row (n, oh), at most 64 a multiprocessor (each loops over the rest).
        let out_rows = rows / q;
        let grid = out_rows.clamp(1, 64 * sms) as u32;
        ("im2col_rows", LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem })
    } else {
        let threads = rows * (kp / 8);
        let grid = threads.div_ceil(256).clamp(1, 16 * sms) as u32;
        (
            "im2col_nhwc",
            LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: (4 * kp) as u32 },
        )
    };
    let f = function(dev, "conv/06_im2col", &format!("{name}_{sfx}"), 0)?;
    let stream = dev.cuda_stream();
    let mut bld = stream.launch_builder(&f);
    bld.arg(x).arg(cols).arg(&args);
    // SAFETY: (x, cols, args) as im2col_{rows,nhwc}_* take them; x holds N*H*W*C, cols at least rows*K'; rows is a
    // whole number of images from m0 (a multiple of P*Q); im2col_rows' shared memory as
    // rows_smem sizes it (use_rows_kernel).
    unsafe { bld.launch(cfg) }.w()?;
    Ok(())
}

/// [`crate::ops::im2col::Im2colNhwc`] on CUDA (bf16 / f16): every row of im2col(x) in one buffer.
pub fn im2col_op(
    op: &Im2colNhwc,
    s: &CudaStorage,
    l: &Layout,
    (n, h, w, c, p, q, kp): (usize, usize, usize, usize, usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "im2col_nhwc";
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{OP} (cuda): input must be contiguous, got {l:?}")))?;
    let dev = &s.device;
    let g = ConvGeom { n, h, w, c, ko: 8, r: op.r, stride: op.stride, pad: op.pad };
    debug_assert_eq!((g.p(), g.q()), (p, q));
    let sms = sm_count(dev)?;
    let rows = n * p * q;
    let out = cuda_float!(s.dtype(), OP, [BF16: half::bf16, F16: half::f16], |T| {
        let rows_kernel_smem = use_rows_kernel(&g, kp, std::mem::size_of::<T>(), op.kernel, OP)?;
        // Every element of the rows x K' buffer is written by write_cols below (NaN first under poison_outputs).
        let cols = super::alloc_out::<T>(dev, rows * kp)?;
        write_cols(dev, &g, kp, &s.as_cuda_slice::<T>()?.slice(a..b), &cols, (0, rows), rows_kernel_smem, sms, OP)?;
        CudaStorage::wrap_cuda_slice(cols, dev.clone())
    });
    Ok((out, Shape::from((rows, kp))))
}
