//! CUDA launchers and candle custom ops of the tensor-core GEMM (`kernels/gemm/01_mma_cp_async.cu`) and the
//! implicit-GEMM channels-last convolution (`kernels/conv/01_implicit_gemm.cu`), both on `kernels/gemm/igemm.cuh`.
//!
//! The kernels ship as fatbins (SASS for sm_80/sm_90 + PTX) loaded once per device into a module cache here.
//! Each launch picks a variant (block tile, vectorised or scalar loads, split-K) from the shape: see
//! [`choose`]; [`set_forced_tile`] overrides the tile for benchmarks.

use crate::cuda::alloc_out;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

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
}

// SAFETY: #[repr(C)] plain integers, laid out as the C struct the kernels take by value.
unsafe impl DeviceRepr for GemmShape {}

/// A block-tile variant of the kernels (the `t128` / `t64` / ... part of a kernel name) and the numbered file
/// (module) that instantiates it: 1 = `01_*.cu`, 2 = `02_large_tiles.cu`, 3 = `03_deep_k.cu`, 4 = `04_wgmma.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    pub name: &'static str,
    pub bm: usize,
    pub bn: usize,
    /// k-tile depth (values of the reduction dimension per pipeline stage)
    pub bk: usize,
    pub threads: u32,
    pub smem: u32,
    pub file: u8,
}

/// 128x128x32, 8 warps of 64x32, 4 stages (01).
pub const T128: Tile =
    Tile { name: "t128", bm: 128, bn: 128, bk: 32, threads: 256, smem: 4 * (128 + 128) * 32 * 2, file: 1 };
/// 64x64x32, 4 warps of 32x32, 4 stages (01); the only tile with scalar loads and (matmul) split-K.
pub const T64: Tile = Tile { name: "t64", bm: 64, bn: 64, bk: 32, threads: 128, smem: 4 * (64 + 64) * 32 * 2, file: 1 };
/// 256x128x32, 8 warps of 64x64, 3 stages (02).
pub const T256: Tile =
    Tile { name: "t256", bm: 256, bn: 128, bk: 32, threads: 256, smem: 3 * (256 + 128) * 32 * 2, file: 2 };
/// 128x256x32, 8 warps of 64x64, 3 stages (02).
pub const T128W: Tile =
    Tile { name: "t128w", bm: 128, bn: 256, bk: 32, threads: 256, smem: 3 * (128 + 256) * 32 * 2, file: 2 };
/// 128x128x64, 8 warps of 64x32, 3 stages (03).
pub const T128K64: Tile =
    Tile { name: "t128k64", bm: 128, bn: 128, bk: 64, threads: 256, smem: 3 * (128 + 128) * 64 * 2, file: 3 };
/// 256x128x64, 8 warps of 64x64, 3 stages (03).
pub const T256K64: Tile =
    Tile { name: "t256k64", bm: 256, bn: 128, bk: 64, threads: 256, smem: 3 * (256 + 128) * 64 * 2, file: 3 };
/// Every tile variant, for the per-shape choice, benchmarks and tests.
/// 128x128x64 on warpgroup MMA (wgmma, sm_90a only), 2 warpgroups of 64x128, 5 stages (04_wgmma).
pub const W128: Tile =
    Tile { name: "w128", bm: 128, bn: 128, bk: 64, threads: 256, smem: 5 * (128 + 128) * 64 * 2 + 1024, file: 4 };
/// The same with 3 stages: 97 KiB, two blocks per SM (04_wgmma).
pub const W128S3: Tile =
    Tile { name: "w128s3", bm: 128, bn: 128, bk: 64, threads: 256, smem: 3 * (128 + 128) * 64 * 2 + 1024, file: 4 };
/// 128x256x64 on wgmma, 2 warpgroups of 64x256, 4 stages (04_wgmma).
pub const W256: Tile =
    Tile { name: "w256", bm: 128, bn: 256, bk: 64, threads: 256, smem: 4 * (128 + 256) * 64 * 2 + 1024, file: 4 };
/// A tile of the warp-specialised persistent TMA + wgmma kernel (05_tma_wgmma, sm_90a only): 128 x `bn` x 64,
/// 384 threads (a producer and two consumer warpgroups), `stages` stages; shared memory as `ig::TmaCfg` lays it
/// out (alignment slack, the stages, the epilogue staging buffer `ig::TMA_EPI_BYTES`: 64 x 128 outputs per
/// consumer warpgroup, two barriers per stage). Matmuls, the 1x1 stride-1 convolutions (plain GEMMs in
/// channels-last) and, through im2col tensor maps, the convolution passes [`tma_conv_applies`] accepts; a forced
/// TMA tile on any other convolution pass runs `w256` / `w128`.
const fn tma_tile(name: &'static str, bn: usize, stages: u32) -> Tile {
    let stage_bytes = ((128 + bn) * 64 * 2) as u32;
    Tile {
        name,
        bm: 128,
        bn,
        bk: 64,
        threads: 384,
        smem: 1024 + stages * stage_bytes + 2 * 64 * 128 * 2 + 2 * stages * 8,
        file: 5,
    }
}
/// 128x256x64, 4 stages.
pub const X256: Tile = tma_tile("x256", 256, 4);
/// 128x128x64, 6 stages: twice the tiles of `x256`, for shapes whose last wave of 128x256 tiles would leave SMs
/// idle.
pub const X128: Tile = tma_tile("x128", 128, 6);
/// 128x64x64, 8 stages: GEMMs 64 wide (the 64-channel layers), where the wider tiles would multiply zeros.
pub const X64: Tile = tma_tile("x64", 64, 8);
/// Every tile variant; the last six (`w*`, `x*`: wgmma) run only on compute capability 9.0 (see
/// [`tiles_for`]).
pub const TILES: [Tile; 12] = [T128, T64, T256, T128W, T128K64, T256K64, W128, W128S3, W256, X256, X128, X64];
/// The tiles that run on any sm_80+ GPU (mma.sync).
pub const PORTABLE_TILES: [Tile; 6] = [T128, T64, T256, T128W, T128K64, T256K64];

/// Whether the device runs sm_90a code (wgmma): compute capability 9.0 exactly (cached per device).
pub fn has_wgmma(dev: &CudaDevice) -> bool {
    static C: OnceLock<Mutex<HashMap<usize, bool>>> = OnceLock::new();
    let key = dev_key(dev);
    let cache = C.get_or_init(Default::default);
    *cache.lock().unwrap().entry(key).or_insert_with(|| {
        let ctx = dev.cuda_stream().context().clone();
        let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        matches!((major, minor), (Ok(9), Ok(0)))
    })
}

/// The tile variants the autotuner may try on `dev`: all of [`TILES`] on compute capability 9.0, else the
/// portable ones.
pub fn tiles_for(dev: &CudaDevice) -> &'static [Tile] {
    if has_wgmma(dev) {
        &TILES
    } else {
        &PORTABLE_TILES
    }
}
const BK: usize = 32;

static FORCED_TILE: Mutex<Option<Tile>> = Mutex::new(None);
static AUTOTUNE: AtomicBool = AtomicBool::new(true);

/// Forces one tile variant for every later launch (`None`: the per-shape choice). Benchmarks and tests only;
/// scalar (unaligned) shapes always run `t64`.
pub fn set_forced_tile(t: Option<Tile>) {
    *FORCED_TILE.lock().unwrap() = t;
}

/// Per-shape autotuning (on by default): the first launch of each (op, shape, dtype) times every tile variant
/// on the real operands (one warm-up and three timed runs each) and keeps the fastest for the process; off, the
/// heuristic of [`choose`] decides.
pub fn set_autotune(on: bool) {
    AUTOTUNE.store(on, Ordering::Relaxed);
}

fn tuned_cache() -> &'static Mutex<HashMap<String, Tile>> {
    static T: OnceLock<Mutex<HashMap<String, Tile>>> = OnceLock::new();
    T.get_or_init(Default::default)
}

static TUNE_FILE: Mutex<Option<std::path::PathBuf>> = Mutex::new(None);

/// Keeps the autotuner's choices on disk: `path` (a tab-separated file of `GPU name, op and shape, tile`) is read
/// now (choices for other GPUs are kept but unused) and every new choice is appended, so a shape is timed once
/// per GPU model, not once per process. A missing file is created on the first append; an unreadable or
/// malformed one is an error naming it. `None`: choices live in memory only.
pub fn set_autotune_cache(path: Option<std::path::PathBuf>) -> std::result::Result<(), String> {
    if let Some(p) = &path {
        match std::fs::read_to_string(p) {
            Ok(text) => {
                let mut cache = tuned_cache().lock().unwrap();
                for (i, line) in text.lines().enumerate() {
                    let f: Vec<&str> = line.split('\t').collect();
                    let tile = match f.as_slice() {
                        [_, _, t] => TILES.iter().find(|x| x.name == *t),
                        _ => None,
                    };
                    match tile {
                        Some(t) => {
                            cache.insert(format!("{}\t{}", f[0], f[1]), *t);
                        }
                        None => {
                            return Err(format!(
                                "autotune cache {}: line {} is not `GPU<TAB>op and shape<TAB>tile` with a known tile",
                                p.display(),
                                i + 1
                            ))
                        }
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("autotune cache {}: {e}", p.display())),
        }
    }
    *TUNE_FILE.lock().unwrap() = path;
    Ok(())
}

/// The device's name (cached per device: the autotune key is built on every launch).
fn gpu_name(dev: &CudaDevice) -> String {
    static C: OnceLock<Mutex<HashMap<usize, String>>> = OnceLock::new();
    let key = dev_key(dev);
    let cache = C.get_or_init(Default::default);
    let mut map = cache.lock().unwrap();
    map.entry(key)
        .or_insert_with(|| {
            dev.cuda_stream().context().name().unwrap_or_else(|_| "unknown GPU".into()).replace('\t', " ")
        })
        .clone()
}

/// Appends one choice to the autotune file (best effort: a failure is reported once and tuning goes on in memory).
fn persist_choice(key: &str, tile: Tile) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let path = TUNE_FILE.lock().unwrap().clone();
    let Some(path) = path else { return };
    let res = (|| -> std::io::Result<()> {
        use std::io::Write;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
        writeln!(f, "{key}\t{}", tile.name)
    })();
    if let Err(e) = res {
        if !WARNED.swap(true, Ordering::Relaxed) {
            eprintln!("warning: autotune cache {}: {e}; choices stay in memory", path.display());
        }
    }
}

/// The autotuner's choices so far: (op and shape, tile name), sorted.
pub fn tuned_choices() -> Vec<(String, &'static str)> {
    let mut v: Vec<_> = tuned_cache().lock().unwrap().iter().map(|(k, t)| (k.clone(), t.name)).collect();
    v.sort();
    v
}

/// Heuristic tile: 64x64 when N is at most 64 (a wider tile would idle half its columns) or when 128x128 blocks
/// cannot give every SM one; otherwise 128x128.
pub fn choose(m: usize, n: usize, sms: usize, split_ok: bool) -> Tile {
    let tiles = |t: Tile| m.div_ceil(t.bm) * n.div_ceil(t.bn);
    if n <= 64 || (m < 128 && split_ok) {
        T64
    } else if split_ok || tiles(T128) >= sms {
        T128
    } else {
        T64
    }
}

/// Split-K for `tile`: enough splits to give the GPU two waves of blocks, at least 8 k-tiles each.
/// Returns (k_split, splits).
pub fn split_k(tile: Tile, m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let blocks = m.div_ceil(tile.bm) * n.div_ceil(tile.bn);
    let want = (2 * sms).div_ceil(blocks.max(1));
    let splits = want.min(k / (8 * tile.bk)).max(1);
    let k_split = k.div_ceil(splits).div_ceil(tile.bk).max(1) * tile.bk;
    (k_split, k.div_ceil(k_split).max(1))
}

/// Picks the tile of a launch: forced, else the only one with scalar loads, else the autotuned or heuristic one.
/// `run(tile)` launches the op with that tile (used to time the candidates).
fn pick<F: FnMut(Tile) -> Result<()>>(
    dev: &CudaDevice,
    key: impl FnOnce() -> String,
    vec: bool,
    candidates: &[Tile],
    heuristic: Tile,
    mut run: F,
) -> Result<Tile> {
    if let Some(t) = *FORCED_TILE.lock().unwrap() {
        if vec {
            return Ok(t);
        }
    }
    if !vec {
        return Ok(T64);
    }
    if !AUTOTUNE.load(Ordering::Relaxed) || candidates.len() < 2 {
        return Ok(heuristic);
    }
    let key = format!("{}\t{}", gpu_name(dev), key());
    if let Some(t) = tuned_cache().lock().unwrap().get(&key) {
        return Ok(*t);
    }
    // Each candidate: one warm-up run, then the GPU time of 5 back-to-back runs between two CUDA events (host
    // wall-clock would add the launch and synchronisation latency, the same for every tile, to kernels of ~30 us).
    let stream = dev.cuda_stream();
    let timing = Some(candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut best = (f64::INFINITY, heuristic);
    for &t in candidates {
        run(t)?;
        let start = stream.record_event(timing).w()?;
        for _ in 0..5 {
            run(t)?;
        }
        let end = stream.record_event(timing).w()?;
        let dt = start.elapsed_ms(&end).w()? as f64;
        if dt < best.0 {
            best = (dt, t);
        }
    }
    persist_choice(&key, best.1);
    tuned_cache().lock().unwrap().insert(key, best.1);
    Ok(best.1)
}

type FuncKey = (usize, &'static str, String);

fn module_cache() -> &'static Mutex<HashMap<(usize, &'static str), Arc<CudaModule>>> {
    static M: OnceLock<Mutex<HashMap<(usize, &'static str), Arc<CudaModule>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

fn func_cache() -> &'static Mutex<HashMap<FuncKey, CudaFunction>> {
    static F: OnceLock<Mutex<HashMap<FuncKey, CudaFunction>>> = OnceLock::new();
    F.get_or_init(Default::default)
}

fn dev_key(dev: &CudaDevice) -> usize {
    Arc::as_ptr(dev.cuda_stream().context()) as usize
}

/// Loads (once per device) `name` from the fatbin `image` of `module`; opts in to `smem` bytes of dynamic
/// shared memory when that is above the 48 KiB default.
fn function(
    dev: &CudaDevice,
    module: &'static str,
    image: &'static [u8],
    name: &str,
    smem: u32,
) -> Result<CudaFunction> {
    let key = (dev_key(dev), module, name.to_string());
    if let Some(f) = func_cache().lock().unwrap().get(&key) {
        return Ok(f.clone());
    }
    let md = {
        let mut mods = module_cache().lock().unwrap();
        match mods.get(&(key.0, module)) {
            Some(m) => m.clone(),
            None => {
                let m = dev.cuda_stream().context().load_module(Ptx::from_binary(image.to_vec())).w()?;
                mods.insert((key.0, module), m.clone());
                m
            }
        }
    };
    let f = md.load_function(name).w()?;
    if smem > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    }
    func_cache().lock().unwrap().insert(key, f.clone());
    Ok(f)
}

/// The FP32 workspace argument of a GEMM launch: `len` floats for split-K partial sums (written in full by the
/// blocks of every k-split before gemm_splitk_reduce reads them), or without split-K the per-device placeholder.
fn splitk_workspace(dev: &CudaDevice, len: Option<usize>) -> Result<Arc<CudaSlice<f32>>> {
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
    let mut map = W.get_or_init(Default::default).lock().unwrap();
    if let Some(w) = map.get(&dev_key(dev)) {
        return Ok(w.clone());
    }
    let w = Arc::new(dev.alloc_zeros::<f32>(1)?);
    map.insert(dev_key(dev), w.clone());
    Ok(w)
}

/// Number of SMs of the device (cached per device).
pub fn sm_count(dev: &CudaDevice) -> Result<usize> {
    static C: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    let key = dev_key(dev);
    let cache = C.get_or_init(Default::default);
    if let Some(v) = cache.lock().unwrap().get(&key) {
        return Ok(*v);
    }
    let v = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()?
        as usize;
    cache.lock().unwrap().insert(key, v);
    Ok(v)
}

/// (module name, fatbin) of the conv / matmul kernels of `tile`'s file.
fn conv_module(tile: Tile) -> (&'static str, &'static [u8]) {
    use crate::cuda::ptx;
    match tile.file {
        2 => ("conv/02_large_tiles", ptx::CONV_02_LARGE_TILES),
        3 => ("conv/03_deep_k", ptx::CONV_03_DEEP_K),
        4 => ("conv/04_wgmma", ptx::CONV_04_WGMMA),
        5 => ("conv/05_tma_wgmma", ptx::CONV_05_TMA_WGMMA),
        _ => ("conv/01_implicit_gemm", ptx::CONV_01_IMPLICIT_GEMM),
    }
}
fn gemm_module(tile: Tile) -> (&'static str, &'static [u8]) {
    use crate::cuda::ptx;
    match tile.file {
        2 => ("gemm/02_large_tiles", ptx::GEMM_02_LARGE_TILES),
        3 => ("gemm/03_deep_k", ptx::GEMM_03_DEEP_K),
        4 => ("gemm/04_wgmma", ptx::GEMM_04_WGMMA),
        5 => ("gemm/05_tma_wgmma", ptx::GEMM_05_TMA_WGMMA),
        _ => ("gemm/01_mma_cp_async", ptx::GEMM_01_MMA_CP_ASYNC),
    }
}

fn conv_function(dev: &CudaDevice, tile: Tile, name: &str) -> Result<CudaFunction> {
    let (m, img) = conv_module(tile);
    function(dev, m, img, name, tile.smem)
}
fn gemm_function(dev: &CudaDevice, tile: Tile, name: &str) -> Result<CudaFunction> {
    let (m, img) = gemm_module(tile);
    function(dev, m, img, name, tile.smem)
}

fn i32_of(v: usize, op: &str, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{op} (cuda): {what} = {v} exceeds i32")))
}

fn suffix(dt: DType, op: &str) -> Result<&'static str> {
    Ok(match dt {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("{op} (cuda): unsupported dtype {other:?} (bf16, f16 only)"),
    })
}

fn contiguous(l: &Layout, op: &str, what: &str) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some((a, b)) if a % 8 == 0 => Ok((a, b)),
        _ => candle_core::bail!("{op} (cuda): {what} must be contiguous and 16-byte aligned, got {l:?}"),
    }
}

fn blocks(tile: Tile, m: usize, n: usize, splits: usize, op: &str) -> Result<LaunchConfig> {
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

fn reduce_cfg(len: usize) -> LaunchConfig {
    let b = len.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (b, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

// ------------------------------------------------------------------------------------------------------------
// The TMA kernels (x256 / x128 / x64: kernels/gemm/05_tma_wgmma.cu, kernels/conv/05_tma_wgmma.cu).

/// Whether `tile` is one of the TMA kernels' tiles.
fn is_tma(tile: Tile) -> bool {
    tile.file == 5
}

/// A CUtensorMap as the kernels take it: 128 opaque bytes by value (`ig::TmaDesc`, a `__grid_constant__`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaDesc([u64; 16]);

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
fn tma_map(ptr: u64, dt: DType, inner: usize, outer: usize, box_outer: u32, op: &str) -> Result<TmaDesc> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let dtype = tma_dtype(dt, op)?;
    if (inner * 2) % 16 != 0 || ptr % 16 != 0 {
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
fn tma_im2col_map(
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
    if c % 64 != 0 || ptr % 16 != 0 || stride == 0 || stride > 8 {
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
fn conv_corners(r: usize, pad: usize) -> ((i32, i32), (i32, i32)) {
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

/// c (m x n, row-major) += the FP32 partial sums ws[splits][m][n] (+ bias), in order: gemm_splitk_reduce.
fn splitk_reduce<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    ws: &CudaSlice<f32>,
    c: &CudaView<T>,
    bias: Option<&CudaView<T>>,
    (m, n, splits): (usize, usize, usize),
    op: &str,
) -> Result<()> {
    let sfx = suffix(T::DTYPE, op)?;
    let r = gemm_function(dev, T64, &format!("gemm_splitk_reduce_{sfx}"))?;
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

/// One launch of a TMA kernel `f` (tile x256, x128 or x64) over the m x n x k problem described by the tensor maps:
/// the persistent grid, split-K through an FP32 workspace and gemm_splitk_reduce (which then adds the bias).
/// `base` carries the convolution geometry (zero for matmuls); c is m x n row-major when `plain_c` (else the
/// kernel places the rows itself, without split-K).
#[allow(clippy::too_many_arguments)]
fn tma_run<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    f: &CudaFunction,
    (ma, mb): (&TmaDesc, &TmaDesc),
    (m, n, k): (usize, usize, usize),
    base: GemmShape,
    c: &CudaView<T>,
    bias: Option<&CudaView<T>>,
    plain_c: bool,
    op: &str,
) -> Result<()> {
    let sms = sm_count(dev)?;
    // Split-K and the TMA store need C to be the plain row-major m x n matrix (not the strided grad-input's
    // scattered rows).
    let (k_split, splits) =
        if plain_c { tma_split(tile, m, n, k, sms) } else { (k.div_ceil(tile.bk).max(1) * tile.bk, 1) };
    let split = splits > 1;
    if split {
        i32_of(splits * m * n, op, "split-K workspace")?;
    }
    let stream = dev.cuda_stream();
    let (pc, gc) = c.device_ptr(&stream);
    // Without split-K the kernel stores a plain C through a tensor map (16-byte rows needed: N % 8 == 0).
    let tma_c = plain_c && !split && n % 8 == 0 && pc % 16 == 0;
    let mc = if tma_c { tma_map(pc, T::DTYPE, n, m, 64, op)? } else { TmaDesc([0; 16]) };
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
    let units = m.div_ceil(tile.bm) * n.div_ceil(tile.bn) * splits;
    let cfg = LaunchConfig {
        grid_dim: (units.min(sms).max(1) as u32, 1, 1),
        block_dim: (tile.threads, 1, 1),
        shared_mem_bytes: tile.smem,
    };
    let ws = splitk_workspace(dev, split.then_some(splits * m * n))?;
    let mut bld = stream.launch_builder(f);
    bld.arg(ma).arg(mb).arg(&mc).arg(c).arg(&*ws);
    match bias {
        Some(v) => bld.arg(v),
        None => bld.arg(c), // never read: has_bias = 0
    };
    bld.arg(&sh);
    // SAFETY: (map A, map B, map C, c, ws, bias, shape) as the x256 / x128 / x64 kernels take them; the maps cover exactly
    // the operands of the m x n x k problem and c (read by the kernel only when tma_c), c holds m*n elements, ws
    // splits*m*n when split.
    unsafe { bld.launch(cfg) }.w()?;
    if split {
        splitk_reduce(dev, &ws, c, bias, (m, n, splits), op)?;
    }
    Ok(())
}

/// C (m x n) = A B in `layout` on a TMA tile, plus `bias` (length n) when given. The operands must be contiguous
/// and 16-byte aligned with rows of a multiple of 8 elements (the `vec` condition of the other kernels).
#[allow(clippy::too_many_arguments)]
fn tma_gemm<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    layout: GemmLayout,
    (m, n, k): (usize, usize, usize),
    a: &CudaView<T>,
    b: &CudaView<T>,
    c: &CudaView<T>,
    bias: Option<&CudaView<T>>,
    op: &str,
) -> Result<()> {
    let sfx = suffix(T::DTYPE, op)?;
    let stream = dev.cuda_stream();
    let (pa, ga) = a.device_ptr(&stream);
    let (pb, gb) = b.device_ptr(&stream);
    let (dt, bn) = (T::DTYPE, tile.bn as u32);
    let (ma, mb, tag) = match layout {
        GemmLayout::Nt => (tma_map(pa, dt, k, m, 128, op)?, tma_map(pb, dt, k, n, bn, op)?, "nt"),
        GemmLayout::Nn => (tma_map(pa, dt, k, m, 128, op)?, tma_map(pb, dt, n, k, 64, op)?, "nn"),
        GemmLayout::Tn => (tma_map(pa, dt, m, k, 64, op)?, tma_map(pb, dt, n, k, 64, op)?, "tn"),
    };
    let f = gemm_function(dev, tile, &format!("gemm_{tag}_{}_vec_{sfx}", tile.name))?;
    tma_run(dev, tile, &f, (&ma, &mb), (m, n, k), GemmShape::default(), c, bias, true, op)?;
    drop((ga, gb));
    Ok(())
}

// ------------------------------------------------------------------------------------------------------------
// Convolution.

/// Geometry of a channels-last convolution: x (n, h, w, c), w (ko, r, r, c), y (n, p, q, ko).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeom {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub ko: usize,
    pub r: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvGeom {
    pub fn p(&self) -> usize {
        (self.h + 2 * self.pad - self.r) / self.stride + 1
    }
    pub fn q(&self) -> usize {
        (self.w + 2 * self.pad - self.r) / self.stride + 1
    }
    /// FLOPs of the forward pass (2 per multiply-add); grad-input and grad-weight cost the same.
    pub fn flops(&self) -> f64 {
        2.0 * (self.n * self.p() * self.q() * self.ko * self.r * self.r * self.c) as f64
    }
    fn shape(&self, op: &str) -> Result<GemmShape> {
        let f = |v: usize, w: &str| i32_of(v, op, w);
        // Every flat index the kernels form from these stays below the largest tensor, checked here.
        f(self.n * self.h * self.w * self.c, "input size")?;
        f(self.n * self.p() * self.q() * self.ko, "output size")?;
        f(self.ko * self.r * self.r * self.c, "weight size")?;
        Ok(GemmShape {
            batch: f(self.n, "n")?,
            h: f(self.h, "h")?,
            w: f(self.w, "w")?,
            c: f(self.c, "c")?,
            ko: f(self.ko, "ko")?,
            r: f(self.r, "r")?,
            s: f(self.r, "s")?,
            p: f(self.p(), "p")?,
            q: f(self.q(), "q")?,
            stride: f(self.stride, "stride")?,
            pad: f(self.pad, "pad")?,
            ..Default::default()
        })
    }
}

/// Whether tile variant `tile` has its own kernel for at least one pass of `g`: all tiles do, except the TMA
/// tiles (`x256`, `x128`, `x64`), which take the passes [`tma_conv_applies`] accepts (a forced TMA tile runs
/// `w256` / `w128` on the others).
pub fn conv_tile_applies(tile: Tile, g: &ConvGeom) -> bool {
    !is_tma(tile) || [ConvPass::Fwd, ConvPass::Dgrad, ConvPass::Wgrad].iter().any(|&p| tma_conv_applies(g, p))
}

/// Whether the TMA kernels run pass `pass` of `g`: the 1x1 stride-1 unpadded convolutions as plain GEMMs;
/// otherwise through im2col tensor maps, which need the im2col source's channels (C; Ko for grad-input) to be a
/// multiple of 64 (a 64-deep k-tile stays within one filter tap); the strided grad-input runs per phase class.
pub fn tma_conv_applies(g: &ConvGeom, pass: ConvPass) -> bool {
    let plain = g.r == 1 && g.stride == 1 && g.pad == 0;
    plain
        || match pass {
            ConvPass::Fwd | ConvPass::Wgrad => g.c % 64 == 0 && g.ko % 8 == 0,
            ConvPass::Dgrad => g.pad < g.r && g.ko % 64 == 0 && g.c % 8 == 0,
        }
}

/// The cp.async wgmma tile a TMA tile falls back to on the passes it does not run.
fn tma_fallback(tile: Tile) -> Tile {
    match tile {
        X256 => W256,
        X128 | X64 => W128,
        t => t,
    }
}

/// One pass of `g` on a TMA tile through im2col tensor maps (kernels/conv/05_tma_wgmma.cu): `a` / `b` are the
/// pass's operands as [`ConvOp`] takes them (Fwd: x, w; Dgrad: dy, w; Wgrad: dy, x), `out` the result. The
/// strided grad-input runs one launch per phase class of `classes` that has taps (`out` is zeroed beforehand
/// when some class has none); `transposed` grad-weight writes dw^T (see [`wgrad_transposed`]).
#[allow(clippy::too_many_arguments)]
fn tma_conv<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    pass: ConvPass,
    g: &ConvGeom,
    classes: &[(usize, GemmShape)],
    transposed: bool,
    a: &CudaView<T>,
    b: &CudaView<T>,
    out: &CudaView<T>,
    op: &str,
) -> Result<()> {
    let sfx = suffix(T::DTYPE, op)?;
    let stream = dev.cuda_stream();
    let (pa, ga) = a.device_ptr(&stream);
    let (pb, gb) = b.device_ptr(&stream);
    let (dt, p, q, rsc) = (T::DTYPE, g.p(), g.q(), g.r * g.r * g.c);
    let x_dims = (g.n, g.h, g.w, g.c);
    let (lo, up) = conv_corners(g.r, g.pad);
    let func = |name: &str| conv_function(dev, tile, &format!("conv_{name}_{}_tma_{sfx}", tile.name));
    let base = g.shape(op)?;
    match pass {
        // y[npq][ko] = im2col(x)[npq][(r, s, c)] . w[ko][(r, s, c)]
        ConvPass::Fwd => {
            let ma = tma_im2col_map(pa, dt, x_dims, lo, up, g.stride, 128, op)?;
            let mb = tma_map(pb, dt, rsc, g.ko, tile.bn as u32, op)?;
            tma_run(dev, tile, &func("fwd")?, (&ma, &mb), (g.n * p * q, g.ko, rsc), base, out, None, true, op)?;
        }
        // dx[nhw][c] = im2col(dy, padding r - 1 - pad)[nhw][(r', s', k)] . w[k][flipped (r', s')][c]
        ConvPass::Dgrad if g.stride == 1 => {
            let (lo, up) = conv_corners(g.r, g.r - 1 - g.pad);
            let ma = tma_im2col_map(pa, dt, (g.n, p, q, g.ko), lo, up, 1, 128, op)?;
            let mb = tma_map(pb, dt, rsc, g.ko, 64, op)?;
            let mnk = (g.n * g.h * g.w, g.c, g.r * g.r * g.ko);
            tma_run(dev, tile, &func("dgrad")?, (&ma, &mb), mnk, base, out, None, true, op)?;
        }
        // Per phase class: dx[(n, hh, ww)][c] = im2col(dy, class corners)[..][(i', j', k)] . w[k][class tap][c],
        // stored to dx pixel (n, hh * stride + ph, ww * stride + pw).
        ConvPass::Dgrad => {
            let mb = tma_map(pb, dt, rsc, g.ko, 64, op)?;
            let f = func("dgrads")?;
            for (m, sh) in classes.iter().filter(|(_, sh)| sh.k > 0) {
                let (tr, ts) = (sh.tr as usize, sh.ts as usize);
                // The class's window corners over dy: hh + (ph + pad - r0) / stride - (tr - 1), walked for mh rows.
                let corner = |ph: i32, r0: i32, t: usize, mh: i32, size: usize| {
                    let lo = (ph + g.pad as i32 - r0) / g.stride as i32 - (t as i32 - 1);
                    (lo, mh - size as i32 + lo)
                };
                let (lh, uh) = corner(sh.ph, sh.r0, tr, sh.mh, p);
                let (lw, uw) = corner(sh.pw, sh.s0, ts, sh.mw, q);
                let ma = tma_im2col_map(pa, dt, (g.n, p, q, g.ko), (lh, lw), (uh, uw), 1, 128, op)?;
                let mnk = (*m, g.c, tr * ts * g.ko);
                tma_run(dev, tile, &f, (&ma, &mb), mnk, *sh, out, None, false, op)?;
            }
        }
        // Transposed (Ko <= 64, see wgrad_transposed): dw^T[(r, s, c)][ko] = im2col(x)^T[..][npq] . dy[npq][ko]
        ConvPass::Wgrad if transposed => {
            let ma = tma_im2col_map(pb, dt, x_dims, lo, up, g.stride, 64, op)?;
            let mb = tma_map(pa, dt, g.ko, g.n * p * q, 64, op)?;
            tma_run(dev, tile, &func("wgradt")?, (&ma, &mb), (rsc, g.ko, g.n * p * q), base, out, None, true, op)?;
        }
        // dw[ko][(r, s, c)] = dy[npq][ko]^T . im2col(x)[npq][(r, s, c)]
        ConvPass::Wgrad => {
            let ma = tma_map(pa, dt, g.ko, g.n * p * q, 64, op)?;
            let mb = tma_im2col_map(pb, dt, x_dims, lo, up, g.stride, 64, op)?;
            tma_run(dev, tile, &func("wgrad")?, (&ma, &mb), (g.ko, rsc, g.n * p * q), base, out, None, true, op)?;
        }
    }
    drop((ga, gb));
    Ok(())
}

// ------------------------------------------------------------------------------------------------------------
// Explicit im2col for very few input channels (the RGB stem): kernels/conv/06_im2col.cu + the TMA GEMM.

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
/// Byte budget of the im2col buffer: the rows go in chunks of whole images that fit (at least one image).
static IM2COL_BUDGET: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1 << 30);

/// Sets the im2col buffer budget in bytes (`None`: the default 1 GiB). Tests use a small one to run the chunked path.
pub fn set_im2col_budget(bytes: Option<usize>) {
    IM2COL_BUDGET.store(bytes.unwrap_or(1 << 30), Ordering::Relaxed);
}

/// Whether a convolution with `c` input channels and `ko` outputs runs through [`im2col_conv`] on `dev`.
fn im2col_applies(dev: &CudaDevice, c: usize, ko: usize) -> bool {
    c > 0 && c < IM2COL_BELOW_C && ko % 8 == 0 && has_wgmma(dev)
}

/// The same test on a tensor about to be convolved (channels-last x, or None off CUDA).
fn im2col_tensor(x: &Tensor, ko: usize) -> bool {
    match (x.device(), x.dim(3)) {
        (candle_core::Device::Cuda(d), Ok(c)) => conv_supported(x) && im2col_applies(d, c, ko),
        _ => false,
    }
}

/// Forward or grad-weight of a convolution with few input channels: the rows (pixels) of im2col(x) are written,
/// a chunk of whole images at a time, to a [rows][K'] buffer (K' = R*S*C rounded up to 8, zero-filled) that a
/// TMA GEMM multiplies. Fwd: a = x, b = w [Ko][R*S*C] -> y [N*P*Q][Ko]. Wgrad: a = dy, b = x -> dw [Ko][R*S*C]
/// (one partial product per chunk, summed in FP32 by sum_rows; one chunk, so no partial rounding, up to the
/// budget: batch 256 of 224 x 224 images for the ResNet stem).
#[allow(clippy::too_many_arguments)]
fn im2col_conv<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
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
    let imgs = (IM2COL_BUDGET.load(Ordering::Relaxed) / (p * q * kp * 2)).clamp(1, g.n);
    let chunks = g.n.div_ceil(imgs);
    let cols = unsafe { dev.alloc::<T>(imgs * p * q * kp)? }; // SAFETY: each chunk's rows are written by im2col first
    let f = |name: &str| function(dev, "conv/06_im2col", crate::cuda::ptx::CONV_06_IM2COL, &format!("{name}_{sfx}"), 0);
    let (im2col, pad_rows, sum_rows) = (f("im2col_nhwc")?, f("pad_rows")?, f("sum_rows")?);
    let tile = if is_tma(tile) { tile } else { X64 };
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
                tma_gemm(dev, tile, GemmLayout::Nt, (rows, g.ko, kp), &cv, &wp.as_view(), &yv, None, op)?;
            }
            Second::Parts(parts) => {
                let dyv = a.slice(m0 * g.ko..(m0 + rows) * g.ko);
                let pv = parts.slice(z * g.ko * kp..(z + 1) * g.ko * kp);
                tma_gemm(dev, tile, GemmLayout::Tn, (g.ko, kp, rows), &dyv, &cv, &pv, None, op)?;
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

/// A pass of a convolution: forward, grad-input, grad-weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvPass {
    Fwd,
    Dgrad,
    Wgrad,
}

/// One pass of a channels-last convolution as a candle op (no backward of its own; [`ConvNhwc`] has the
/// backward of the forward pass). Fwd: (x, w) -> y. Dgrad: (dy, w) -> dx. Wgrad: (dy, x) -> dw.
#[derive(Debug, Clone, Copy)]
struct ConvOp {
    geom: ConvGeom,
    pass: ConvPass,
    /// Grad-weight only: compute dw^T, shape (r, r, c, ko) (see [`wgrad_transposed`]).
    wt: bool,
}

impl ConvOp {
    fn name_of(&self) -> &'static str {
        match self.pass {
            ConvPass::Fwd => "conv2d_nhwc_fwd",
            ConvPass::Dgrad => "conv2d_nhwc_dgrad",
            ConvPass::Wgrad => "conv2d_nhwc_wgrad",
        }
    }

    fn launch<T: CudaDType + DeviceRepr + WithDType + ValidAsZeroBits + 'static>(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let op = self.name_of();
        let g = self.geom;
        let dev = &s1.device;
        let sms = sm_count(dev)?;
        let (a0, a1) = contiguous(l1, op, "first input")?;
        let (b0, b1) = contiguous(l2, op, "second input")?;
        let v1 = s1.as_cuda_slice::<T>()?.slice(a0..a1);
        let v2 = s2.as_cuda_slice::<T>()?.slice(b0..b1);
        let sfx = suffix(T::DTYPE, op)?;
        let base = g.shape(op)?;
        let (p, q) = (g.p(), g.q());
        let stream = dev.cuda_stream();
        let key = || format!("{op} {:?} {sfx}", g);
        // 1x1 stride-1 convolutions are plain GEMMs over channels-last rows (tma_gemm); the TMA tiles run the
        // other passes tma_conv_applies accepts through im2col tensor maps (tma_conv).
        let plain = g.r == 1 && g.stride == 1 && g.pad == 0;
        let tma_ok = tma_conv_applies(&g, self.pass);
        let cands: Vec<Tile> = tiles_for(dev).iter().copied().filter(|&t| !is_tma(t) || tma_ok).collect();
        if self.pass != ConvPass::Dgrad && im2col_applies(dev, g.c, g.ko) {
            // Few input channels (the RGB stem): explicit im2col + the TMA GEMM, on the TMA tiles only.
            let (len, shape) = match self.pass {
                ConvPass::Fwd => (g.n * p * q * g.ko, Shape::from((g.n, p, q, g.ko))),
                _ => (g.ko * g.r * g.r * g.c, Shape::from((g.ko, g.r, g.r, g.c))),
            };
            let out = alloc_out::<T>(dev, len)?;
            let tma: Vec<Tile> = tiles_for(dev).iter().copied().filter(|&t| is_tma(t)).collect();
            let mut run = |tile: Tile| im2col_conv(dev, tile, self.pass, &g, &v1, &v2, &out, op);
            let tile = pick(dev, key, true, &tma, X64, &mut run)?;
            run(tile)?;
            return Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape));
        }
        match self.pass {
            ConvPass::Fwd => {
                let (m, n, k) = (g.n * p * q, g.ko, g.r * g.r * g.c);
                let vec = g.c % 8 == 0;
                let sh = GemmShape {
                    m: i32_of(m, op, "M")?,
                    n: i32_of(n, op, "N")?,
                    k: i32_of(k, op, "K")?,
                    ldb: k as i32,
                    ldc: n as i32,
                    k_split: i32_of(k.div_ceil(BK) * BK, op, "K")?,
                    ..base
                };
                let y = alloc_out::<T>(dev, m * n)?;
                let run = |tile: Tile| -> Result<()> {
                    if is_tma(tile) && tma_ok {
                        if plain {
                            // 1x1, stride 1: y[npq][ko] = x[npq][c] w[ko][c]^T
                            return tma_gemm(dev, tile, GemmLayout::Nt, (m, n, k), &v1, &v2, &y.as_view(), None, op);
                        }
                        return tma_conv(dev, tile, self.pass, &g, &[], false, &v1, &v2, &y.as_view(), op);
                    }
                    let tile = tma_fallback(tile);
                    let name = format!("conv_fwd_{}_{}_{sfx}", tile.name, if vec { "vec" } else { "scalar" });
                    let f = conv_function(dev, tile, &name)?;
                    let mut b = stream.launch_builder(&f);
                    b.arg(&v1).arg(&v2).arg(&y).arg(&sh);
                    // SAFETY: (x, w, y, shape) as conv_fwd_* takes them; x holds n*h*w*c, w ko*r*r*c, y m*n.
                    unsafe { b.launch(blocks(tile, m, n, 1, op)?) }.w()?;
                    Ok(())
                };
                let mut run = run;
                let tile = pick(dev, key, vec, &cands, choose(m, n, sms, false), &mut run)?;
                run(tile)?;
                Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((g.n, p, q, g.ko))))
            }
            ConvPass::Dgrad => {
                if g.c % 8 != 0 || g.ko % 8 != 0 {
                    candle_core::bail!("{op} (cuda): channels {} -> {} must be multiples of 8", g.c, g.ko);
                }
                // One launch per phase class (h % stride, w % stride): see DgradA in igemm.cuh.
                let st = g.stride;
                let mut classes = Vec::new();
                for ph in 0..st.min(g.h) {
                    for pw in 0..st.min(g.w) {
                        let r0 = (ph + g.pad) % st;
                        let s0 = (pw + g.pad) % st;
                        let tr = if r0 < g.r { (g.r - r0).div_ceil(st) } else { 0 };
                        let ts = if s0 < g.r { (g.r - s0).div_ceil(st) } else { 0 };
                        let (mh, mw) = ((g.h - ph).div_ceil(st), (g.w - pw).div_ceil(st));
                        let (m, k) = (g.n * mh * mw, tr * ts * g.ko);
                        let sh = GemmShape {
                            m: i32_of(m, op, "M")?,
                            n: i32_of(g.c, op, "N")?,
                            k: i32_of(k, op, "K")?,
                            ldc: g.c as i32,
                            k_split: i32_of(k.div_ceil(BK).max(1) * BK, op, "K")?,
                            ph: ph as i32,
                            pw: pw as i32,
                            mh: mh as i32,
                            mw: mw as i32,
                            r0: r0 as i32,
                            s0: s0 as i32,
                            tr: tr as i32,
                            ts: ts as i32,
                            ..base
                        };
                        classes.push((m, sh));
                    }
                }
                // Phase classes without taps (a strided 1x1: 3 of 4) are zeros: one memset here, and the TMA
                // path skips them (the other kernels write their zeros too).
                let zero_classes = classes.iter().any(|(_, sh)| sh.k == 0);
                let dx = if zero_classes {
                    dev.alloc_zeros::<T>(g.n * g.h * g.w * g.c)?
                } else {
                    alloc_out::<T>(dev, g.n * g.h * g.w * g.c)?
                };
                let run = |tile: Tile| -> Result<()> {
                    if is_tma(tile) && tma_ok {
                        if plain {
                            // 1x1, stride 1: dx[nhw][c] = dy[nhw][ko] w[ko][c]
                            return tma_gemm(
                                dev,
                                tile,
                                GemmLayout::Nn,
                                (g.n * g.h * g.w, g.c, g.ko),
                                &v1,
                                &v2,
                                &dx.as_view(),
                                None,
                                op,
                            );
                        }
                        return tma_conv(dev, tile, self.pass, &g, &classes, false, &v1, &v2, &dx.as_view(), op);
                    }
                    let tile = tma_fallback(tile);
                    let name = format!("conv_dgrad_{}_vec_{sfx}", tile.name);
                    let f = conv_function(dev, tile, &name)?;
                    for (m, sh) in &classes {
                        let mut b = stream.launch_builder(&f);
                        b.arg(&v1).arg(&v2).arg(&dx).arg(sh);
                        // SAFETY: (dy, w, dx, shape) as conv_dgrad_* takes them; the classes partition dx's rows.
                        unsafe { b.launch(blocks(tile, *m, g.c, 1, op)?) }.w()?;
                    }
                    Ok(())
                };
                let mut run = run;
                let m_class = classes.first().map_or(0, |c| c.0);
                let tile = pick(dev, key, true, &cands, choose(m_class, g.c, sms, false), &mut run)?;
                run(tile)?;
                Ok((CudaStorage::wrap_cuda_slice(dx, dev.clone()), Shape::from((g.n, g.h, g.w, g.c))))
            }
            ConvPass::Wgrad if self.wt => {
                // dw^T[(r, s, c)][ko] = im2col(x)^T . dy, on the TMA tiles only.
                let (m, n, k) = (g.r * g.r * g.c, g.ko, g.n * p * q);
                let dwt = alloc_out::<T>(dev, m * n)?;
                let tma: Vec<Tile> = tiles_for(dev).iter().copied().filter(|&t| is_tma(t)).collect();
                let mut run = |tile: Tile| -> Result<()> {
                    let tile = if is_tma(tile) { tile } else { X64 };
                    if plain {
                        // 1x1, stride 1: dw^T[c][ko] = x[npq][c]^T dy[npq][ko]
                        return tma_gemm(dev, tile, GemmLayout::Tn, (m, n, k), &v2, &v1, &dwt.as_view(), None, op);
                    }
                    tma_conv(dev, tile, self.pass, &g, &[], true, &v1, &v2, &dwt.as_view(), op)
                };
                let tile = pick(dev, key, true, &tma, X64, &mut run)?;
                run(tile)?;
                Ok((CudaStorage::wrap_cuda_slice(dwt, dev.clone()), Shape::from((g.r, g.r, g.c, g.ko))))
            }
            ConvPass::Wgrad => {
                let (m, n, k) = (g.ko, g.r * g.r * g.c, g.n * p * q);
                let vec = g.c % 8 == 0 && g.ko % 8 == 0;
                let dw = alloc_out::<T>(dev, m * n)?;
                let run = |tile: Tile| -> Result<()> {
                    if is_tma(tile) && tma_ok {
                        if plain {
                            // 1x1, stride 1: dw[ko][c] = dy[npq][ko]^T x[npq][c]
                            return tma_gemm(dev, tile, GemmLayout::Tn, (m, n, k), &v1, &v2, &dw.as_view(), None, op);
                        }
                        return tma_conv(dev, tile, self.pass, &g, &[], false, &v1, &v2, &dw.as_view(), op);
                    }
                    let tile = tma_fallback(tile);
                    let (k_split, splits) = split_k(tile, m, n, k, sms);
                    i32_of(splits * m * n, op, "split-K workspace")?;
                    let sh = GemmShape {
                        m: i32_of(m, op, "M")?,
                        n: i32_of(n, op, "N")?,
                        k: i32_of(k, op, "K")?,
                        lda: g.ko as i32,
                        ldc: n as i32,
                        k_split: i32_of(k_split, op, "k_split")?,
                        ..base
                    };
                    let name = format!("conv_wgrad_{}_{}_{sfx}", tile.name, if vec { "vec" } else { "scalar" });
                    let f = conv_function(dev, tile, &name)?;
                    // SAFETY: every (z, row < M, col < N) element is written by the block that owns its tile.
                    let ws = unsafe { dev.alloc::<f32>(splits * m * n)? };
                    let mut b = stream.launch_builder(&f);
                    b.arg(&v1).arg(&v2).arg(&ws).arg(&sh);
                    // SAFETY: (dy, x, ws, shape) as conv_wgrad_* takes them; ws holds splits*m*n floats.
                    unsafe { b.launch(blocks(tile, m, n, splits, op)?) }.w()?;
                    let r = conv_function(dev, T64, &format!("conv_splitk_reduce_{sfx}"))?;
                    let mut b = stream.launch_builder(&r);
                    let (mn, sp) = (i32_of(m * n, op, "M*N")?, splits as i32);
                    b.arg(&ws).arg(&dw).arg(&mn).arg(&sp);
                    // SAFETY: (ws, out, mn, splits) as conv_splitk_reduce_* takes them.
                    unsafe { b.launch(reduce_cfg(m * n)) }.w()?;
                    Ok(())
                };
                let mut run = run;
                let tile = pick(dev, key, vec, &cands, choose(m, n, sms, true), &mut run)?;
                run(tile)?;
                Ok((CudaStorage::wrap_cuda_slice(dw, dev.clone()), Shape::from((g.ko, g.r, g.r, g.c))))
            }
        }
    }
}

impl CustomOp2 for ConvOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA only (the CPU path is conv2d_nhwc_reference)", self.name_of())
    }
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        if s1.dtype() != s2.dtype() {
            candle_core::bail!("{} (cuda): operands are {:?} and {:?}", self.name_of(), s1.dtype(), s2.dtype());
        }
        match s1.dtype() {
            DType::BF16 => self.launch::<bf16>(s1, l1, s2, l2),
            DType::F16 => self.launch::<f16>(s1, l1, s2, l2),
            other => candle_core::bail!("{} (cuda): unsupported dtype {other:?} (bf16, f16 only)", self.name_of()),
        }
    }
}

/// The differentiable forward op: (x, w) -> y, backward through [`conv_nhwc_dgrad`] and [`conv_nhwc_wgrad`].
#[derive(Debug, Clone, Copy)]
struct ConvNhwc {
    geom: ConvGeom,
}

impl CustomOp2 for ConvNhwc {
    fn name(&self) -> &'static str {
        "conv2d_nhwc"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        ConvOp { geom: self.geom, pass: ConvPass::Fwd, wt: false }.cpu_fwd(s1, l1, s2, l2)
    }
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        ConvOp { geom: self.geom, pass: ConvPass::Fwd, wt: false }.cuda_fwd(s1, l1, s2, l2)
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = aligned(&dy.to_dtype(x.dtype())?)?;
        let dx = if x.track_op() { Some(dgrad_geom(&dy, w, self.geom)?) } else { None };
        let dw = if w.track_op() { Some(wgrad_geom(&dy, x, self.geom)?) } else { None };
        Ok((dx, dw))
    }
}

/// `t` contiguous and starting on a 16-byte boundary (what the vectorised loads need).
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    if t.layout().start_offset() % 8 == 0 {
        Ok(t)
    } else {
        t.copy()
    }
}

fn geom_of(x: &Tensor, w: &Tensor, stride: usize, pad: usize) -> Result<ConvGeom> {
    let (n, h, wd, c) = x.dims4()?;
    let (ko, r, _, _) = w.dims4()?;
    Ok(ConvGeom { n, h, w: wd, c, ko, r, stride, pad })
}

fn dgrad_geom(dy: &Tensor, w: &Tensor, g: ConvGeom) -> Result<Tensor> {
    if g.c % 8 != 0 || g.ko % 8 != 0 {
        // Channel counts the vectorised kernel cannot take (the 3-channel stem, whose input needs no gradient
        // in a model): candle's grad-input through permutes.
        let dyn_ = dy.permute((0, 3, 1, 2))?.contiguous()?;
        let wn = w.permute((0, 3, 1, 2))?.contiguous()?;
        let p = crate::conv::Conv2dParams { stride: g.stride, padding: g.pad };
        return crate::conv::conv2d_grad_input(&dyn_, &wn, p, (g.h, g.w))?.permute((0, 2, 3, 1))?.contiguous();
    }
    dy.apply_op2_no_bwd(&aligned(w)?, &ConvOp { geom: g, pass: ConvPass::Dgrad, wt: false })
}

fn wgrad_geom(dy: &Tensor, x: &Tensor, g: ConvGeom) -> Result<Tensor> {
    let wt = match dy.device() {
        candle_core::Device::Cuda(d) => conv_supported(dy) && wgrad_transposed(d, &g),
        _ => false,
    };
    let dw = dy.apply_op2_no_bwd(&aligned(x)?, &ConvOp { geom: g, pass: ConvPass::Wgrad, wt })?;
    if wt {
        dw.permute((3, 0, 1, 2))?.contiguous() // (r, r, c, ko) -> (ko, r, r, c)
    } else {
        Ok(dw)
    }
}

/// Whether grad-weight runs transposed, dw^T[(r, s, c)][ko] = im2col(x)^T . dy (conv_wgradt_*, or a TN GEMM of x
/// and dy for a 1x1), followed by a transposing copy of the small result: few output channels (Ko <= 64, which
/// would fill half of the TMA tiles' 128 rows) and at least 128 rows of R*S*C, on the TMA path of a wgmma device.
fn wgrad_transposed(dev: &CudaDevice, g: &ConvGeom) -> bool {
    g.ko <= 64
        && g.ko % 8 == 0
        && g.c % 8 == 0
        && g.r * g.r * g.c >= 128
        && tma_conv_applies(g, ConvPass::Wgrad)
        && has_wgmma(dev)
}

/// Whether [`crate::conv2d_nhwc`] runs our kernels for this input (CUDA, BF16/FP16).
pub fn conv_supported(x: &Tensor) -> bool {
    x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16)
}

/// Channel counts below this that are not multiples of 8 (the 3-channel stem) are zero-padded up to the next
/// multiple of 8 so that the vectorised kernels run them: the extra FLOPs cost far less than element-wise loads.
const PAD_CHANNELS_BELOW: usize = 64;

/// Whether the kernels see `x`'s channels (convolved to `ko` outputs) zero-padded to a multiple of 8: a small
/// count that is not one already and does not take the im2col path.
fn pads_channels(x: &Tensor, ko: usize) -> Result<bool> {
    let c = x.dim(3)?;
    Ok(c % 8 != 0 && c < PAD_CHANNELS_BELOW && !im2col_tensor(x, ko))
}

/// `x` (n, h, w, c) and `w` (ko, r, s, c) with c zero-padded to a multiple of 8 when c is small and not one
/// already (same result: the added channels are zero in both); otherwise unchanged.
fn pad_channels(x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    let c = x.dim(3)?;
    if !pads_channels(x, w.dim(0)?)? {
        return Ok((x.clone(), w.clone()));
    }
    let extra = c.next_multiple_of(8) - c;
    Ok((x.pad_with_zeros(3, 0, extra)?, w.pad_with_zeros(3, 0, extra)?))
}

/// Differentiable channels-last convolution on our kernels. x: (n, h, w, c), w: (ko, r, r, c) -> (n, p, q, ko).
/// A small channel count that is not a multiple of 8 runs through explicit im2col + the TMA GEMM on a wgmma device
/// (fewer than 8 channels: the RGB stem), else is zero-padded (autograd narrows the weight gradient back).
pub fn conv2d_nhwc(x: &Tensor, w: &Tensor, stride: usize, pad: usize) -> Result<Tensor> {
    let (x, w) = pad_channels(x, w)?;
    let geom = geom_of(&x, &w, stride, pad)?;
    let x = aligned(&x)?;
    let w = aligned(&w)?;
    x.apply_op2(&w, ConvNhwc { geom })
}

/// Forward pass only (benchmarks, tests); pads small channel counts as [`conv2d_nhwc`] does.
pub fn conv_nhwc_fwd(x: &Tensor, w: &Tensor, stride: usize, pad: usize) -> Result<Tensor> {
    let (x, w) = pad_channels(x, w)?;
    let geom = geom_of(&x, &w, stride, pad)?;
    aligned(&x)?.apply_op2_no_bwd(&aligned(&w)?, &ConvOp { geom, pass: ConvPass::Fwd, wt: false })
}

/// Grad-input: dy (n, p, q, ko), w (ko, r, r, c) -> dx (n, h, w, c) for an input of `in_hw`.
pub fn conv_nhwc_dgrad(dy: &Tensor, w: &Tensor, stride: usize, pad: usize, in_hw: (usize, usize)) -> Result<Tensor> {
    let (n, _, _, ko) = dy.dims4()?;
    let (_, r, _, c) = w.dims4()?;
    let geom = ConvGeom { n, h: in_hw.0, w: in_hw.1, c, ko, r, stride, pad };
    dgrad_geom(&aligned(dy)?, w, geom)
}

/// Grad-weight: dy (n, p, q, ko), x (n, h, w, c) -> dw (ko, r, r, c); small channel counts take the im2col path
/// or are padded for the kernel (as in [`conv2d_nhwc`]) and the result narrowed back.
pub fn conv_nhwc_wgrad(dy: &Tensor, x: &Tensor, r: usize, stride: usize, pad: usize) -> Result<Tensor> {
    let c0 = x.dim(3)?;
    let x =
        if pads_channels(x, dy.dim(3)?)? { x.pad_with_zeros(3, 0, c0.next_multiple_of(8) - c0)? } else { x.clone() };
    let (n, h, w, c) = x.dims4()?;
    let ko = dy.dim(3)?;
    let geom = ConvGeom { n, h, w, c, ko, r, stride, pad };
    let dw = wgrad_geom(&aligned(dy)?, &x, geom)?;
    if c == c0 {
        Ok(dw)
    } else {
        dw.narrow(3, 0, c0)?.contiguous()
    }
}

// ------------------------------------------------------------------------------------------------------------
// Matmul.

/// Operand layouts of the GEMM kernels (row-major storage): see kernels/gemm/01_mma_cp_async.cu.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmLayout {
    /// C[M][N] = A[M][K] B[N][K]^T (+ bias)
    Nt,
    /// C[M][N] = A[M][K] B[K][N]
    Nn,
    /// C[M][N] = A[K][M]^T B[K][N]
    Tn,
}

#[derive(Debug, Clone, Copy)]
struct GemmOp {
    layout: GemmLayout,
    m: usize,
    n: usize,
    k: usize,
}

impl GemmOp {
    fn launch<T: CudaDType + DeviceRepr + WithDType + 'static>(
        &self,
        a: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "matmul";
        let (m, n, k) = (self.m, self.n, self.k);
        let dev = &a.0.device;
        let sms = sm_count(dev)?;
        let (a0, a1) = contiguous(a.1, op, "A")?;
        let (b0, b1) = contiguous(b.1, op, "B")?;
        let va = a.0.as_cuda_slice::<T>()?.slice(a0..a1);
        let vb = b.0.as_cuda_slice::<T>()?.slice(b0..b1);
        let sfx = suffix(T::DTYPE, op)?;
        let (tag, lda, ldb, vec) = match self.layout {
            GemmLayout::Nt => ("nt", k, k, k % 8 == 0),
            GemmLayout::Nn => ("nn", k, n, k % 8 == 0 && n % 8 == 0),
            GemmLayout::Tn => ("tn", m, n, m % 8 == 0 && n % 8 == 0),
        };
        i32_of(m * k, op, "A size")?;
        i32_of(k * n, op, "B size")?;
        i32_of(m * n, op, "C size")?;
        let base = GemmShape {
            m: i32_of(m, op, "M")?,
            n: i32_of(n, op, "N")?,
            k: i32_of(k, op, "K")?,
            lda: lda as i32,
            ldb: ldb as i32,
            ldc: n as i32,
            has_bias: bias.is_some() as i32,
            ..Default::default()
        };
        let c = alloc_out::<T>(dev, m * n)?;
        let bias_view = match bias {
            Some((s, l)) => {
                let (o0, o1) = contiguous(l, op, "bias")?;
                Some(s.as_cuda_slice::<T>()?.slice(o0..o1))
            }
            None => None,
        };
        let stream = dev.cuda_stream();
        let run = |tile: Tile| -> Result<()> {
            if is_tma(tile) {
                return tma_gemm(dev, tile, self.layout, (m, n, k), &va, &vb, &c.as_view(), bias_view.as_ref(), op);
            }
            // Split-K only on the 64x64 tile, when even its blocks cannot fill the GPU.
            let (k_split, splits) = if tile == T64 && m.div_ceil(64) * n.div_ceil(64) < sms {
                split_k(tile, m, n, k, sms)
            } else {
                (k.div_ceil(BK).max(1) * BK, 1)
            };
            let split = splits > 1;
            if split {
                i32_of(splits * m * n, op, "split-K workspace")?;
            }
            let sh = GemmShape { k_split: i32_of(k_split, op, "k_split")?, ..base };
            let name = format!(
                "gemm_{tag}_{}_{}{}_{sfx}",
                tile.name,
                if vec { "vec" } else { "scalar" },
                if split { "_split" } else { "" }
            );
            let f = gemm_function(dev, tile, &name)?;
            let ws = splitk_workspace(dev, split.then_some(splits * m * n))?;
            let mut bld = stream.launch_builder(&f);
            bld.arg(&va).arg(&vb).arg(&c).arg(&*ws);
            match &bias_view {
                Some(v) => bld.arg(v),
                None => bld.arg(&va), // never read: has_bias = 0
            };
            bld.arg(&sh);
            // SAFETY: (a, b, c, ws, bias, shape) as gemm_* takes them; sizes checked above.
            unsafe { bld.launch(blocks(tile, m, n, splits, op)?) }.w()?;
            if split {
                splitk_reduce(dev, &ws, &c.as_view(), bias_view.as_ref(), (m, n, splits), op)?;
            }
            Ok(())
        };
        let mut run = run;
        let key = || format!("matmul {tag} {m}x{n}x{k} {sfx}");
        let tile = pick(dev, key, vec, tiles_for(dev), choose(m, n, sms, false), &mut run)?;
        run(tile)?;
        Ok((CudaStorage::wrap_cuda_slice(c, dev.clone()), Shape::from((m, n))))
    }

    fn dispatch(
        &self,
        a: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        if a.0.dtype() != b.0.dtype() || bias.is_some_and(|(s, _)| s.dtype() != a.0.dtype()) {
            candle_core::bail!("matmul (cuda): operands of different dtypes");
        }
        match a.0.dtype() {
            DType::BF16 => self.launch::<bf16>(a, b, bias),
            DType::F16 => self.launch::<f16>(a, b, bias),
            other => candle_core::bail!("matmul (cuda): unsupported dtype {other:?} (bf16, f16 only)"),
        }
    }
}

impl CustomOp2 for GemmOp {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("our matmul runs on CUDA only (candle's matmul is the CPU path)")
    }
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.dispatch((s1, l1), (s2, l2), None)
    }
}

/// The differentiable Linear op: (x, w, b) -> x w^T + b.
#[derive(Debug, Clone, Copy)]
struct LinearOp {
    m: usize,
    n: usize,
    k: usize,
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("our linear runs on CUDA only (candle's matmul is the CPU path)")
    }
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        GemmOp { layout: GemmLayout::Nt, m: self.m, n: self.n, k: self.k }.dispatch((s1, l1), (s2, l2), Some((s3, l3)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = aligned(&dy.to_dtype(x.dtype())?)?;
        let dx = if x.track_op() { Some(matmul(&dy, w, GemmLayout::Nn)?) } else { None };
        let dw = matmul(&dy, x, GemmLayout::Tn)?;
        let db = dy.to_dtype(DType::F32)?.sum(0)?.to_dtype(b.dtype())?;
        Ok((dx, Some(dw), Some(db)))
    }
}

/// Whether [`crate::linear`] runs our GEMM for this input (CUDA, BF16/FP16).
pub fn gemm_supported(x: &Tensor) -> bool {
    x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16)
}

/// Differentiable x w^T + b on our GEMM (bias fused into the epilogue).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    aligned(x)?.apply_op3(&aligned(w)?, &aligned(b)?, LinearOp { m, n, k })
}

/// C = A B in one of the three layouts (no backward). Nt: a (m, k), b (n, k); Nn: a (m, k), b (k, n);
/// Tn: a (k, m), b (k, n).
pub fn matmul(a: &Tensor, b: &Tensor, layout: GemmLayout) -> Result<Tensor> {
    let (a0, a1) = a.dims2()?;
    let (b0, b1) = b.dims2()?;
    let (m, k, kb, n) = match layout {
        GemmLayout::Nt => (a0, a1, b1, b0),
        GemmLayout::Nn => (a0, a1, b0, b1),
        GemmLayout::Tn => (a1, a0, b0, b1),
    };
    if k != kb {
        candle_core::bail!("matmul ({layout:?}): inner dimensions differ, a {:?} b {:?}", a.dims(), b.dims());
    }
    aligned(a)?.apply_op2_no_bwd(&aligned(b)?, &GemmOp { layout, m, n, k })
}

/// Nt matmul with the fused bias (no backward).
pub fn matmul_bias(a: &Tensor, b: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (m, k) = a.dims2()?;
    let n = b.dim(0)?;
    aligned(a)?.apply_op3_no_bwd(&aligned(b)?, &aligned(bias)?, &LinearOp { m, n, k })
}
