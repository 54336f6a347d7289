//! CUDA launchers of the channels-last BatchNorm ops (`ops/batchnorm.rs`) on the kernels of
//! `kernels/batchnorm/02_nhwc_vec.cu` (8 channels per thread, 16-byte accesses, one-pass statistics with the
//! running-statistics update in its finaliser) where the channel count and the alignment allow ([`v8_applies`]:
//! every ResNet BatchNorm), else `kernels/batchnorm/01_nhwc.cu` (two-pass statistics, a separate running update).
//! The backward passes of both write the same partial-sum layout (reduced by `bn_nhwc_bwd_final[_v8]`).
//!
//! Launch shape of 02's reductions: 256 threads, grid (chunks), at most 396 blocks (132 SMs x 3,
//! `KERNELS_BN_CHUNKS_PER_SM`) with at least 16 rows per thread; its element-wise passes: one thread per 8
//! elements, grid-stride; its finalisers: block (8, 128) per 8 channels. 01's row passes: block (32, 8), grid
//! (ceil(c / 32), chunks), chunks chosen for about 2048 blocks with at least 64 rows each; its finalisers: block
//! (32, 8) per 32 channels. Workspaces are FP32 (chunks x c partial sums, two halves for 02's moments and both
//! backward sums), fully written by the partial-sum kernels before the finaliser reads them.

use super::{alloc_out, ptx, suffix};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Module name under which candle caches the BatchNorm PTX.
const MODULE: &str = "batchnorm/01_nhwc";
/// The 8-channel variant's module.
const MODULE_V8: &str = "batchnorm/02_nhwc_vec";
/// Threads of a 02 reduction block; blocks 02's reductions aim for.
const V8_THREADS: usize = 256;
const V8_TARGET_BLOCKS: usize = 1056;
/// Fewest rows a thread of a 02 reduction steps over: each block ends in two shared-memory reductions, which at 4
/// rows per thread (ResNet-152's 14x14x256 BatchNorms at batch 256: 6 rows) cost as much as the loads.
const V8_MIN_ROWS_PER_THREAD: usize = 16;

/// Row chunks 02's reductions aim for: 132 x [`CHUNKS_PER_SM`] (one chunk a resident block of the cooperative
/// launches, which run 3 or 4 blocks an SM), or 132 x N with `KERNELS_BN_CHUNKS_PER_SM=N` (1 to 8; empty: the
/// default) in the environment, for timing other splits against the default in one run (scripts/gpu-step.sh
/// `fused-chunks8`). Was 132 x 8 (1056 chunks: 2.67 rounds of 396 blocks, and finalisers reading 1056 partials a
/// channel; ResNet-152's ktrace: a fixed 10-40 us a launch beyond its bytes, `scripts/ktrace-steps.py bn`); 132 x
/// 3 ran the ResNet-152 step 0.9% faster on an H100 (2026-12-06, alternating A/B, docs/BENCHMARKS.md). Both
/// BatchNorm paths take the same split, so their results stay equal bit for bit.
const CHUNKS_PER_SM: usize = 3;

fn v8_target_chunks() -> Result<usize> {
    static PER_SM: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let per_sm = PER_SM.get_or_init(|| match std::env::var("KERNELS_BN_CHUNKS_PER_SM") {
        Err(_) => Ok(CHUNKS_PER_SM),
        Ok(v) if v.trim().is_empty() => Ok(CHUNKS_PER_SM),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if (1..=8).contains(&n) => Ok(n),
            _ => Err(format!("KERNELS_BN_CHUNKS_PER_SM must be an integer from 1 to 8, got {v:?}")),
        },
    });
    match per_sm {
        Ok(n) => Ok(132 * n),
        Err(e) => Err(candle_core::Error::Msg(e.clone())),
    }
}

/// Whether 02 (8 channels per thread) runs a (rows, c) problem: c a multiple of 8 whose 8-channel groups divide
/// 256, every activation operand (`elems`) starting on a 16-byte boundary (8 elements: 32 bytes for f32) and every
/// per-channel f32 tensor (`chans`) on a 16-byte boundary.
pub(crate) fn v8_applies(c: usize, elems: &[&Layout], chans: &[&Layout]) -> bool {
    c.is_multiple_of(8)
        && V8_THREADS.is_multiple_of(c / 8)
        && elems.iter().all(|l| l.start_offset() % 8 == 0)
        && chans.iter().all(|l| l.start_offset() % 4 == 0)
}
const TX: usize = 32;
const TY: u32 = 8;
/// Blocks the row passes aim for (H100/H200: 132 SMs x up to 8 resident blocks of 256 threads, about 2 waves).
const TARGET_BLOCKS: usize = 2048;
/// Fewest rows a chunk gets (8 per thread row).
const MIN_ROWS_PER_CHUNK: usize = 64;

/// A (storage, layout) argument of an op.
pub type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// The per-channel tensors of a backward pass (the op's fields): forward statistics (3, c), weight and bias (c),
/// all f32, and with `sums` ((2, c) from the first pass) the grad-input pass instead of the sums pass.
#[derive(Debug, Clone, Copy)]
pub struct GradArgs<'a> {
    pub relu: bool,
    pub stats: &'a Tensor,
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
    pub sums: Option<&'a Tensor>,
}

/// Row split of a (rows, c) problem.
#[derive(Debug, Clone, Copy)]
struct Split {
    rows: i64,
    c: i32,
    ctiles: u32,
    chunks: usize,
    rows_per_chunk: i64,
}

impl Split {
    fn new(rows: usize, c: usize, op: &str) -> Result<Self> {
        let c32 = i32::try_from(c).map_err(|_| candle_core::Error::Msg(format!("{op} (cuda): c = {c} exceeds i32")))?;
        let ctiles = c.div_ceil(TX);
        let chunks = (TARGET_BLOCKS / ctiles).clamp(1, rows.div_ceil(MIN_ROWS_PER_CHUNK).max(1));
        let rows_per_chunk = rows.div_ceil(chunks);
        let chunks = rows.div_ceil(rows_per_chunk);
        Ok(Self { rows: rows as i64, c: c32, ctiles: ctiles as u32, chunks, rows_per_chunk: rows_per_chunk as i64 })
    }
    /// 02's row split: at most [`v8_target_chunks`] chunks, each thread stepping over at least
    /// [`V8_MIN_ROWS_PER_THREAD`] rows.
    fn v8(rows: usize, c: usize, op: &str) -> Result<Self> {
        let base = Self::new(rows, c, op)?;
        let rstep = V8_THREADS / (c / 8);
        let chunks = v8_target_chunks()?.clamp(1, rows.div_ceil(V8_MIN_ROWS_PER_THREAD * rstep).max(1));
        let rows_per_chunk = rows.div_ceil(chunks);
        let chunks = rows.div_ceil(rows_per_chunk);
        Ok(Self { chunks, rows_per_chunk: rows_per_chunk as i64, ..base })
    }
    fn v8_rows_cfg(&self) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.chunks as u32, 1, 1), block_dim: (V8_THREADS as u32, 1, 1), shared_mem_bytes: 0 }
    }
    fn v8_final_cfg(&self) -> LaunchConfig {
        final_v8_cfg(self.c as usize)
    }
    /// 02's element-wise passes: 256 threads a block (a thread keeps its channel group), at most
    /// [`V8_TARGET_BLOCKS`] blocks striding over the groups of 8 elements, so each thread loads its per-channel
    /// constants once for many groups (one group per thread ran bwd_dx at ~1.9 TB/s on the H200).
    fn v8_elems_cfg(&self) -> LaunchConfig {
        let groups = self.rows as usize * self.c as usize / 8;
        let blocks = groups.div_ceil(V8_THREADS).clamp(1, V8_TARGET_BLOCKS) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (V8_THREADS as u32, 1, 1), shared_mem_bytes: 0 }
    }
    fn rows_cfg(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.ctiles, self.chunks as u32, 1),
            block_dim: (TX as u32, TY, 1),
            shared_mem_bytes: 0,
        }
    }
    fn final_cfg(&self) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.ctiles, 1, 1), block_dim: (TX as u32, TY, 1), shared_mem_bytes: 0 }
    }
    /// The row count as the kernels' FP32 divisor.
    fn count(&self) -> f32 {
        self.rows as f32
    }
}

pub(crate) fn view<'a, T: CudaDType + DeviceRepr>(
    a: Arg<'a>,
    len: usize,
    dev: &CudaDevice,
    op: &str,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let (s, l) = a;
    if !s.device.same_device(dev) {
        candle_core::bail!("{op} (cuda): {what} is on another device");
    }
    let (lo, hi) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op} (cuda): {what} must be contiguous, got {l:?}")))?;
    if hi - lo != len {
        candle_core::bail!("{op} (cuda): {what} has {} elements, expected {len}", hi - lo);
    }
    Ok(s.as_cuda_slice::<T>()?.slice(lo..hi))
}

/// The storage of a per-channel f32 tensor held by an op; read it with [`held_view`] while the guard lives.
pub(crate) fn held(t: &Tensor) -> (candle_core::StorageRef<'_>, &Layout) {
    t.storage_and_layout()
}

pub(crate) fn held_view<'a>(
    s: &'a Storage,
    l: &'a Layout,
    len: usize,
    dev: &CudaDevice,
    op: &str,
    what: &str,
) -> Result<CudaView<'a, f32>> {
    match s {
        Storage::Cuda(cs) => view::<f32>((cs, l), len, dev, op, what),
        _ => candle_core::bail!("{op} (cuda): {what} is not on a CUDA device"),
    }
}

/// Binds views of a backward op's per-channel f32 tensors ([`GradArgs`]: stats (3, c), weight and bias (c)) as
/// `$sv`, `$wv`, `$bv`; their storage guards stay alive to the end of the caller's scope.
macro_rules! chan_views {
    ($op:expr, $c:expr, $dev:expr, $name:expr => $sv:ident, $wv:ident, $bv:ident) => {
        let (st, sl) = held($op.stats);
        let (wt, wl) = held($op.weight);
        let (bt, bl) = held($op.bias);
        let $sv = held_view(&st, sl, 3 * $c, $dev, $name, "stats")?;
        let $wv = held_view(&wt, wl, $c, $dev, $name, "weight")?;
        let $bv = held_view(&bt, bl, $c, $dev, $name, "bias")?;
    };
}

/// The layouts of a backward op's per-channel tensors (stats, weight, bias), for [`v8_applies`].
fn chan_layouts<'a>(op: &'a GradArgs) -> [&'a Layout; 3] {
    [op.stats.layout(), op.weight.layout(), op.bias.layout()]
}

// ----- forward statistics ------------------------------------------------------------------------------------

/// Device addresses of a BatchNorm's running statistics, updated in place by the statistics launch (PyTorch's
/// update: `momentum`, unbiased variance, `num_batches_tracked` + 1). The caller keeps the tensors alive and
/// unaliased for the launch (they are the BatchNorm's buffers; nothing else reads them during a step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunningAddrs {
    /// running_mean, running_var: (c) f32; num_batches_tracked: scalar i64.
    pub mean: u64,
    pub var: u64,
    pub num_batches_tracked: u64,
    pub momentum: f32,
}

impl RunningAddrs {
    /// The finalisers' (running_mean, running_var, num_batches_tracked, momentum) arguments: null addresses
    /// without a running update.
    fn kernel_args(r: Option<Self>) -> (u64, u64, u64, f32) {
        match r {
            Some(r) => (r.mean, r.var, r.num_batches_tracked, r.momentum),
            None => (0, 0, 0, 0.0),
        }
    }
}

fn stats_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    x: Arg,
    sp: Split,
    eps: f64,
    v8: bool,
    running: Option<RunningAddrs>,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_stats";
    let dev = &x.0.device;
    let c = sp.c as usize;
    let xv = view::<T>(x, sp.rows as usize * c, dev, OP, "x")?;
    let stats = alloc_out::<f32>(dev, 3 * c)?;
    let sfx = suffix(T::DTYPE, OP)?;
    let (chunks, count, eps) = (sp.chunks as i32, sp.count(), eps as f32);
    let (rm, rv, nb, momentum) = RunningAddrs::kernel_args(running);

    if v8 {
        // One pass: per-chunk shifted sums and M2 (2 x chunks x c) and the shift (c), then the exact combination
        // + running update.
        // SAFETY: bn_nhwc_moments_v8_* writes every (chunk, channel) element of both halves, block 0 the shift.
        let part = unsafe { dev.alloc::<f32>((2 * sp.chunks + 1) * c)? };
        let f =
            dev.get_or_load_custom_func(&format!("bn_nhwc_moments_v8_{sfx}"), MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
        let mut b = f.builder();
        b.arg(&xv).arg(&part).arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk);
        // SAFETY: matches bn_nhwc_moments_v8_* (x, part, rows, c, rpc); x holds rows*c elements (c % 8 == 0,
        // 256 % (c / 8) == 0, 16-byte aligned), part (2*chunks+1)*c; every chunk has at least one row.
        unsafe { b.launch(sp.v8_rows_cfg()) }.w()?;
        let f = dev.get_or_load_custom_func("bn_nhwc_moments_final", MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
        let mut b = f.builder();
        // rpc 0: the moments pass's chunks are row groups (02_nhwc_vec.cu: for_chunk_rows, ChunkRows), not runs
        // of rpc rows.
        let groups = 0i64;
        b.arg(&part).arg(&stats).arg(&chunks).arg(&sp.c).arg(&sp.rows).arg(&groups).arg(&eps);
        b.arg(&rm).arg(&rv).arg(&nb).arg(&momentum);
        // SAFETY: matches bn_nhwc_moments_final (part, stats, chunks, c, rows, rpc, eps, running_mean,
        // running_var, num_batches_tracked, momentum); stats holds 3*c elements; the running addresses are null
        // or c / c / 1 elements ([`RunningAddrs`]); one block per 8 channels.
        unsafe { b.launch(sp.v8_final_cfg()) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(stats, dev.clone()));
    }

    // SAFETY: bn_nhwc_{sum,sqdev}_* write every (chunk, channel) element.
    let part = unsafe { dev.alloc::<f32>(sp.chunks * c)? };
    let f = dev.get_or_load_custom_func(&format!("bn_nhwc_sum_{sfx}"), MODULE, ptx::BATCHNORM_01_NHWC)?;
    let mut b = f.builder();
    b.arg(&xv).arg(&part).arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk);
    // SAFETY: matches bn_nhwc_sum_* (x, part, rows, c, rpc); x holds rows*c elements, part chunks*c (the grid has
    // `chunks` row chunks).
    unsafe { b.launch(sp.rows_cfg()) }.w()?;

    let f = dev.get_or_load_custom_func("bn_nhwc_mean", MODULE, ptx::BATCHNORM_01_NHWC)?;
    let mut b = f.builder();
    b.arg(&part).arg(&stats).arg(&chunks).arg(&sp.c).arg(&count);
    // SAFETY: matches bn_nhwc_mean (part, stats, chunks, c, count); stats holds 3*c elements.
    unsafe { b.launch(sp.final_cfg()) }.w()?;

    let f = dev.get_or_load_custom_func(&format!("bn_nhwc_sqdev_{sfx}"), MODULE, ptx::BATCHNORM_01_NHWC)?;
    let mut b = f.builder();
    b.arg(&xv).arg(&stats).arg(&part).arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk);
    // SAFETY: matches bn_nhwc_sqdev_* (x, stats, part, rows, c, rpc).
    unsafe { b.launch(sp.rows_cfg()) }.w()?;

    let f = dev.get_or_load_custom_func("bn_nhwc_var", MODULE, ptx::BATCHNORM_01_NHWC)?;
    let mut b = f.builder();
    b.arg(&part).arg(&stats).arg(&chunks).arg(&sp.c).arg(&count).arg(&eps);
    // SAFETY: matches bn_nhwc_var (part, stats, chunks, c, count, eps).
    unsafe { b.launch(sp.final_cfg()) }.w()?;

    if running.is_some() {
        let f = dev.get_or_load_custom_func("bn_nhwc_running_update", MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
        let mut b = f.builder();
        b.arg(&stats).arg(&sp.c).arg(&count).arg(&rm).arg(&rv).arg(&nb).arg(&momentum);
        // SAFETY: matches bn_nhwc_running_update (stats, c, count, running_mean, running_var,
        // num_batches_tracked, momentum); running_mean/var hold c elements, num_batches_tracked 1.
        unsafe { b.launch(super::grid_for(c)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(stats, dev.clone()))
}

/// Batch statistics on CUDA: x (rows, c) contiguous -> (3, c) f32 = [mean, var, invstd]; with `running`, the
/// BatchNorm's running statistics updated in place in the same launches.
pub fn stats(
    s: &CudaStorage,
    l: &Layout,
    rows: usize,
    c: usize,
    eps: f64,
    running: Option<RunningAddrs>,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_stats";
    let v8 = v8_applies(c, &[l], &[]);
    let sp = if v8 { Split::v8(rows, c, OP)? } else { Split::new(rows, c, OP)? };
    cuda_float!(s.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| stats_t::<T>((s, l), sp, eps, v8, running))
}

/// 02's finalisers (bn_nhwc_moments_final, bn_nhwc_bwd_final_v8): block (8 channels, 128 chunk lanes), one block
/// per 8 channels (the kernels skip channels >= c).
fn final_v8_cfg(c: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (c.div_ceil(8) as u32, 1, 1), block_dim: (8, 128, 1), shared_mem_bytes: 0 }
}

/// Statistics (3, c) = [mean, biased var, invstd] of a (rows, c) convolution output from the moments its
/// epilogue wrote (`ig::tma_epilogue_stats`: partials of [`super::tma::stats_partials_len`]`(rows, c)` floats,
/// [`super::tma::STATS_ROWS`] rows per chunk), combined by bn_nhwc_moments_final (with the running update when
/// `running` is given): one launch instead of the moments pass over the output and the finaliser.
pub fn stats_from_partials(
    s: &CudaStorage,
    l: &Layout,
    rows: usize,
    c: usize,
    eps: f64,
    running: Option<RunningAddrs>,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_stats_from_partials";
    let dev = &s.device;
    let len = super::tma::stats_partials_len(rows, c);
    let part = view::<f32>((s, l), len, dev, OP, "partials")?;
    let chunks = rows.div_ceil(super::tma::STATS_ROWS);
    let stats = alloc_out::<f32>(dev, 3 * c)?;
    let (rm, rv, nb, momentum) = RunningAddrs::kernel_args(running);
    let (chunks32, c32) = (super::i32_of(chunks, OP, "chunks")?, super::i32_of(c, OP, "c")?);
    let (rows64, rpc, eps) = (rows as i64, super::tma::STATS_ROWS as i64, eps as f32);
    let f = dev.get_or_load_custom_func("bn_nhwc_moments_final", MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let mut b = f.builder();
    b.arg(&part).arg(&stats).arg(&chunks32).arg(&c32).arg(&rows64).arg(&rpc).arg(&eps);
    b.arg(&rm).arg(&rv).arg(&nb).arg(&momentum);
    let cfg = final_v8_cfg(c);
    // SAFETY: matches bn_nhwc_moments_final (part, stats, chunks, c, rows, rpc, eps, running_mean, running_var,
    // num_batches_tracked, momentum); part holds (2 chunks + 1) c floats (checked), stats 3 c; the running
    // addresses are null or c / c / 1 elements; one block per 8 channels (the kernel skips channels >= c).
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(stats, dev.clone()))
}

/// Backward sums (2, c) = [sum g, sum g * xhat] of a BatchNorm from the partials a grad-input's epilogue wrote
/// (`ig::tma_epilogue_grad_sums`: [`super::tma::grad_sums_partials_len`]`(rows, c)` floats, 128 rows per chunk),
/// reduced by bn_nhwc_bwd_final_v8.
pub fn sums_from_partials(s: &CudaStorage, l: &Layout, rows: usize, c: usize) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_sums_from_partials";
    let dev = &s.device;
    let len = super::tma::grad_sums_partials_len(rows, c);
    let part = view::<f32>((s, l), len, dev, OP, "partials")?;
    let chunks = super::i32_of(rows.div_ceil(super::tma::STATS_ROWS), OP, "chunks")?;
    let c32 = super::i32_of(c, OP, "c")?;
    let sums = alloc_out::<f32>(dev, 2 * c)?;
    let f = dev.get_or_load_custom_func("bn_nhwc_bwd_final_v8", MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let mut b = f.builder();
    b.arg(&part).arg(&sums).arg(&chunks).arg(&c32);
    let cfg = final_v8_cfg(c);
    // SAFETY: matches bn_nhwc_bwd_final_v8 (part, sums, chunks, c); part holds 2 chunks c floats (checked), sums
    // 2 c; one block per 8 channels (the kernel skips channels >= c).
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(sums, dev.clone()))
}

// ----- forward normalisation -----------------------------------------------------------------------------------

fn apply_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    x: Arg,
    w: Arg,
    b: Arg,
    stats: &Tensor,
    sp: Split,
    relu: bool,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc";
    let dev = &x.0.device;
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let xv = view::<T>(x, len, dev, OP, "x")?;
    let wv = view::<f32>(w, c, dev, OP, "weight")?;
    let bv = view::<f32>(b, c, dev, OP, "bias")?;
    let (st, sl) = held(stats);
    let sv = held_view(&st, sl, 3 * c, dev, OP, "stats")?;
    let y = alloc_out::<T>(dev, len)?;
    let relu = relu as i32;
    let sfx = suffix(T::DTYPE, OP)?;
    if v8_applies(c, &[x.1], &[w.1, b.1, sl]) {
        let f =
            dev.get_or_load_custom_func(&format!("bn_nhwc_apply_v8_{sfx}"), MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
        let mut bld = f.builder();
        bld.arg(&xv).arg(&sv).arg(&wv).arg(&bv).arg(&y).arg(&sp.rows).arg(&sp.c).arg(&relu);
        // SAFETY: matches bn_nhwc_apply_v8_* (x, stats, weight, bias, y, rows, c, relu); x and y hold rows*c
        // elements (c % 8 == 0, x 16-byte aligned, y fresh), stats 3*c, weight and bias c (16-byte aligned).
        // The grid-stride loop covers every group of 8 elements.
        unsafe { bld.launch(sp.v8_elems_cfg()) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()));
    }
    let f = dev.get_or_load_custom_func(&format!("bn_nhwc_apply_{sfx}"), MODULE, ptx::BATCHNORM_01_NHWC)?;
    let mut bld = f.builder();
    bld.arg(&xv).arg(&sv).arg(&wv).arg(&bv).arg(&y).arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&relu);
    // SAFETY: matches bn_nhwc_apply_* (x, stats, weight, bias, y, rows, c, rpc, relu); x and y hold rows*c
    // elements, stats 3*c, weight and bias c. The grid covers every (row, channel).
    unsafe { bld.launch(sp.rows_cfg()) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// Normalisation (+ ReLU) on CUDA: x (rows, c), weight and bias (c) f32, `stats` (3, c) f32 -> y like x.
#[allow(clippy::too_many_arguments)]
pub fn apply(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    bs: &CudaStorage,
    bl: &Layout,
    stats: &Tensor,
    rows: usize,
    c: usize,
    relu: bool,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc";
    let sp = Split::new(rows, c, OP)?;
    let (x, w, b) = ((xs, xl), (ws, wl), (bs, bl));
    cuda_float!(xs.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| apply_t::<T>(x, w, b, stats, sp, relu))
}

// ----- backward ------------------------------------------------------------------------------------------------

fn grad_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    x: Arg,
    dy: Arg,
    op: &GradArgs,
    sp: Split,
) -> Result<CudaStorage> {
    let name = if op.sums.is_some() { "batch_norm_nhwc_grad_input" } else { "batch_norm_nhwc_grad_sums" };
    let dev = &x.0.device;
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let (xv, gv) = (view::<T>(x, len, dev, name, "x")?, view::<T>(dy, len, dev, name, "dy")?);
    chan_views!(op, c, dev, name => sv, wv, bv);
    let (relu, sfx) = (op.relu as i32, suffix(T::DTYPE, name)?);
    let sums_layout = op.sums.map(|t| t.layout());
    let v8 = v8_applies(c, &[x.1, dy.1], &chan_layouts(op)) && sums_layout.is_none_or(|l| l.start_offset() % 4 == 0);
    let sp = if v8 { Split::v8(sp.rows as usize, c, name)? } else { sp };
    match op.sums {
        None if v8 => {
            // SAFETY: bn_nhwc_bwd_sum_v8_* writes every (2, chunk, channel) element.
            let part = unsafe { dev.alloc::<f32>(2 * sp.chunks * c)? };
            let sums = alloc_out::<f32>(dev, 2 * c)?;
            let chunks = sp.chunks as i32;
            let f = dev.get_or_load_custom_func(
                &format!("bn_nhwc_bwd_sum_v8_{sfx}"),
                MODULE_V8,
                ptx::BATCHNORM_02_NHWC_VEC,
            )?;
            let mut b = f.builder();
            b.arg(&xv).arg(&gv).arg(&sv).arg(&wv).arg(&bv).arg(&part);
            b.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&relu);
            // SAFETY: matches bn_nhwc_bwd_sum_v8_* (x, dy, stats, weight, bias, part, rows, c, rpc, relu); as the
            // 01 launch below, with c % 8 == 0, 256 % (c / 8) == 0 and 16-byte aligned operands (v8_applies);
            // gridDim.x = chunks.
            unsafe { b.launch(sp.v8_rows_cfg()) }.w()?;
            let f = dev.get_or_load_custom_func("bn_nhwc_bwd_final_v8", MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
            let mut b = f.builder();
            b.arg(&part).arg(&sums).arg(&chunks).arg(&sp.c);
            // SAFETY: matches bn_nhwc_bwd_final_v8 (part, sums, chunks, c); sums holds 2*c elements, one block
            // per 8 channels.
            unsafe { b.launch(sp.v8_final_cfg()) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(sums, dev.clone()))
        }
        Some(sums) if v8 => {
            let (ut, ul) = held(sums);
            let uv = held_view(&ut, ul, 2 * c, dev, name, "sums")?;
            let dx = alloc_out::<T>(dev, len)?;
            let count = sp.count();
            let f = dev.get_or_load_custom_func(
                &format!("bn_nhwc_bwd_dx_v8_{sfx}"),
                MODULE_V8,
                ptx::BATCHNORM_02_NHWC_VEC,
            )?;
            let mut b = f.builder();
            b.arg(&xv).arg(&gv).arg(&sv).arg(&wv).arg(&bv).arg(&uv).arg(&dx);
            b.arg(&sp.rows).arg(&sp.c).arg(&count).arg(&relu);
            // SAFETY: matches bn_nhwc_bwd_dx_v8_* (x, dy, stats, weight, bias, sums, dx, rows, c, count, relu);
            // x, dy and dx hold rows*c elements, stats 3*c, weight and bias c, sums 2*c, all 16-byte aligned
            // (v8_applies; dx fresh). The grid-stride loop covers every group of 8 elements.
            unsafe { b.launch(sp.v8_elems_cfg()) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
        }
        None => {
            // SAFETY: bn_nhwc_bwd_sum_* writes every (2, chunk, channel) element.
            let part = unsafe { dev.alloc::<f32>(2 * sp.chunks * c)? };
            let sums = alloc_out::<f32>(dev, 2 * c)?;
            let chunks = sp.chunks as i32;
            let f = dev.get_or_load_custom_func(&format!("bn_nhwc_bwd_sum_{sfx}"), MODULE, ptx::BATCHNORM_01_NHWC)?;
            let mut b = f.builder();
            b.arg(&xv).arg(&gv).arg(&sv).arg(&wv).arg(&bv).arg(&part);
            b.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&relu);
            // SAFETY: matches bn_nhwc_bwd_sum_* (x, dy, stats, weight, bias, part, rows, c, rpc, relu); x and dy
            // hold rows*c elements, stats 3*c, weight and bias c, part 2*chunks*c (gridDim.y = chunks).
            unsafe { b.launch(sp.rows_cfg()) }.w()?;

            let f = dev.get_or_load_custom_func("bn_nhwc_bwd_final", MODULE, ptx::BATCHNORM_01_NHWC)?;
            let mut b = f.builder();
            b.arg(&part).arg(&sums).arg(&chunks).arg(&sp.c);
            // SAFETY: matches bn_nhwc_bwd_final (part, sums, chunks, c); sums holds 2*c elements.
            unsafe { b.launch(sp.final_cfg()) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(sums, dev.clone()))
        }
        Some(sums) => {
            let (ut, ul) = held(sums);
            let uv = held_view(&ut, ul, 2 * c, dev, name, "sums")?;
            let dx = alloc_out::<T>(dev, len)?;
            let count = sp.count();
            let f = dev.get_or_load_custom_func(&format!("bn_nhwc_bwd_dx_{sfx}"), MODULE, ptx::BATCHNORM_01_NHWC)?;
            let mut b = f.builder();
            b.arg(&xv).arg(&gv).arg(&sv).arg(&wv).arg(&bv).arg(&uv).arg(&dx);
            b.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&count).arg(&relu);
            // SAFETY: matches bn_nhwc_bwd_dx_* (x, dy, stats, weight, bias, sums, dx, rows, c, rpc, count, relu);
            // x, dy and dx hold rows*c elements, stats 3*c, weight and bias c, sums 2*c. The grid covers every
            // (row, channel).
            unsafe { b.launch(sp.rows_cfg()) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
        }
    }
}

fn join_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    (a, b, y): (Arg, Option<Arg>, Arg),
    x: &Tensor,
    op: &GradArgs,
    (rows, c): (usize, usize),
    sums_out: u64,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_join_grad_sums";
    let dev = &a.0.device;
    let len = rows * c;
    let av = view::<T>(a, len, dev, OP, "a")?;
    let bv = view::<T>(b.unwrap_or(a), len, dev, OP, "b")?;
    let yv = view::<T>(y, len, dev, OP, "y")?;
    let (xs, xl) = held(x);
    let Storage::Cuda(xc) = &*xs else { candle_core::bail!("{OP} (cuda): z is not on a CUDA device") };
    let xv = view::<T>((xc, xl), len, dev, OP, "z")?;
    chan_views!(op, c, dev, OP => sv, wv, bnv);
    let elems = [a.1, b.map_or(a.1, |b| b.1), y.1, xl];
    if !v8_applies(c, &elems, &chan_layouts(op)) {
        candle_core::bail!("{OP} (cuda): the 8-channel path does not apply (c = {c})");
    }
    // The chunks of the sums pass it replaces (grad_t), so that the sums are the same bit for bit.
    let sp = Split::v8(rows, c, OP)?;
    let g = alloc_out::<T>(dev, len)?;
    // SAFETY: bn_nhwc_join_sum_*_v8_* writes every (2, chunk, channel) element.
    let part = unsafe { dev.alloc::<f32>(2 * sp.chunks * c)? };
    let sfx = suffix(T::DTYPE, OP)?;
    let name = format!("bn_nhwc_join_sum_{}_v8_{sfx}", if b.is_some() { 2 } else { 1 });
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let mut bld = f.builder();
    bld.arg(&av).arg(&bv).arg(&yv).arg(&g).arg(&xv).arg(&sv).arg(&wv).arg(&bnv).arg(&part);
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk);
    // SAFETY: matches bn_nhwc_join_sum_{1,2}_v8_* (a, b, y, g, x, stats, weight, bias, part, rows, c, rpc); a, b, y,
    // x and g hold rows*c elements (g fresh), stats 3*c, weight and bias c, all 16-byte aligned with c % 8 == 0
    // and 256 % (c / 8) == 0 (v8_applies); part 2*chunks*c; gridDim.x = chunks.
    unsafe { bld.launch(sp.v8_rows_cfg()) }.w()?;
    let chunks = sp.chunks as i32;
    let f = dev.get_or_load_custom_func("bn_nhwc_bwd_final_v8", MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let mut bld = f.builder();
    bld.arg(&part).arg(&sums_out).arg(&chunks).arg(&sp.c);
    // SAFETY: matches bn_nhwc_bwd_final_v8 (part, sums, chunks, c); sums_out is the caller's 2*c floats, one block
    // per 8 channels.
    unsafe { bld.launch(sp.v8_final_cfg()) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(g, dev.clone()))
}

/// The gradient at a block's output, g = a (+ b) where the block's ReLU output y is positive (rounded once, as
/// the relu_grad kernels give it), and the backward sums (2, c) of the BatchNorm `op` that made the block's last
/// pre-activation `x`, over (x, g), written to the 2 c floats at `sums_out` (as the sums pass gives them): one pass
/// over the rows (bn_nhwc_join_sum_{1,2}_v8) and the sums' finaliser. The 8-channel path only (an error
/// otherwise; `ops::batchnorm::join_grad_sums` checks first). Returns g.
pub fn join_sums(
    (a, b, y): (Arg, Option<Arg>, Arg),
    x: &Tensor,
    op: &GradArgs,
    rows: usize,
    c: usize,
    sums_out: u64,
) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_join_grad_sums";
    let dts = [Some(a.0.dtype()), b.map(|b| b.0.dtype()), Some(y.0.dtype()), Some(x.dtype())];
    if dts.iter().flatten().any(|d| *d != a.0.dtype()) {
        candle_core::bail!("{OP} (cuda): operands of different dtypes");
    }
    cuda_float!(a.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| {
        join_t::<T>((a, b, y), x, op, (rows, c), sums_out)
    })
}

/// The backward passes of the BatchNorm on CUDA: (x, dy) (rows, c) -> (2, c) f32 sums [sum g, sum g * xhat]
/// (`op.sums` unset) or dx like x (`op.sums` set).
pub fn grad(x: Arg, dy: Arg, op: &GradArgs, rows: usize, c: usize) -> Result<CudaStorage> {
    const OP: &str = "batch_norm_nhwc_grad";
    if x.0.dtype() != dy.0.dtype() {
        candle_core::bail!("{OP} (cuda): x is {:?} but dy is {:?}", x.0.dtype(), dy.0.dtype());
    }
    let sp = Split::new(rows, c, OP)?;
    cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| grad_t::<T>(x, dy, op, sp))
}

// ----- one cooperative launch a BatchNorm (`kernels.bn_cooperative`) ------------------------------------------

/// Blocks of a cooperative launch of the 256-thread kernel `f` (`name`) with `chunks` row chunks to reduce: every
/// block must be resident at once (the kernel waits at grid-wide barriers), so at most the occupancy (read once
/// per device and kernel) times the SMs, and at most `chunks` (each block loops over its chunks).
fn coop_blocks(dev: &CudaDevice, f: &CudaFunction, name: &str, chunks: usize) -> Result<u32> {
    type Cache = HashMap<(usize, String), u32>;
    static PER_SM: OnceLock<Mutex<Cache>> = OnceLock::new();
    let key = (super::loader::dev_key(dev), name.to_string());
    let map = PER_SM.get_or_init(Default::default);
    let cached = map.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
    let per_sm = match cached {
        Some(v) => v,
        None => {
            let v = f.occupancy_max_active_blocks_per_multiprocessor(V8_THREADS as u32, 0, None).w()?;
            map.lock().unwrap_or_else(|e| e.into_inner()).insert(key, v);
            v
        }
    };
    let resident = per_sm as usize * super::loader::sm_count(dev)?;
    if resident == 0 {
        candle_core::bail!("{name}: no block of {V8_THREADS} threads fits on an SM");
    }
    Ok(resident.min(chunks).max(1) as u32)
}

thread_local! {
    /// Cooperative launches made so far by this thread (every device; per thread, so that tests running side by
    /// side count their own): tests check that the one-launch path ran.
    static COOP_LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many cooperative BatchNorm launches ([`train`], [`train2`], [`train_backward`], [`train_join_backward`])
/// this thread has made.
pub fn cooperative_launches() -> u64 {
    COOP_LAUNCHES.with(std::cell::Cell::get)
}

thread_local! {
    /// Cooperative forward launches that took a convolution epilogue's moments ([`train`], [`train2`] with
    /// `moments`) on this thread: tests check that the path without the moments pass ran.
    static COOP_FROM_MOMENTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many cooperative BatchNorm forwards this thread has launched with a convolution epilogue's moments.
pub fn cooperative_launches_from_moments() -> u64 {
    COOP_FROM_MOMENTS.with(std::cell::Cell::get)
}

thread_local! {
    /// Cooperative backward launches that took a grad-input epilogue's sums ([`train_backward`] with `partials`)
    /// on this thread: tests check that the path without the sums pass ran.
    static COOP_FROM_SUMS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many cooperative BatchNorm backwards this thread has launched with a grad-input epilogue's sums.
pub fn cooperative_launches_from_sums() -> u64 {
    COOP_FROM_SUMS.with(std::cell::Cell::get)
}

/// The cooperative kernels' `rev` argument: their phase 1 takes the row chunks from the last to the first, where
/// the kernel before them left the tensors' ends in L2 (the results are the same either way). The environment
/// variable `KERNELS_BN_CHUNKS_FORWARD=1` turns the order back to first-to-last, for timing the two against each
/// other in one run (scripts/gpu-step.sh's `fused-fwdchunks`).
fn reverse_chunks() -> i32 {
    static REV: OnceLock<i32> = OnceLock::new();
    *REV.get_or_init(|| i32::from(std::env::var_os("KERNELS_BN_CHUNKS_FORWARD").is_none_or(|v| v != "1")))
}

fn coop_cfg(blocks: u32) -> LaunchConfig {
    COOP_LAUNCHES.with(|n| n.set(n.get() + 1));
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (V8_THREADS as u32, 1, 1), shared_mem_bytes: 0 }
}

/// The split of a cooperative forward whose moments come from a convolution's epilogue
/// ([`super::tma::STATS_ROWS`] rows a chunk) instead of its own phase 1.
fn epilogue_split(sp: Split) -> Split {
    let rpc = super::tma::STATS_ROWS;
    Split { chunks: (sp.rows as usize).div_ceil(rpc), rows_per_chunk: rpc as i64, ..sp }
}

/// The partials buffer of a cooperative launch: the epilogue's (read only: `have_moments`, `have_sums`) or a fresh
/// one that its phase 1 fills.
enum Partials<'a> {
    Given(CudaView<'a, f32>),
    Fresh(CudaSlice<f32>),
}

impl<'a> Partials<'a> {
    /// A forward's: the moments' layout, (2 chunks + 1) x c.
    fn new(moments: Option<Arg<'a>>, sp: &Split, dev: &CudaDevice, op: &str, what: &str) -> Result<Self> {
        Self::of_len(moments, (2 * sp.chunks + 1) * sp.c as usize, dev, op, what)
    }

    /// A backward's: the sums' layout, 2 chunks x c.
    fn sums(given: Option<Arg<'a>>, sp: &Split, dev: &CudaDevice, op: &str, what: &str) -> Result<Self> {
        Self::of_len(given, 2 * sp.chunks * sp.c as usize, dev, op, what)
    }

    fn of_len(given: Option<Arg<'a>>, len: usize, dev: &CudaDevice, op: &str, what: &str) -> Result<Self> {
        Ok(match given {
            Some(m) => Self::Given(view::<f32>(m, len, dev, op, what)?),
            // SAFETY: phase 1 writes every (chunk, channel) element of the layout (a forward's chunk 0 block the
            // shift too).
            None => Self::Fresh(unsafe { dev.alloc::<f32>(len)? }),
        })
    }

    fn push<'b>(&'b self, bld: &mut LaunchArgs<'b>) {
        match self {
            Self::Given(v) => bld.arg(v),
            Self::Fresh(s) => bld.arg(s),
        };
    }
}

/// A launch's outputs: the statistics, y, and with a shortcut and `mask` asked for, y's ReLU mask.
type TrainOut = (CudaStorage, CudaStorage, Option<CudaStorage>);

/// The ReLU mask a block output's launch writes: rows * c / 8 bytes (bit j of byte (row, group) set where
/// y[row, 8 group + j] > 0), or none.
fn mask_out(dev: &CudaDevice, len: usize, want: bool) -> Result<Option<CudaSlice<u8>>> {
    want.then(|| alloc_out::<u8>(dev, len / 8)).transpose()
}

/// [`train_t`] with y (and the mask) made, the only kind [`train`] asks for.
fn train_y<T: CudaDType + DeviceRepr + WithDType + 'static>(
    args: (Arg, Arg, Arg, Option<Arg>, Option<Arg>),
    sp: Split,
    eps: f64,
    relu: bool,
    running: Option<RunningAddrs>,
    mask: bool,
) -> Result<TrainOut> {
    let (stats, y, mask) = train_t::<T>(args, sp, eps, relu, running, mask, true)?;
    let y = y.ok_or_else(|| candle_core::Error::Msg("batch_norm_nhwc_train: no output made".into()))?;
    Ok((stats, y, mask))
}

/// `apply` false: the statistics only (y null: the kernel stops after its finaliser), no y nor mask.
#[allow(clippy::too_many_arguments)]
fn train_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    (x, w, b, res, moments): (Arg, Arg, Arg, Option<Arg>, Option<Arg>),
    sp: Split,
    eps: f64,
    relu: bool,
    running: Option<RunningAddrs>,
    mask: bool,
    apply: bool,
) -> Result<(CudaStorage, Option<CudaStorage>, Option<CudaStorage>)> {
    const OP: &str = "batch_norm_nhwc_train";
    let dev = &x.0.device;
    let sp = if moments.is_some() { epilogue_split(sp) } else { sp };
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let xv = view::<T>(x, len, dev, OP, "x")?;
    let wv = view::<f32>(w, c, dev, OP, "weight")?;
    let bv = view::<f32>(b, c, dev, OP, "bias")?;
    let rv = res.map(|r| view::<T>(r, len, dev, OP, "residual")).transpose()?;
    let have_moments = moments.is_some() as i32;
    COOP_FROM_MOMENTS.with(|n| n.set(n.get() + have_moments as u64));
    let part = Partials::new(moments, &sp, dev, OP, "epilogue moments")?;
    let stats = alloc_out::<f32>(dev, 3 * c)?;
    let y = apply.then(|| alloc_out::<T>(dev, len)).transpose()?;
    let mask = mask_out(dev, len, apply && mask && rv.is_some())?;
    let name = format!("bn_nhwc_train_v8_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let blocks = coop_blocks(dev, &f, &name, sp.chunks)?;
    let (chunks, eps, relu) = (sp.chunks as i32, eps as f32, relu as i32);
    let (rm, rv_addr, nb, momentum) = RunningAddrs::kernel_args(running);
    let null = 0u64;
    let mut bld = f.builder();
    bld.arg(&xv);
    match &rv {
        Some(r) => bld.arg(r),
        None => bld.arg(&null),
    };
    part.push(&mut bld);
    bld.arg(&stats).arg(&wv).arg(&bv);
    match &y {
        Some(y) => bld.arg(y),
        None => bld.arg(&null),
    };
    match &mask {
        Some(m) => bld.arg(m),
        None => bld.arg(&null),
    };
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&chunks).arg(&eps);
    let rev = reverse_chunks();
    bld.arg(&rm).arg(&rv_addr).arg(&nb).arg(&momentum).arg(&relu).arg(&have_moments).arg(&rev);
    // SAFETY: matches bn_nhwc_train_v8_* (x, res, part, stats, weight, bias, y, mask, rows, c, rpc, chunks, eps,
    // running_mean, running_var, num_batches_tracked, momentum, relu, have_moments, rev); x, res (or null) and y
    // hold rows*c elements (c % 8 == 0, 256 % (c / 8) == 0, 16-byte aligned: v8_applies; y fresh, or null: no
    // phase 3), the mask (or
    // null; only with res) rows*c/8 bytes, fresh, part (2 chunks
    // + 1) c (checked when given: the epilogue's chunks of 128 rows, read only under have_moments), stats 3 c, weight
    // and bias c; the running addresses are null or c / c / 1 elements ([`RunningAddrs`]); every chunk has a row.
    // A cooperative launch of at most the resident blocks ([`coop_blocks`]): the grid barriers need it.
    unsafe { bld.launch_cooperative(coop_cfg(blocks)) }.w()?;
    let mask = mask.map(|m| CudaStorage::wrap_cuda_slice(m, dev.clone()));
    let y = y.map(|y| CudaStorage::wrap_cuda_slice(y, dev.clone()));
    Ok((CudaStorage::wrap_cuda_slice(stats, dev.clone()), y, mask))
}

/// [`train`]'s statistics (and running update) alone, for a BatchNorm whose normalisation runs inside the next
/// convolution: one cooperative launch of `bn_nhwc_train_v8_*` with y null (phases 1 and 2). Bit for bit
/// [`train`]'s statistics. None where the 8-channel kernels do not apply.
pub fn train_stats(
    (x, moments): (Arg, Option<Arg>),
    w: Arg,
    b: Arg,
    rows: usize,
    c: usize,
    eps: f64,
    running: Option<RunningAddrs>,
) -> Result<Option<CudaStorage>> {
    const OP: &str = "batch_norm_nhwc_train_stats";
    if !v8_applies(c, &[x.1], &[w.1, b.1]) {
        return Ok(None);
    }
    let sp = Split::v8(rows, c, OP)?;
    let (stats, _, _) = cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| train_t::<T>(
        (x, w, b, None, moments),
        sp,
        eps,
        true,
        running,
        false,
        false
    ))?;
    Ok(Some(stats))
}

/// A training-mode BatchNorm forward in one cooperative launch (`bn_nhwc_train_v8_*`): x (rows, c), weight and
/// bias (c) f32 -> (stats (3, c) f32 = [mean, biased var, invstd], y = [relu](bn(x)) like x, or with `res` (like
/// x) y = relu(bn(x) + res)), with the running statistics updated in place when `running` is given; bit for bit
/// what [`stats`] and [`apply`] (or the residual kernels' `bn_add_relu`) give. With `moments` (the partials a
/// convolution's epilogue wrote for x: [`super::tma::stats_partials_len`]`(rows, c)` floats) the launch skips its
/// own moments pass: bit for bit [`stats_from_partials`] and the same element-wise pass. With `res` and `mask`
/// also y's ReLU mask (rows * c / 8 bytes: bit j of byte (row, group) set where y[row, 8 group + j] > 0), which
/// [`train_join_backward`] takes instead of y. None where the 8-channel kernels do not apply ([`v8_applies`]): the
/// caller runs those.
#[allow(clippy::too_many_arguments)]
pub fn train(
    (x, res, moments): (Arg, Option<Arg>, Option<Arg>),
    w: Arg,
    b: Arg,
    rows: usize,
    c: usize,
    eps: f64,
    relu: bool,
    running: Option<RunningAddrs>,
    mask: bool,
) -> Result<Option<TrainOut>> {
    const OP: &str = "batch_norm_nhwc_train";
    let elems: Vec<&Layout> = std::iter::once(x.1).chain(res.map(|r| r.1)).collect();
    if !v8_applies(c, &elems, &[w.1, b.1]) || res.is_some_and(|r| r.0.dtype() != x.0.dtype()) {
        return Ok(None);
    }
    let sp = Split::v8(rows, c, OP)?;
    let out = cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| train_y::<T>(
        (x, w, b, res, moments),
        sp,
        eps,
        relu,
        running,
        mask
    ))?;
    Ok(Some(out))
}

thread_local! {
    /// Cooperative stem launches with the max-pool fused ([`train_pool`], [`train_backward_pool`]) made so far by
    /// this thread: tests check that the fused path ran.
    static POOL_LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many [`train_pool`] and [`train_backward_pool`] launches this thread has made.
pub fn train_pool_launches() -> u64 {
    POOL_LAUNCHES.with(std::cell::Cell::get)
}

fn train_pool_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    (x, moments): (Arg, Option<Arg>),
    (w, b): (Arg, Arg),
    sp: Split,
    (n, h, wd, oh, ow): (i32, i32, i32, i32, i32),
    eps: f64,
    running: Option<RunningAddrs>,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_nhwc_train_relu_max_pool";
    let dev = &x.0.device;
    let sp = if moments.is_some() { epilogue_split(sp) } else { sp };
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let out_len = n as usize * oh as usize * ow as usize * c;
    let xv = view::<T>(x, len, dev, OP, "x")?;
    let wv = view::<f32>(w, c, dev, OP, "weight")?;
    let bv = view::<f32>(b, c, dev, OP, "bias")?;
    let have_moments = moments.is_some() as i32;
    COOP_FROM_MOMENTS.with(|n| n.set(n.get() + have_moments as u64));
    let part = Partials::new(moments, &sp, dev, OP, "epilogue moments")?;
    let stats = alloc_out::<f32>(dev, 3 * c)?;
    let y = alloc_out::<T>(dev, out_len)?;
    // SAFETY: phase 3 writes every (pixel, channel) byte (one 8-byte store per 8-channel group).
    let arg = unsafe { dev.alloc::<u8>(out_len)? };
    let name = format!("bn_nhwc_train_pool_v8_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let blocks = coop_blocks(dev, &f, &name, sp.chunks)?;
    let (chunks, eps) = (sp.chunks as i32, eps as f32);
    let (rm, rv_addr, nb, momentum) = RunningAddrs::kernel_args(running);
    let mut bld = f.builder();
    bld.arg(&xv);
    part.push(&mut bld);
    bld.arg(&stats).arg(&wv).arg(&bv).arg(&y).arg(&arg);
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&chunks).arg(&eps);
    let rev = reverse_chunks();
    bld.arg(&rm).arg(&rv_addr).arg(&nb).arg(&momentum).arg(&have_moments).arg(&rev);
    bld.arg(&n).arg(&h).arg(&wd).arg(&oh).arg(&ow);
    POOL_LAUNCHES.with(|n| n.set(n.get() + 1));
    // SAFETY: matches bn_nhwc_train_pool_v8_* (x, part, stats, weight, bias, y, arg, rows, c, rpc, chunks, eps,
    // running_mean, running_var, num_batches_tracked, momentum, have_moments, rev, n, h, w, oh, ow); x holds
    // rows = n*h*w rows of c elements (c % 8 == 0, 256 % (c / 8) == 0, 16-byte aligned: v8_applies), y and arg
    // n*oh*ow*c (fresh; oh, ow the 3x3/2/1 pool's), part (2 chunks + 1) c (checked when given), stats 3 c, weight
    // and bias c; the running addresses are null or c / c / 1 elements ([`RunningAddrs`]); every chunk has a row.
    // A cooperative launch of at most the resident blocks ([`coop_blocks`]): the grid barriers need it.
    unsafe { bld.launch_cooperative(coop_cfg(blocks)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(stats, dev.clone()),
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        CudaStorage::wrap_cuda_slice(arg, dev.clone()),
    ))
}

/// The ImageNet stem's training-mode BatchNorm + ReLU and its max-pool (kernel 3, stride 2, padding 1) in one
/// cooperative launch (`bn_nhwc_train_pool_v8_*`): x (n, h, w, c), weight and bias (c) f32 -> (stats (3, c) f32,
/// y (n, oh, ow, c) like x, the windows' argmax offsets (n, oh, ow, c) u8), the running statistics updated in
/// place when `running` is given; bit for bit [`train`] (relu) and the 8-channel max-pool forward and offsets on
/// its output, without writing the full-resolution activation. With `moments` as [`train`]. None where the
/// 8-channel kernels do not apply ([`v8_applies`]): the caller runs the separate launches.
pub fn train_pool(
    (x, moments): (Arg, Option<Arg>),
    (w, b): (Arg, Arg),
    (n, h, wd, c): (usize, usize, usize, usize),
    eps: f64,
    running: Option<RunningAddrs>,
) -> Result<Option<(CudaStorage, CudaStorage, CudaStorage)>> {
    const OP: &str = "batch_norm_nhwc_train_relu_max_pool";
    if !v8_applies(c, &[x.1], &[w.1, b.1]) || n == 0 || h == 0 || wd == 0 {
        return Ok(None);
    }
    let stem = crate::geom::MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let (_, oh, ow, _) = stem.out_shape_nhwc((n, h, wd, c));
    // The pooling phase's coordinates are 32-bit: every output 8-channel group and every input row index.
    if n * oh * ow * (c / 8) > i32::MAX as usize || n * h * wd > i32::MAX as usize {
        return Ok(None);
    }
    let i = |v: usize, what: &str| super::i32_of(v, OP, what);
    let geom = (i(n, "n")?, i(h, "h")?, i(wd, "w")?, i(oh, "oh")?, i(ow, "ow")?);
    let sp = Split::v8(n * h * wd, c, OP)?;
    let out = cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| train_pool_t::<T>(
        (x, moments),
        (w, b),
        sp,
        geom,
        eps,
        running
    ))?;
    Ok(Some(out))
}

fn train_bwd_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    x: Arg,
    dy: Arg,
    op: &GradArgs,
    sp: Split,
    partials: Option<Arg>,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_nhwc_train_backward";
    let dev = &x.0.device;
    let sp = if partials.is_some() { epilogue_split(sp) } else { sp };
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let (xv, gv) = (view::<T>(x, len, dev, OP, "x")?, view::<T>(dy, len, dev, OP, "dy")?);
    chan_views!(op, c, dev, OP => sv, wv, bv);
    let have_sums = partials.is_some() as i32;
    COOP_FROM_SUMS.with(|n| n.set(n.get() + have_sums as u64));
    let part = Partials::sums(partials, &sp, dev, OP, "epilogue backward sums")?;
    let sums = alloc_out::<f32>(dev, 2 * c)?;
    let dx = alloc_out::<T>(dev, len)?;
    let name = format!("bn_nhwc_train_bwd_v8_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let blocks = coop_blocks(dev, &f, &name, sp.chunks)?;
    let (chunks, count, relu) = (sp.chunks as i32, sp.count(), op.relu as i32);
    let mut bld = f.builder();
    bld.arg(&xv).arg(&gv).arg(&sv).arg(&wv).arg(&bv);
    part.push(&mut bld);
    bld.arg(&sums).arg(&dx);
    let rev = reverse_chunks();
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&chunks).arg(&count).arg(&relu).arg(&rev);
    bld.arg(&have_sums);
    // SAFETY: matches bn_nhwc_train_bwd_v8_* (x, dy, stats, weight, bias, part, sums, dx, rows, c, rpc, chunks,
    // count, relu, rev, have_sums); x, dy and dx hold rows*c elements (v8_applies: c % 8 == 0, 256 % (c / 8) == 0,
    // 16-byte aligned; dx fresh), stats 3 c, weight and bias c, part 2 chunks c (given: checked by its view, the
    // epilogue's 128-row chunks), sums 2 c. Cooperative, at most the resident blocks ([`coop_blocks`]).
    unsafe { bld.launch_cooperative(coop_cfg(blocks)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(sums, dev.clone()), CudaStorage::wrap_cuda_slice(dx, dev.clone())))
}

/// The BatchNorm backward (`op.sums` None: from the forward's statistics, weight and bias) in one cooperative
/// launch (`bn_nhwc_train_bwd_v8_*`): (sums (2, c) f32 = [dbias, dweight], dx like x); bit for bit what
/// [`grad`] without and then with the sums gives. With `partials` (the backward sums' partials a grad-input's
/// epilogue wrote, [`super::tma::grad_sums_partials_len`]) the launch reduces those instead of computing them: bit
/// for bit [`sums_from_partials`] then [`grad`] with the sums. None where the 8-channel kernels do not apply.
pub fn train_backward(
    x: Arg,
    dy: Arg,
    op: &GradArgs,
    partials: Option<Arg>,
    rows: usize,
    c: usize,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    const OP: &str = "batch_norm_nhwc_train_backward";
    if op.sums.is_some() {
        candle_core::bail!("{OP}: computes the sums itself (GradArgs::sums must be None)");
    }
    if !v8_applies(c, &[x.1, dy.1], &chan_layouts(op)) {
        return Ok(None);
    }
    let sp = Split::v8(rows, c, OP)?;
    let out =
        cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| train_bwd_t::<T>(x, dy, op, sp, partials))?;
    Ok(Some(out))
}

fn train_bwd_pool_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    (x, off, g1, g2): (Arg, Arg, Arg, Option<Arg>),
    op: &GradArgs,
    sp: Split,
    (h, wd, oh, ow): (i32, i32, i32, i32),
    out_len: usize,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_nhwc_train_backward_max_pool";
    let dev = &x.0.device;
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let xv = view::<T>(x, len, dev, OP, "x")?;
    let ov = view::<u8>(off, out_len, dev, OP, "offsets")?;
    let gv = view::<T>(g1, out_len, dev, OP, "grad")?;
    let g2v = g2.map(|g| view::<T>(g, out_len, dev, OP, "second grad")).transpose()?;
    chan_views!(op, c, dev, OP => sv, wv, bv);
    // SAFETY: phase 1 writes every (2, chunk, channel) element.
    let part = unsafe { dev.alloc::<f32>(2 * sp.chunks * c)? };
    let sums = alloc_out::<f32>(dev, 2 * c)?;
    let dx = alloc_out::<T>(dev, len)?;
    let name = format!("bn_nhwc_train_bwd_pool_v8_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let blocks = coop_blocks(dev, &f, &name, sp.chunks)?;
    let (chunks, count) = (sp.chunks as i32, sp.count());
    let null = 0u64;
    let mut bld = f.builder();
    bld.arg(&xv).arg(&ov).arg(&gv);
    match &g2v {
        Some(g) => bld.arg(g),
        None => bld.arg(&null),
    };
    bld.arg(&sv).arg(&wv).arg(&bv).arg(&part).arg(&sums).arg(&dx);
    let rev = reverse_chunks();
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&chunks).arg(&count).arg(&rev);
    bld.arg(&h).arg(&wd).arg(&oh).arg(&ow);
    POOL_LAUNCHES.with(|n| n.set(n.get() + 1));
    // SAFETY: matches bn_nhwc_train_bwd_pool_v8_* (x, arg, g1, g2, stats, weight, bias, part, sums, dx, rows, c,
    // rpc, chunks, count, rev, h, w, oh, ow); x and dx hold rows = n*h*w rows of c elements (dx fresh), the
    // offsets, g1 and g2 (or null) n*oh*ow*c (the 3x3/2/1 pool's output), all 16-byte aligned (offsets 8-byte)
    // with c % 8 == 0 and 256 % (c / 8) == 0 (checked by the caller); stats 3 c, weight and bias c, part 2 chunks
    // c, sums 2 c. Cooperative, at most the resident blocks ([`coop_blocks`]).
    unsafe { bld.launch_cooperative(coop_cfg(blocks)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(sums, dev.clone()), CudaStorage::wrap_cuda_slice(dx, dev.clone())))
}

/// The ImageNet stem's max-pool backward (kernel 3, stride 2, padding 1, from the windows' argmax offsets `off`,
/// of the gradient g1 (+ g2)) and its BatchNorm + ReLU backward (`op`, relu, sums None) in one cooperative launch
/// (`bn_nhwc_train_bwd_pool_v8_*`): x (n, h, w, c) the BatchNorm's input, off/g1/g2 (n, oh, ow, c) -> (sums (2, c)
/// f32 = [dbias, dweight], dx like x); bit for bit the pool's backward of the sum
/// ([`super::pool::maxpool_nhwc_bwd_offsets_sum`], or of g1 alone) followed by [`train_backward`], without
/// writing the full-resolution gradient. None where the 8-channel kernels do not apply (the offsets on an 8-byte
/// boundary too): the caller runs the separate launches.
pub fn train_backward_pool(
    (x, off, g1, g2): (Arg, Arg, Arg, Option<Arg>),
    op: &GradArgs,
    (n, h, wd, c): (usize, usize, usize, usize),
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    const OP: &str = "batch_norm_nhwc_train_backward_max_pool";
    if op.sums.is_some() || !op.relu {
        candle_core::bail!("{OP}: the stem's BatchNorm + ReLU backward (relu, GradArgs::sums None)");
    }
    let grads: Vec<&Layout> = std::iter::once(g1.1).chain(g2.map(|g| g.1)).collect();
    if !v8_applies(c, &[&[x.1][..], &grads].concat(), &chan_layouts(op))
        || off.1.start_offset() % 8 != 0
        || g2.is_some_and(|g| g.0.dtype() != g1.0.dtype())
        || g1.0.dtype() != x.0.dtype()
        || n == 0
    {
        return Ok(None);
    }
    let stem = crate::geom::MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let (_, oh, ow, _) = stem.out_shape_nhwc((n, h, wd, c));
    // The gather's coordinates are 32-bit: every row (cell) index and every row's 8-channel group.
    if n * h * wd * (c / 8) > i32::MAX as usize {
        return Ok(None);
    }
    let i = |v: usize, what: &str| super::i32_of(v, OP, what);
    let geom = (i(h, "h")?, i(wd, "w")?, i(oh, "oh")?, i(ow, "ow")?);
    let sp = Split::v8(n * h * wd, c, OP)?;
    let out_len = n * oh * ow * c;
    let out = cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| train_bwd_pool_t::<T>(
        (x, off, g1, g2),
        op,
        sp,
        geom,
        out_len
    ))?;
    Ok(Some(out))
}

/// What gates a block output's gradient in [`train_join_backward`]: the block output y itself (its positive
/// elements pass the gradient: rows * c elements read) or the ReLU mask [`train`] / [`train2`] wrote with it (rows
/// * c / 8 bytes, the same test bit for bit).
#[derive(Clone, Copy)]
pub enum Gate<'a> {
    Output(Arg<'a>),
    Mask(Arg<'a>),
}

/// The shortcut's gradient a joined backward adds ([`train_join_backward`]): like a, or on the grid of a 1x1
/// stride-2 downsample of a's (h, w) image, its grad-input without the zero cells (n, (h + 1) / 2, (w + 1) / 2, c).
#[derive(Clone, Copy)]
pub enum ShortcutArg<'a> {
    Full(Arg<'a>),
    Stride2 { g: Arg<'a>, h: usize, w: usize },
}

impl<'a> ShortcutArg<'a> {
    fn arg(&self) -> Arg<'a> {
        match *self {
            Self::Full(g) | Self::Stride2 { g, .. } => g,
        }
    }

    /// Elements of the gradient for a of `len` elements in `c` channels.
    fn len(&self, len: usize, c: usize) -> usize {
        match *self {
            Self::Full(_) => len,
            Self::Stride2 { h, w, .. } => len / (h * w * c) * h.div_ceil(2) * w.div_ceil(2) * c,
        }
    }
}

fn train_join_bwd_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    (a, b, gate, x): (Arg, Option<ShortcutArg>, Gate, Arg),
    op: &GradArgs,
    sp: Split,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    const OP: &str = "batch_norm_nhwc_train_join_backward";
    let dev = &a.0.device;
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let av = view::<T>(a, len, dev, OP, "a")?;
    let bv = match b {
        Some(b) => view::<T>(b.arg(), b.len(len, c), dev, OP, "b")?,
        None => view::<T>(a, len, dev, OP, "b")?,
    };
    let (yv, mv) = match gate {
        Gate::Output(y) => (Some(view::<T>(y, len, dev, OP, "y")?), None),
        Gate::Mask(m) => (None, Some(view::<u8>(m, len / 8, dev, OP, "ReLU mask")?)),
    };
    let null = 0u64;
    let xv = view::<T>(x, len, dev, OP, "z")?;
    chan_views!(op, c, dev, OP => sv, wv, bnv);
    let g = alloc_out::<T>(dev, len)?;
    // SAFETY: phase 1 writes every (2, chunk, channel) element.
    let part = unsafe { dev.alloc::<f32>(2 * sp.chunks * c)? };
    let sums = alloc_out::<f32>(dev, 2 * c)?;
    let dx = alloc_out::<T>(dev, len)?;
    let (kind, (bh, bw)) = match b {
        None => ("1", (0, 0)),
        Some(ShortcutArg::Full(_)) => ("2", (0, 0)),
        Some(ShortcutArg::Stride2 { h, w, .. }) => ("2s", (h as i32, w as i32)),
    };
    let name = format!("bn_nhwc_train_join_bwd_{kind}_v8_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let blocks = coop_blocks(dev, &f, &name, sp.chunks)?;
    let (chunks, count) = (sp.chunks as i32, sp.count());
    let mut bld = f.builder();
    bld.arg(&av).arg(&bv);
    match (&yv, &mv) {
        (Some(y), _) => bld.arg(y).arg(&null),
        (None, Some(m)) => bld.arg(&null).arg(m),
        (None, None) => unreachable!("a gate is y or its mask"),
    };
    bld.arg(&g).arg(&xv).arg(&sv).arg(&wv).arg(&bnv).arg(&part).arg(&sums).arg(&dx);
    let rev = reverse_chunks();
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&chunks).arg(&count).arg(&rev);
    if kind == "2s" {
        bld.arg(&bh).arg(&bw);
    }
    // SAFETY: matches bn_nhwc_train_join_bwd_{1,2}_v8_* (a, b, y, mask, g, x, stats, weight, bias, part, sums, dx,
    // rows, c, rpc, chunks, count, rev) and _2s_ (the same, then bh, bw: b holds n ceil(bh / 2) ceil(bw / 2) c
    // elements for rows = n bh bw < 2^31, checked by train_join_backward); exactly one of y (rows*c elements) and
    // the mask (rows*c/8 bytes) is non-null; a, b (unless strided), x, g and dx hold rows*c elements (g and dx
    // fresh), stats 3 c, weight and
    // bias c, all 16-byte aligned with c % 8 == 0 and 256 % (c / 8) == 0 (checked by the caller, v8_applies);
    // part 2 chunks c, sums 2 c. Cooperative, at most the resident blocks ([`coop_blocks`]).
    unsafe { bld.launch_cooperative(coop_cfg(blocks)) }.w()?;
    let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
    Ok((wrap(g), CudaStorage::wrap_cuda_slice(sums, dev.clone()), wrap(dx)))
}

/// A block output's ReLU gradient and its last BatchNorm's backward in one cooperative launch
/// (`bn_nhwc_train_join_bwd_{1,2,2s}_v8_*`): g = a (+ b, full size or on a stride-2 downsample's grid:
/// [`ShortcutArg`]) where the block's ReLU output y is positive (read from y or from its mask, [`Gate`]), then the sums (2, c) and dx of the BatchNorm `op` (no ReLU of its own, `op.sums`
/// None) over (x, g): (g, sums, dx), bit for bit what [`join_sums`] and [`grad`] with the sums give. None where the
/// 8-channel kernels do not apply.
pub fn train_join_backward(
    (a, b, gate, x): (Arg, Option<ShortcutArg>, Gate, Arg),
    op: &GradArgs,
    rows: usize,
    c: usize,
) -> Result<Option<(CudaStorage, CudaStorage, CudaStorage)>> {
    const OP: &str = "batch_norm_nhwc_train_join_backward";
    let y = match gate {
        Gate::Output(y) => Some(y),
        Gate::Mask(m) if m.0.dtype() == candle_core::DType::U8 => None,
        Gate::Mask(m) => candle_core::bail!("{OP}: the ReLU mask must be u8, got {:?}", m.0.dtype()),
    };
    if let Some(ShortcutArg::Stride2 { h, w, .. }) = b {
        if h * w == 0 || !rows.is_multiple_of(h * w) || rows >= 1 << 31 {
            candle_core::bail!("{OP}: a stride-2 shortcut gradient for {h} x {w} images does not fit {rows} rows");
        }
    }
    let dts = [Some(a.0.dtype()), b.map(|b| b.arg().0.dtype()), y.map(|y| y.0.dtype()), Some(x.0.dtype())];
    if op.sums.is_some() || op.relu || dts.iter().flatten().any(|d| *d != a.0.dtype()) {
        return Ok(None);
    }
    let elems = [a.1, b.map_or(a.1, |b| b.arg().1), y.map_or(a.1, |y| y.1), x.1];
    if !v8_applies(c, &elems, &chan_layouts(op)) {
        return Ok(None);
    }
    let sp = Split::v8(rows, c, OP)?;
    let out = cuda_float!(a.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| train_join_bwd_t::<T>(
        (a, b, gate, x),
        op,
        sp
    ))?;
    Ok(Some(out))
}

/// One BatchNorm of [`train2`]: its weight and bias (c) f32, eps and running statistics.
#[derive(Clone, Copy)]
pub struct TrainBn<'a> {
    pub weight: Arg<'a>,
    pub bias: Arg<'a>,
    pub eps: f64,
    pub running: Option<RunningAddrs>,
}

/// [`train2`]'s outputs: both statistics, y, and y's ReLU mask when asked for.
type Train2Out = (CudaStorage, CudaStorage, CudaStorage, Option<CudaStorage>);

fn train2_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    (x, r): (Arg, Arg),
    (bn, bn_r): (TrainBn, TrainBn),
    moments: Option<(Arg, Arg)>,
    sp: Split,
    mask: bool,
) -> Result<Train2Out> {
    const OP: &str = "batch_norm_nhwc_train2";
    let dev = &x.0.device;
    let sp = if moments.is_some() { epilogue_split(sp) } else { sp };
    let c = sp.c as usize;
    let len = sp.rows as usize * c;
    let (xv, rv) = (view::<T>(x, len, dev, OP, "x")?, view::<T>(r, len, dev, OP, "residual")?);
    let (wv, bv) = (view::<f32>(bn.weight, c, dev, OP, "weight")?, view::<f32>(bn.bias, c, dev, OP, "bias")?);
    let wrv = view::<f32>(bn_r.weight, c, dev, OP, "residual weight")?;
    let brv = view::<f32>(bn_r.bias, c, dev, OP, "residual bias")?;
    let have_moments = moments.is_some() as i32;
    COOP_FROM_MOMENTS.with(|n| n.set(n.get() + have_moments as u64));
    let part = Partials::new(moments.map(|m| m.0), &sp, dev, OP, "epilogue moments")?;
    let part_r = Partials::new(moments.map(|m| m.1), &sp, dev, OP, "shortcut's epilogue moments")?;
    let (stats, stats_r) = (alloc_out::<f32>(dev, 3 * c)?, alloc_out::<f32>(dev, 3 * c)?);
    let y = alloc_out::<T>(dev, len)?;
    let mask = mask_out(dev, len, mask)?;
    let null = 0u64;
    let name = format!("bn_nhwc_train2_v8_{}", suffix(T::DTYPE, OP)?);
    let f = dev.get_or_load_custom_func(&name, MODULE_V8, ptx::BATCHNORM_02_NHWC_VEC)?;
    let blocks = coop_blocks(dev, &f, &name, 2 * sp.chunks)?;
    let (chunks, eps, eps_r) = (sp.chunks as i32, bn.eps as f32, bn_r.eps as f32);
    let (rm, rvar, nb, momentum) = RunningAddrs::kernel_args(bn.running);
    let (rm_r, rvar_r, nb_r, momentum_r) = RunningAddrs::kernel_args(bn_r.running);
    let mut bld = f.builder();
    bld.arg(&xv).arg(&rv);
    part.push(&mut bld);
    part_r.push(&mut bld);
    bld.arg(&stats).arg(&stats_r);
    bld.arg(&wv).arg(&bv).arg(&wrv).arg(&brv).arg(&y);
    match &mask {
        Some(m) => bld.arg(m),
        None => bld.arg(&null),
    };
    bld.arg(&sp.rows).arg(&sp.c).arg(&sp.rows_per_chunk).arg(&chunks).arg(&eps).arg(&eps_r);
    bld.arg(&rm).arg(&rvar).arg(&nb).arg(&rm_r).arg(&rvar_r).arg(&nb_r).arg(&momentum).arg(&momentum_r);
    let rev = reverse_chunks();
    bld.arg(&have_moments).arg(&rev);
    // SAFETY: matches bn_nhwc_train2_v8_* (x, r, part, part_r, stats, stats_r, weight, bias, weight_r, bias_r, y,
    // mask (or null: rows*c/8 fresh bytes), rows, c, rpc, chunks, eps, eps_r, running_mean, running_var, num_batches_tracked, running_mean_r,
    // running_var_r, num_batches_tracked_r, momentum, momentum_r, have_moments, rev); x, r and y hold rows*c elements
    // (16-byte aligned, c % 8 == 0, 256 % (c / 8) == 0: v8_applies; y fresh), the partials (2 chunks + 1) c each
    // (checked when given: the epilogues' 128-row chunks, read only under have_moments), the statistics 3 c each,
    // weights and biases c; running addresses null or c / c / 1 elements. Cooperative, at most the resident blocks
    // ([`coop_blocks`]).
    unsafe { bld.launch_cooperative(coop_cfg(blocks)) }.w()?;
    let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
    let mask = mask.map(|m| CudaStorage::wrap_cuda_slice(m, dev.clone()));
    Ok((wrap(stats), wrap(stats_r), CudaStorage::wrap_cuda_slice(y, dev.clone()), mask))
}

/// A downsample block's output in one cooperative launch (`bn_nhwc_train2_v8_*`): the statistics of its last conv
/// output x and of the downsample conv output r (both (rows, c), one dtype), each BatchNorm's running statistics
/// updated, and y = relu(bn(x) + bn_r(r)): (stats, stats_r, y), bit for bit two [`stats`] and the residual
/// kernels' `bn_add_relu` with the normalised shortcut. With `moments` (both convolutions' epilogue partials, as
/// [`train`] takes them) without the moments pass; with `mask` also y's ReLU mask, as [`train`] writes it. None
/// where the 8-channel kernels do not apply.
pub fn train2(
    (x, r): (Arg, Arg),
    bn: TrainBn,
    bn_r: TrainBn,
    moments: Option<(Arg, Arg)>,
    rows: usize,
    c: usize,
    mask: bool,
) -> Result<Option<Train2Out>> {
    const OP: &str = "batch_norm_nhwc_train2";
    let chans = [bn.weight.1, bn.bias.1, bn_r.weight.1, bn_r.bias.1];
    if !v8_applies(c, &[x.1, r.1], &chans) || r.0.dtype() != x.0.dtype() {
        return Ok(None);
    }
    let sp = Split::v8(rows, c, OP)?;
    let out = cuda_float!(x.0.dtype(), OP, [F32: f32, BF16: bf16, F16: f16], |T| {
        train2_t::<T>((x, r), (bn, bn_r), moments, sp, mask)
    })?;
    Ok(Some(out))
}
