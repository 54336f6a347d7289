//! The tile of a launch: forced, the only one with scalar loads, remembered, timed on first use, or the heuristic
//! (the [`Tuning`] the caller's policy carries).

use super::loader::gpu_name;
use crate::policy::Tuning;
use crate::variants::{Tile, T128, T64};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;

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

/// Split-K of the cp.async kernels for `tile`: enough splits to give the GPU two waves of blocks, at least 8
/// k-tiles each. Returns (k_split, splits).
pub fn split_k(tile: Tile, m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let blocks = m.div_ceil(tile.bm) * n.div_ceil(tile.bn);
    let want = (2 * sms).div_ceil(blocks.max(1));
    let splits = want.min(k / (8 * tile.bk)).max(1);
    let k_split = k.div_ceil(splits).div_ceil(tile.bk).max(1) * tile.bk;
    (k_split, k.div_ceil(k_split).max(1))
}

/// GPU milliseconds of 5 back-to-back runs of `run` after one warm-up run, between two CUDA events (host time would
/// add launch and synchronisation latency, the same for every candidate, to kernels of ~30 us).
fn gpu_ms(dev: &CudaDevice, run: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let stream = dev.cuda_stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    run()?;
    let start = stream.record_event(timing).w()?;
    for _ in 0..5 {
        run()?;
    }
    let end = stream.record_event(timing).w()?;
    Ok(start.elapsed_ms(&end).w()? as f64)
}

/// Picks the tile of a launch. `vec`: the operands allow the vectorised kernels (else `t64`, the only tile
/// with scalar loads). Under [`Tuning::Autotune`], the first launch of `key()` on this GPU model times every
/// candidate (one warm-up run, then the GPU time of 5 back-to-back runs between two CUDA events: host time would
/// add launch and synchronisation latency, the same for every tile, to kernels of ~30 us) and remembers the
/// fastest. `run(tile)` launches the op with that tile.
pub fn pick<F: FnMut(Tile) -> Result<()>>(
    dev: &CudaDevice,
    tuning: &Tuning,
    key: impl FnOnce() -> String,
    vec: bool,
    candidates: &[Tile],
    heuristic: Tile,
    mut run: F,
) -> Result<Tile> {
    if !vec {
        return Ok(T64);
    }
    let tuner = match tuning {
        Tuning::Forced(t) => return Ok(*t),
        Tuning::Heuristic => return Ok(heuristic),
        Tuning::Autotune(_) if candidates.len() < 2 => return Ok(heuristic),
        Tuning::Autotune(a) => a,
    };
    let key = format!("{}\t{}", gpu_name(dev), key());
    if let Some(t) = tuner.get(&key) {
        return Ok(t);
    }
    if super::graph::capturing() {
        // Timing waits for the device, which a capture cannot do: the warm-up step tunes every shape first.
        candle_core::bail!("autotune: shape not tuned before the CUDA graph capture ({key})");
    }
    let mut best = (f64::INFINITY, heuristic);
    for &t in candidates {
        let dt = gpu_ms(dev, &mut || run(t))?;
        if dt < best.0 {
            best = (dt, t);
        }
    }
    tuner.insert(key, best.1);
    Ok(best.1)
}

/// The remembered choice of [`epilogue_pays`] for `key`, without timing anything: Some(false) where the pass
/// was faster, None where nothing is remembered yet (or tiles are not autotuned).
pub fn remembered_epilogue(dev: &CudaDevice, tuning: &Tuning, key: impl FnOnce() -> String) -> Option<bool> {
    match tuning {
        Tuning::Autotune(a) => a.epilogue(&format!("{}\tepilogue {}", gpu_name(dev), key())),
        _ => None,
    }
}

/// Whether a convolution's BatchNorm reduction pays in its epilogue (`kernels.bn_stats = "auto"`). Under
/// [`Tuning::Autotune`], the first time `key` is met on this GPU model both ways are timed as [`pick`] times tiles
/// (one warm-up run, then the GPU time of 5 back-to-back runs between two CUDA events): `pass`, the plain
/// convolution followed by the reduction's own pass and finaliser, and `epi`, the convolution with the reduction
/// in its epilogue followed by the finaliser; the faster is remembered (ties: the epilogue). With other tunings
/// (nothing is timed), the epilogue.
pub fn epilogue_pays(
    dev: &CudaDevice,
    tuning: &Tuning,
    key: impl FnOnce() -> String,
    mut pass: impl FnMut() -> Result<()>,
    mut epi: impl FnMut() -> Result<()>,
) -> Result<bool> {
    let Tuning::Autotune(tuner) = tuning else { return Ok(true) };
    let key = format!("{}\tepilogue {}", gpu_name(dev), key());
    if let Some(e) = tuner.epilogue(&key) {
        return Ok(e);
    }
    if super::graph::capturing() {
        candle_core::bail!("autotune: epilogue choice not made before the CUDA graph capture ({key})");
    }
    let (t_pass, t_epi) = (gpu_ms(dev, &mut pass)?, gpu_ms(dev, &mut epi)?);
    let pays = t_epi <= t_pass;
    tuner.insert_epilogue(key, pays);
    Ok(pays)
}
