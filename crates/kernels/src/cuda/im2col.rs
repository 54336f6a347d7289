//! Explicit im2col for very few input channels (the RGB stem): `kernels/conv/06_im2col.cu` writes the rows of
//! im2col(x), a chunk of whole images at a time, and the TMA GEMM multiplies them.

use super::common::reduce_cfg;
use super::loader::{function, has_wgmma, sm_count};
use super::tma::{tma_gemm, Epi};
use super::{i32_of, suffix};
use crate::geom::{ConvGeom, ConvPass, GemmLayout};
use crate::variants::{Tile, X64};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{Result, WithDType};

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
    let (im2col, pad_rows, sum_rows) = (f("im2col_nhwc")?, f("pad_rows")?, f("sum_rows")?);
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
    for z in 0..chunks {
        let n0 = z * imgs;
        let rows = (g.n - n0).min(imgs) * p * q;
        let m0 = n0 * p * q;
        let args = Im2colArgs {
            m0: m0 as i64,
            rows: i32_of(rows, op, "rows")?,
            h: g.h as i32,
            w: g.w as i32,
            c: g.c as i32,
            p: p as i32,
            q: q as i32,
            r: g.r as i32,
            stride: g.stride as i32,
            pad: g.pad as i32,
            kp: kp as i32,
        };
        let threads = rows * (kp / 8);
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(256).clamp(1, 16 * sms) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (4 * kp) as u32,
        };
        let mut bld = stream.launch_builder(&im2col);
        bld.arg(x).arg(&cols).arg(&args);
        // SAFETY: (x, cols, args) as im2col_nhwc_* takes them; x holds N*H*W*C, cols imgs*P*Q*K' >= rows*K'.
        unsafe { bld.launch(cfg) }.w()?;
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
