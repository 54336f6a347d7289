//! What every tensor-core launcher shares: the `ig::Shape` mirror passed to the kernels, grid shapes, and the
//! split-K workspace and its reduction.

use super::i32_of;
use super::loader::{dev_key, function};
use crate::variants::{Tile, T64};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{Result, WithDType};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// k-tile depth of the cp.async kernels' k-split rounding.
pub(crate) const BK: usize = 32;

/// Mirror of `ig::Shape` (kernels/gemm/igemm.cuh): passed to every kernel by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemmShape {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
    pub batch: i32,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub ko: i32,
    pub r: i32,
    pub s: i32,
    pub p: i32,
    pub q: i32,
    pub stride: i32,
    pub pad: i32,
    pub k_split: i32,
    pub has_bias: i32,
    pub ph: i32,
    pub pw: i32,
    pub mh: i32,
    pub mw: i32,
    pub r0: i32,
    pub s0: i32,
    pub tr: i32,
    pub ts: i32,
    pub tma_c: i32,
    /// The GRAD_SUMS kernels: device addresses of the BatchNorm's statistics (3, n), weight and bias (n), FP32
    /// (0 elsewhere). 28 i32 fields before them: 8-byte aligned in C and here alike.
    pub bn_stats: u64,
    pub bn_weight: u64,
    pub bn_bias: u64,
}

// SAFETY: #[repr(C)] plain integers, laid out as the C struct the kernels take by value.
unsafe impl DeviceRepr for GemmShape {}

/// Grid of a cp.async kernel: one block per bm x bn tile, `splits` along z.
pub(crate) fn blocks(tile: Tile, m: usize, n: usize, splits: usize, op: &str) -> Result<LaunchConfig> {
    let gy = m.div_ceil(tile.bm).max(1);
    let gn = n.div_ceil(tile.bn).max(1);
    if gn > 65535 || splits > 65535 {
        candle_core::bail!("{op} (cuda): grid {gy}x{gn}x{splits} too large");
    }
    Ok(LaunchConfig {
        grid_dim: (i32_of(gy, op, "grid")? as u32, gn as u32, splits as u32),
        block_dim: (tile.threads, 1, 1),
        shared_mem_bytes: tile.smem,
    })
}

/// Grid-stride shape of the element-wise reductions (at most 65,536 blocks of 256).
pub(crate) fn reduce_cfg(len: usize) -> LaunchConfig {
    let b = len.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (b, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The FP32 workspace argument of a GEMM launch: `len` floats for split-K partial sums (written in full by the
/// blocks of every k-split before the reduction reads them), or without split-K the per-device placeholder.
pub(crate) fn splitk_workspace(dev: &CudaDevice, len: Option<usize>) -> Result<Arc<CudaSlice<f32>>> {
    match len {
        // SAFETY: written in full (every (z, row, col) by the block that owns the unit) before it is read.
        Some(len) => Ok(Arc::new(unsafe { dev.alloc::<f32>(len)? })),
        None => no_workspace(dev),
    }
}

/// The workspace argument of a launch without split-K (never read or written): one float per device, allocated
/// once, instead of an allocation per launch.
fn no_workspace(dev: &CudaDevice) -> Result<Arc<CudaSlice<f32>>> {
    static W: OnceLock<Mutex<HashMap<usize, Arc<CudaSlice<f32>>>>> = OnceLock::new();
    let mut map = W.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(w) = map.get(&dev_key(dev)) {
        return Ok(w.clone());
    }
    let w = Arc::new(dev.alloc_zeros::<f32>(1)?);
    map.insert(dev_key(dev), w.clone());
    Ok(w)
}

/// c (m x n, row-major) = the sum of the FP32 partial sums ws[splits][m][n] (+ bias), in order:
/// gemm_splitk_reduce (in the t64 GEMM module).
pub(crate) fn splitk_reduce<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    ws: &CudaSlice<f32>,
    c: &CudaView<T>,
    bias: Option<&CudaView<T>>,
    (m, n, splits): (usize, usize, usize),
    op: &str,
) -> Result<()> {
    let sfx = super::suffix(T::DTYPE, op)?;
    let r = function(dev, T64.gemm_module, &format!("gemm_splitk_reduce_{sfx}"), T64.smem)?;
    let stream = dev.cuda_stream();
    let mut bld = stream.launch_builder(&r);
    let (hb, mn, nn, sp) = (bias.is_some() as i32, i32_of(m * n, op, "M*N")?, i32_of(n, op, "N")?, splits as i32);
    bld.arg(ws).arg(c);
    match bias {
        Some(v) => bld.arg(v),
        None => bld.arg(c), // never read: has_bias = 0
    };
    bld.arg(&hb).arg(&mn).arg(&nn).arg(&sp);
    // SAFETY: (ws, c, bias, has_bias, mn, n, splits) as gemm_splitk_reduce_* takes them; ws holds splits*m*n.
    unsafe { bld.launch(reduce_cfg(m * n)) }.w()?;
    Ok(())
}
