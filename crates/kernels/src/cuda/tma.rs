//! The TMA kernels (tiles x256 / x128 / x64: `kernels/gemm/05_tma_wgmma.cu`, `kernels/conv/05_tma_wgmma.cu`):
//! tensor maps (tiled and im2col, encoded by the driver), the persistent launch with split-K, and the GEMM on
//! them. sm_90a only.

use super::common::{splitk_reduce, splitk_workspace, GemmShape};
use super::i32_of;
use super::loader::{function, sm_count};
use crate::geom::GemmLayout;
use crate::variants::Tile;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{DType, Result, WithDType};

/// A CUtensorMap as the kernels take it: 128 opaque bytes by value (`ig::TmaDesc`, a `__grid_constant__`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TmaDesc([u64; 16]);

// SAFETY: plain bytes, laid out as the CUtensorMap the driver encoded.
unsafe impl DeviceRepr for TmaDesc {}

fn tma_dtype(dt: DType, op: &str) -> Result<candle_core::cuda_backend::cudarc::driver::sys::CUtensorMapDataType> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUtensorMapDataType as D;
    match dt {
        DType::BF16 => Ok(D::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        DType::F16 => Ok(D::CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        other => candle_core::bail!("{op} (cuda): no TMA path for {other:?}"),
    }
}

/// Tensor map of a row-major `outer` x `inner` matrix at device address `ptr` (row stride `inner` elements):
/// boxes of 64 x `box_outer` elements into 128-byte-swizzled shared memory, zero fill out of bounds.
pub(crate) fn tma_map(ptr: u64, dt: DType, inner: usize, outer: usize, box_outer: u32, op: &str) -> Result<TmaDesc> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let dtype = tma_dtype(dt, op)?;
    if !(inner * 2).is_multiple_of(16) || !ptr.is_multiple_of(16) {
        candle_core::bail!("{op} (cuda): TMA operand rows of {inner} elements are not 16-byte aligned");
    }
    let dims = [inner.max(1) as u64, outer.max(1) as u64];
    let strides = [(inner.max(8) * 2) as u64];
    let boxes = [64u32, box_outer];
    let elem_strides = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer argument points at an array of the rank (2) the call says, or rank - 1 for strides;
    // the map is written by the driver before it is read.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!("{op} (cuda): cuTensorMapEncodeTiled failed ({r:?}) for a {outer}x{inner} operand");
    }
    // SAFETY: initialised by the successful call above.
    Ok(TmaDesc(unsafe { map.assume_init() }.opaque))
}

/// Im2col tensor map over the channels-last tensor `dims` = (n, h, w, c) at `ptr`: each copy is a column of
/// `pixels` output pixels x 64 channels; the windows' top-left corners walk the box [lower, size - 1 + upper]
/// (per (h, w)) at `stride`, and the filter tap comes with each copy as its im2col offset. For an r x r
/// convolution with `pad`: lower = -pad, upper = pad - (r - 1). Zero fill outside the tensor.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tma_im2col_map(
    ptr: u64,
    dt: DType,
    (n, h, w, c): (usize, usize, usize, usize),
    lower: (i32, i32),
    upper: (i32, i32),
    stride: usize,
    pixels: u32,
    op: &str,
) -> Result<TmaDesc> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let dtype = tma_dtype(dt, op)?;
    if c % 64 != 0 || !ptr.is_multiple_of(16) || stride == 0 || stride > 8 {
        candle_core::bail!("{op} (cuda): no im2col tensor map for c={c} stride={stride}");
    }
    let dims = [c as u64, w as u64, h as u64, n as u64];
    let strides = [(c * 2) as u64, (w * c * 2) as u64, (h * w * c * 2) as u64];
    let (lower, upper) = ([lower.1, lower.0], [upper.1, upper.0]); // (w, h) order
    let elem_strides = [1u32, stride as u32, stride as u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: dims / elem_strides have rank (4) entries, strides rank - 1, the corners rank - 2; the map is
    // written by the driver before it is read.
    let res = unsafe {
        sys::cuTensorMapEncodeIm2col(
            map.as_mut_ptr(),
            dtype,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            lower.as_ptr(),
            upper.as_ptr(),
            64,
            pixels,
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if res != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!("{op} (cuda): cuTensorMapEncodeIm2col failed ({res:?}) for a {n}x{h}x{w}x{c} tensor");
    }
    // SAFETY: initialised by the successful call above.
    Ok(TmaDesc(unsafe { map.assume_init() }.opaque))
}

/// The im2col corners (lower, upper) of an r x r convolution with `pad` (same for h and w).
pub(crate) fn conv_corners(r: usize, pad: usize) -> ((i32, i32), (i32, i32)) {
    let (lo, up) = (-(pad as i32), pad as i32 - (r as i32 - 1));
    ((lo, lo), (up, up))
}

/// Split-K of the TMA kernels: one k-split while the tiles alone give half a wave of blocks, else as many splits
/// as fit the SMs in one wave, each at least 2 k-tiles deep (4 left the FC layer's grad-input, 1 x 32 tiles of
/// 128 x 64 with K = 1000, at 3 splits on 96 of 132 SMs). Returns (k_split, splits).
fn tma_split(tile: Tile, m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let tiles = m.div_ceil(tile.bm) * n.div_ceil(tile.bn);
    let want = if 2 * tiles >= sms { 1 } else { (sms / tiles.max(1)).min(k / (2 * tile.bk)).max(1) };
    let k_split = k.div_ceil(want).div_ceil(tile.bk).max(1) * tile.bk;
    (k_split, k.div_ceil(k_split).max(1))
}

/// Elements of the BatchNorm moments that a STATS kernel (`*_stats_*`, `ig::tma_epilogue_stats`) writes for an
/// m x n output: (2 ceil(m / 128) + 1) x n FP32, bn_nhwc_moments_v8's partial layout with 128 rows per chunk.
pub fn stats_partials_len(m: usize, n: usize) -> usize {
    (2 * m.div_ceil(STATS_ROWS) + 1) * n
}

/// Rows per chunk of the epilogue statistics (the TMA row tile; the CPU's partials use the same,
/// [`crate::ops::batchnorm::PARTIAL_ROWS`]).
pub const STATS_ROWS: usize = crate::ops::batchnorm::PARTIAL_ROWS;

/// Elements of the BatchNorm backward sums that a GSUMS kernel writes for an m x n output: 2 ceil(m / 128) x n
/// FP32, the sums pass's partial layout with 128 rows per chunk (reduced by bn_nhwc_bwd_final_v8).
pub fn grad_sums_partials_len(m: usize, n: usize) -> usize {
    2 * m.div_ceil(STATS_ROWS) * n
}

/// Device addresses of a BatchNorm's statistics (3, c), weight and bias (c), FP32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnAddrs {
    pub stats: u64,
    pub weight: u64,
    pub bias: u64,
}

/// What a TMA launch's epilogue computes besides C.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Epi {
    #[default]
    Plain,
    /// The BatchNorm moments of C's columns into the partials at `part` ([`stats_partials_len`]; the STATS
    /// kernels, `ig::tma_epilogue_stats`).
    Moments { part: u64 },
    /// The backward sums of the BatchNorm (+ ReLU) whose output gradient C is, into the partials at `part`
    /// ([`grad_sums_partials_len`]): `z` is that BatchNorm's input (C-shaped, row-major), `bn` its per-channel
    /// tensors (the GSUMS kernels, `ig::tma_epilogue_grad_sums`).
    GradSums { part: u64, z: u64, bn: BnAddrs },
    /// Not an epilogue: the activation operand (NT: A, a 1x1 forward's input; TN: B, a 1x1 grad-weight's input)
    /// is relu(bn(z)) of the z its map reads, with the BatchNorm `bn` (training statistics), normalised in shared
    /// memory on its way to the tensor cores (the BNIN kernels, `ig::bnin_a` / `ig::bnin_b`): the products of the
    /// materialised activation, bit for bit, without writing or reading it. Split-K allowed.
    BnReluIn { bn: BnAddrs },
    /// [`Epi::BnReluIn`] on A (NT only) and [`Epi::Moments`] of C into the partials at `part` (the BNIN_STATS
    /// kernels: a bottleneck conv3's forward whose input bn2 never writes, with bn3's moments); no split-K.
    BnReluInMoments { bn: BnAddrs, part: u64 },
    /// C joined with the residual gradient at `b` (C-shaped, row-major, read through map Z into the z ring) under
    /// the ReLU mask at `mask` (rows x n / 8 bytes, bit k of byte (row, c / 8) for column c = 8 (c / 8) + k): each
    /// element mask ? round(round(c) + b) : 0, the block-output join's value bit for bit (the JOIN kernels,
    /// `ig::join_pair`; NN only). Needs C through map C (n % 32 == 0, C, b 16-byte and the mask 4-byte aligned:
    /// the launcher refuses otherwise); no split-K.
    Join { mask: u64, b: u64 },
    /// [`Epi::Join`], and the backward sums of the BatchNorm whose output gradient the joined value is (a
    /// bottleneck's last BatchNorm, no ReLU of its own: sum g and sum g xhat, xhat = (z3 - mean) invstd with the
    /// statistics (3, n) at `stats`) into the partials at `part` ([`grad_sums_partials_len`]): `z3` is that
    /// BatchNorm's input (C-shaped, row-major, read through map Z3), taken by statistics warps from the joined
    /// chunks (the JOINSW kernels, `ig::tma_join_sums_warps`). As Join, and `part` and `z3` 16-byte aligned.
    JoinSums { mask: u64, b: u64, z3: u64, part: u64, stats: u64 },
}

/// A TMA kernel of one family by its tag ("nn", "nn_gsums", "dgrad", ..: the launcher's naming of
/// `gemm_{tag}_{tile}_vec_{dtype}` or `conv_{tag}_{tile}_tma_{dtype}`), loaded.
pub(crate) type KernelByTag<'a> = &'a dyn Fn(&str) -> Result<CudaFunction>;

/// One launch of the TMA kernel `tag` of `kernel` (tile x256, x128 or x64) over the m x n x k problem described
/// by the tensor maps: the persistent grid, split-K through an FP32 workspace and gemm_splitk_reduce (which then
/// adds the bias). `base` carries the convolution geometry (zero for matmuls); c is m x n row-major when `plain_c`
/// (else the kernel places the rows itself, without split-K). `epi` other than Plain: `tag` names the matching
/// STATS / GSUMS kernel; no split-K, the partials' address goes in the workspace argument (and for GradSums z in
/// the bias argument, the BatchNorm's tensors in the shape). A GSUMS launch on x128 or x64 whose C goes through
/// map C runs the tag's statistics-warps kernel (`{tag}w`, `ig::tma_gsums_warps`) instead.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tma_run<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    (kernel, tag): (KernelByTag, &str),
    (ma, mb): (&TmaDesc, &TmaDesc),
    (m, n, k): (usize, usize, usize),
    base: GemmShape,
    c: &CudaView<T>,
    bias: Option<&CudaView<T>>,
    plain_c: bool,
    epi: Epi,
    op: &str,
) -> Result<()> {
    let sms = sm_count(dev)?;
    if epi != Epi::Plain && bias.is_some() {
        candle_core::bail!("{op} (cuda): epilogue statistics with a bias");
    }
    // Split-K and the TMA store need C to be the plain row-major m x n matrix (not the strided grad-input's
    // scattered rows); the statistics need whole sums in one unit.
    let (k_split, splits) = if plain_c && matches!(epi, Epi::Plain | Epi::BnReluIn { .. }) {
        tma_split(tile, m, n, k, sms)
    } else {
        (k.div_ceil(tile.bk).max(1) * tile.bk, 1)
    };
    let split = splits > 1;
    if split {
        i32_of(splits * m * n, op, "split-K workspace")?;
    }
    let stream = dev.cuda_stream();
    let (pc, gc) = c.device_ptr(&stream);
    // Without split-K the kernel stores a plain C through a tensor map (16-byte rows needed: N % 8 == 0). A GSUMS
    // kernel then also reads z (C's shape) through map Z: x128 loads each unit's z tile into shared memory
    // (TmaCfg::Z_SMEM), so z must be 16-byte aligned as well.
    let z_addr = match epi {
        Epi::GradSums { z, .. } => Some(z),
        Epi::Join { b, .. } | Epi::JoinSums { b, .. } => Some(b),
        _ => None,
    };
    // A STATS kernel with map C takes its moments from the staged tile in three warps of its producer warpgroup,
    // which write the partials 16 bytes at a time (ig::tma_stats_warps), and so does a GSUMS launch on x128 / x64
    // (ig::tma_gsums_warps, below); without map C the consumers reduce and write them a float at a time.
    let part_ok = match epi {
        Epi::Moments { part } | Epi::GradSums { part, .. } | Epi::BnReluInMoments { part, .. } => part % 16 == 0,
        Epi::JoinSums { part, z3, .. } => part % 16 == 0 && z3 % 16 == 0,
        _ => true,
    };
    let tma_c = plain_c && !split && n % 8 == 0 && pc % 16 == 0 && z_addr.is_none_or(|z| z % 16 == 0) && part_ok;
    if let Epi::Join { mask, .. } | Epi::JoinSums { mask, .. } = epi {
        if !tma_c || n % 32 != 0 || mask % 4 != 0 {
            candle_core::bail!(
                "{op} (cuda): the joined store needs C through its tensor map, n % 32 == 0, a 4-byte aligned mask \
                 (and with the sums 16-byte aligned partials and z3)"
            );
        }
    }
    // The GSUMS kernels' sums: in statistics warps of the producer warpgroup, which read the staged tile (map C
    // needed) and a whole z tile (x128 and x64 only: x256's does not fit), under the next unit's MMAs; otherwise
    // in the consumers' epilogue.
    let f = match epi {
        Epi::GradSums { .. } if tma_c && tile.bn <= 128 => kernel(&format!("{tag}w"))?,
        _ => kernel(tag)?,
    };
    let mc = if tma_c { tma_map(pc, T::DTYPE, n, m, 64, op)? } else { TmaDesc([0; 16]) };
    let mz = match z_addr {
        Some(z) if tma_c => tma_map(z, T::DTYPE, n, m, 64, op)?,
        _ => TmaDesc([0; 16]),
    };
    // JOINSW: map Z3 covers the BatchNorm input z3 as map C covers C.
    let mz3 = match epi {
        Epi::JoinSums { z3, .. } => Some(tma_map(z3, T::DTYPE, n, m, 64, op)?),
        _ => None,
    };
    drop(gc);
    let sh = GemmShape {
        m: i32_of(m, op, "M")?,
        n: i32_of(n, op, "N")?,
        k: i32_of(k, op, "K")?,
        ldc: i32_of(n, op, "N")?,
        k_split: i32_of(k_split, op, "k_split")?,
        has_bias: bias.is_some() as i32,
        tma_c: tma_c as i32,
        ..base
    };
    let sh = match epi {
        Epi::GradSums { bn, .. } | Epi::BnReluIn { bn } | Epi::BnReluInMoments { bn, .. } => {
            GemmShape { bn_stats: bn.stats, bn_weight: bn.weight, bn_bias: bn.bias, ..sh }
        }
        // No ReLU: the sums read the statistics only.
        Epi::JoinSums { stats, .. } => GemmShape { bn_stats: stats, ..sh },
        _ => sh,
    };
    let units = m.div_ceil(tile.bm) * n.div_ceil(tile.bn) * splits;
    let cfg = LaunchConfig {
        grid_dim: (units.min(sms).max(1) as u32, 1, 1),
        block_dim: (tile.threads, 1, 1),
        shared_mem_bytes: tile.smem,
    };
    let ws = splitk_workspace(dev, split.then_some(splits * m * n))?;
    let mut bld = stream.launch_builder(&f);
    bld.arg(ma).arg(mb).arg(&mc).arg(&mz);
    if let Some(mz3) = &mz3 {
        bld.arg(mz3);
    }
    bld.arg(c);
    match &epi {
        Epi::Moments { part } | Epi::GradSums { part, .. } | Epi::BnReluInMoments { part, .. } => bld.arg(part),
        Epi::Join { mask, .. } | Epi::JoinSums { mask, .. } => bld.arg(mask),
        Epi::Plain | Epi::BnReluIn { .. } => bld.arg(&*ws),
    };
    if let Epi::JoinSums { part, .. } = &epi {
        bld.arg(part);
    }
    match (bias, &epi) {
        (Some(v), _) => bld.arg(v),
        (None, Epi::GradSums { z, .. }) => bld.arg(z),
        (None, _) => bld.arg(c), // never read: has_bias = 0
    };
    bld.arg(&sh);
    // SAFETY: (map A, map B, map C, map Z, c, ws, bias, shape) as the x256 / x128 / x64 kernels take them; the maps
    // cover exactly the operands of the m x n x k problem, c and z (read by the kernel only when tma_c; map Z only by
    // a GSUMS kernel), c holds m*n elements, ws splits*m*n when split, or the caller's stats_partials_len(m, n) /
    // grad_sums_partials_len(m, n) floats for a STATS / GSUMS kernel (GSUMS: z holds m*n elements, the BatchNorm's tensors 3n / n / n, checked by the caller;
    // JOIN: b holds m*n elements and the mask m*n/8 bytes, checked by the caller, map Z covers b;
    // JOINSW: (map A, map B, map C, map Z, map Z3, c, mask, partials, bias, shape), as JOIN and z3 m*n elements
    // (map Z3), the partials grad_sums_partials_len(m, n) floats, the statistics 3n, checked by the caller;
    // BNIN: the BatchNorm's tensors 3c / c / c for the c channels of the normalised operand, K for NT, N for TN,
    // 16-byte aligned with c % 8 == 0, checked by the caller; BNIN_STATS: as BNIN on A and STATS).
    unsafe { bld.launch(cfg) }.w()?;
    if split {
        splitk_reduce(dev, &ws, c, bias, (m, n, splits), op)?;
    }
    Ok(())
}

/// C (m x n) = A B in `layout` on a TMA tile, plus `bias` (length n) when given. The operands must be contiguous
/// and 16-byte aligned with rows of a multiple of 8 elements (the `vec` condition of the other kernels).
/// `epi`: also the BatchNorm moments of C's columns (NT only) or the backward sums of the BatchNorm whose output
/// gradient C is (NN only) into the partials, or A (NT) / B (TN) normalised by a BatchNorm + ReLU ([`Epi`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tma_gemm<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    layout: GemmLayout,
    (m, n, k): (usize, usize, usize),
    a: &CudaView<T>,
    b: &CudaView<T>,
    c: &CudaView<T>,
    bias: Option<&CudaView<T>>,
    epi: Epi,
    op: &str,
) -> Result<()> {
    let sfx = super::suffix(T::DTYPE, op)?;
    let stream = dev.cuda_stream();
    let (pa, ga) = a.device_ptr(&stream);
    let (pb, gb) = b.device_ptr(&stream);
    let (dt, bn) = (T::DTYPE, tile.bn as u32);
    let (ma, mb, tag) = match layout {
        GemmLayout::Nt => (tma_map(pa, dt, k, m, 128, op)?, tma_map(pb, dt, k, n, bn, op)?, "nt"),
        GemmLayout::Nn => (tma_map(pa, dt, k, m, 128, op)?, tma_map(pb, dt, n, k, 64, op)?, "nn"),
        GemmLayout::Tn => (tma_map(pa, dt, m, k, 64, op)?, tma_map(pb, dt, n, k, 64, op)?, "tn"),
    };
    let tag = match (epi, layout) {
        (Epi::Plain, _) => tag,
        (Epi::Moments { .. }, GemmLayout::Nt) => "nt_stats",
        (Epi::GradSums { .. }, GemmLayout::Nn) => "nn_gsums",
        (Epi::Join { .. }, GemmLayout::Nn) => "nn_join",
        (Epi::JoinSums { .. }, GemmLayout::Nn) => "nn_joinsw",
        (Epi::BnReluIn { .. }, GemmLayout::Nt) => "nt_bnin",
        (Epi::BnReluIn { .. }, GemmLayout::Tn) => "tn_bnin",
        (Epi::BnReluInMoments { .. }, GemmLayout::Nt) => "nt_bnin_stats",
        _ => candle_core::bail!("{op} (cuda): no {epi:?} epilogue for the {layout:?} GEMM"),
    };
    let kernel = |tag: &str| function(dev, tile.gemm_module, &format!("gemm_{tag}_{}_vec_{sfx}", tile.name), tile.smem);
    tma_run(dev, tile, (&kernel, tag), (&ma, &mb), (m, n, k), GemmShape::default(), c, bias, true, epi, op)?;
    drop((ga, gb));
    Ok(())
}
