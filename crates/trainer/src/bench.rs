//! `trainer bench` and `trainer sweep`: timed training steps on synthetic data made on the device, img/s, step time
//! and peak device memory per dtype and batch size; out-of-memory batches are recorded, released, and skipped.

use crate::config::Config;
use crate::train::{build_model, select_device, synthetic_batch, StepRunner};
use anyhow::{Context, Result};
use resnet::Precision;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub arch: String,
    pub dtype: String,
    pub batch_size: usize,
    pub img_per_s: Option<f64>,
    pub step_ms: Option<f64>,
    /// NVML's used device memory (sampled every few milliseconds), its maximum over the whole run (model build,
    /// warm-up and timed steps), less the value right after device selection. CUDA only.
    pub peak_gib: Option<f64>,
    /// Over the timed steps, the allocator's peak of memory in use (`kernels::cuda::MemoryHigh::in_use`: the
    /// default pool's and CUDA graphs' high watermarks), in GiB. CUDA only; compare with PyTorch's
    /// `torch.cuda.max_memory_allocated`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc_gib: Option<f64>,
    /// Over the timed steps, the allocator's peak of memory held (`kernels::cuda::MemoryHigh::reserved`), in
    /// GiB. CUDA only; compare with PyTorch's `torch.cuda.max_memory_reserved`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_gib: Option<f64>,
    pub oom: bool,
    pub error: Option<String>,
    /// Per-phase milliseconds per step (forward, backward, grads, optimizer) when run with `--phases`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases_ms: Option<std::collections::BTreeMap<String, f64>>,
    /// How the timed steps ran with respect to CUDA graphs (`kernels.graph`): replayed from a captured graph,
    /// or eagerly and why. None on the CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph: Option<String>,
    /// On the CPU: the process's peak resident memory over the run (Linux), what `sweep --max` extrapolates to
    /// leave out a batch that would not fit host memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_peak_gib: Option<f64>,
}

/// Samples the GPU's used memory through NVML every few milliseconds and keeps the maximum.
struct PeakMemory {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    base: u64,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl PeakMemory {
    fn start(ordinal: u32) -> Option<Self> {
        let nvml = nvml_wrapper::Nvml::init().ok()?;
        let base = nvml.device_by_index(ordinal).ok()?.memory_info().ok()?.used;
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(base));
        let (s, p) = (stop.clone(), peak.clone());
        let handle = std::thread::spawn(move || {
            let Ok(dev) = nvml.device_by_index(ordinal) else { return };
            while !s.load(Ordering::Relaxed) {
                if let Ok(m) = dev.memory_info() {
                    p.fetch_max(m.used, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        });
        Some(Self { stop, peak, base, handle: Some(handle) })
    }

    fn finish(mut self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        (self.peak.load(Ordering::Relaxed).saturating_sub(self.base)) as f64 / (1u64 << 30) as f64
    }
}

use crate::train::is_oom;

/// Builds the model, runs `warmup` then `steps` timed training steps at batch `bs` in `dtype`.
///
/// With `phases`, the timed steps synchronize the device between phases and the result carries each phase's time.
impl BenchResult {
    /// A row of `cfg`'s architecture at (`dtype`, `bs`) with nothing measured yet.
    fn empty(cfg: &Config, dtype: Precision, bs: usize) -> Self {
        BenchResult {
            arch: cfg.model.arch.name().to_string(),
            dtype: dtype.to_string(),
            batch_size: bs,
            img_per_s: None,
            step_ms: None,
            peak_gib: None,
            alloc_gib: None,
            reserved_gib: None,
            oom: false,
            error: None,
            phases_ms: None,
            graph: None,
            host_peak_gib: None,
        }
    }
}

pub fn bench_one(cfg: &Config, dtype: Precision, bs: usize, warmup: usize, steps: usize, phases: bool) -> BenchResult {
    let mut r = BenchResult::empty(cfg, dtype, bs);
    let mut cfg = cfg.clone();
    cfg.amp.dtype = dtype;
    cfg.train.batch_size = bs;
    let mut phase_ms = None;
    let mut graph_note = None;
    // The allocator's high watermarks over the timed steps (CUDA); None where they could not be read.
    type High = Option<(f64, f64)>;
    let mut run = || -> Result<(f64, Option<f64>, High)> {
        let device = select_device(&cfg.device)?;
        let mem = if device.is_cuda() { PeakMemory::start(cfg.cuda_ordinal()) } else { None };
        let model = build_model(&cfg, &device)?;
        crate::train::check_host_batch(&model, &cfg, bs, &format!("batch size {bs}"), crate::train::HostPass::Train)?;
        // The batch in the format the device feed gives the model (see synthetic_batch).
        let format = crate::train::input_format(&model, dtype);
        let mut runner = StepRunner::new(&cfg, model)?;
        let batch = synthetic_batch(&device, bs, cfg.data.image_size, cfg.model.num_classes, cfg.seed, format)?;
        let lr = cfg.optim.lr;
        for _ in 0..warmup {
            runner.step(std::slice::from_ref(&batch), lr)?;
        }
        device.synchronize()?;
        // The watermarks restart from what the warm-up left in use and held.
        #[cfg(feature = "cuda")]
        let high_reset = match &device {
            candle_core::Device::Cuda(d) => kernels::cuda::reset_memory_high(d).is_ok(),
            _ => false,
        };
        if phases {
            runner.phases = Some(Default::default());
        }
        // As the trainer runs: step k's report is read once step k + 1 is queued.
        let t = Instant::now();
        let replayed_before = runner.graphs.replayed;
        let mut in_flight = None;
        for _ in 0..steps {
            let p = runner.step_async(std::slice::from_ref(&batch), lr)?;
            if let Some(prev) = in_flight.replace(p) {
                runner.resolve(prev)?;
            }
        }
        if let Some(last) = in_flight {
            runner.resolve(last)?;
        }
        device.synchronize()?;
        let secs = t.elapsed().as_secs_f64();
        let high: High = None;
        #[cfg(feature = "cuda")]
        let high = match &device {
            candle_core::Device::Cuda(d) if high_reset => kernels::cuda::memory_high(d).ok().map(|h| {
                let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
                (gib(h.in_use()), gib(h.reserved()))
            }),
            _ => high,
        };
        if device.is_cuda() {
            let g = &runner.graphs;
            let replayed = g.replayed - replayed_before;
            graph_note = Some(match g.policy.disabled() {
                Some(why) => format!("eager (kernels.graph = \"{}\"; the capture failed: {why})", g.choice.name()),
                None if replayed > 0 => {
                    format!("{replayed} of {steps} timed steps replayed from one CUDA graph of {}", g.nodes())
                }
                None => format!("eager (kernels.graph = \"{}\")", g.choice.name()),
            });
        }
        phase_ms = runner.phases.map(|p| {
            p.per_step_ms().iter().map(|(k, v)| (k.to_string(), *v)).collect::<std::collections::BTreeMap<_, _>>()
        });
        drop(runner);
        drop(batch);
        device.synchronize()?;
        Ok((secs, mem.map(PeakMemory::finish), high))
    };
    let on_cpu = crate::config::parse_device(&cfg.device) == Some(None);
    if on_cpu {
        crate::train::host_peak_reset();
    }
    let result = run();
    if on_cpu && result.is_ok() {
        r.host_peak_gib = crate::train::host_peak_bytes().map(|b| b as f64 / (1u64 << 30) as f64);
    }
    // Give the pool's memory back so that the next run's peak starts from an empty pool (and after an OOM).
    #[cfg(feature = "cuda")]
    if let Ok(candle_core::Device::Cuda(d)) = select_device(&cfg.device) {
        let _ = kernels::cuda::release_pool_memory(&d);
    }
    match result {
        Ok((secs, peak, high)) => {
            r.step_ms = Some(1000.0 * secs / steps as f64);
            r.img_per_s = Some((bs * steps) as f64 / secs);
            r.peak_gib = peak;
            r.alloc_gib = high.map(|h| h.0);
            r.reserved_gib = high.map(|h| h.1);
            r.phases_ms = phase_ms;
            r.graph = graph_note;
        }
        Err(e) => {
            r.oom = is_oom(&e);
            r.error = Some(crate::one_line(&e));
        }
    }
    r
}

pub fn print_header() {
    println!(
        "{:<10} {:<5} {:>6} {:>10} {:>9} {:>9} {:>9}",
        "arch", "dtype", "batch", "img/s", "step ms", "peak GiB", "alloc GiB"
    );
}

pub fn print_row(r: &BenchResult) {
    let f = |v: Option<f64>, p: usize| v.map(|v| format!("{v:.p$}")).unwrap_or_else(|| "-".into());
    let status = if r.oom {
        "  out of memory".to_string()
    } else {
        r.error.as_ref().map(|e| format!("  error: {e}")).unwrap_or_default()
    };
    println!(
        "{:<10} {:<5} {:>6} {:>10} {:>9} {:>9} {:>9}{status}",
        r.arch,
        r.dtype,
        r.batch_size,
        f(r.img_per_s, 1),
        f(r.step_ms, 1),
        f(r.peak_gib, 2),
        f(r.alloc_gib, 2)
    );
    if let Some(p) = &r.phases_ms {
        let parts: Vec<String> = ["forward", "backward", "grads", "optimizer"]
            .iter()
            .filter_map(|k| p.get(*k).map(|v| format!("{k} {v:.1}")))
            .collect();
        println!("  phases, ms per step (device synchronized between phases): {}", parts.join(", "));
    }
    if let Some(g) = &r.graph {
        println!("  graph: {g}");
    }
}

/// On the CPU (rows with a host peak), why batch `bs` would not fit host memory, from the straight line through
/// the two largest batches that ran: their peak resident memory against the memory there is now (what the
/// process holds plus what the kernel has available), with 10% to spare. An allocation that fails aborts the
/// process (or the kernel kills it), so such a batch is not tried.
fn host_memory_forecast(rows: &[BenchResult], bs: usize) -> Option<String> {
    let mut ran: Vec<(usize, f64)> = rows.iter().filter_map(|r| Some((r.batch_size, r.host_peak_gib?))).collect();
    ran.sort_by_key(|r| r.0);
    let [.., (b1, p1), (b2, p2)] = ran[..] else { return None };
    if b2 <= b1 || bs <= b2 {
        return None;
    }
    let per = ((p2 - p1) / (b2 - b1) as f64).max(0.0);
    let want = p2 + per * (bs - b2) as f64;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let have = gib(crate::train::host_memory_available()?) + gib(crate::train::host_rss_bytes().unwrap_or(0));
    (want * 1.1 > have).then(|| {
        format!(
            "out of memory (forecast): batch {bs} would take about {want:.1} GiB of host memory (from batches {b1} \
             and {b2}), {have:.1} GiB is there"
        )
    })
}

/// Whether a batch size failed for a reason that a larger batch has too: out of memory, or a tensor beyond the
/// kernels' 32-bit index range (ResNet-152 at batch 3,072: the stem's output has 2.47e9 elements). `sweep --max`
/// bisects below such a batch; any other failure ends the sweep.
pub fn too_large(r: &BenchResult) -> bool {
    r.oom || r.error.as_deref().is_some_and(|e| e.contains("exceeds i32"))
}

/// Batch sizes to try with `--max`: doubling from `start` until one runs out of memory (or past the kernels'
/// index range, [`too_large`]), then bisection to `granularity`. Any other failure ends the sweep there (it says
/// nothing about what fits): the caller reports it.
pub fn sweep_max(
    cfg: &Config,
    dtype: Precision,
    start: usize,
    granularity: usize,
    warmup: usize,
    steps: usize,
    mut on_result: impl FnMut(&BenchResult),
) -> Vec<BenchResult> {
    let mut out = Vec::new();
    let mut good = 0usize;
    let mut bad = None;
    let mut bs = start.max(1);
    let mut run = |bs: usize, out: &mut Vec<BenchResult>| -> bool {
        let r = match host_memory_forecast(out, bs) {
            Some(why) => BenchResult { oom: true, error: Some(why), ..BenchResult::empty(cfg, dtype, bs) },
            None => bench_one(cfg, dtype, bs, warmup, steps, false),
        };
        on_result(&r);
        let ok = r.img_per_s.is_some();
        out.push(r);
        ok
    };
    let failed = |out: &[BenchResult]| out.last().is_some_and(|r| r.error.is_some() && !too_large(r));
    while bad.is_none() {
        if run(bs, &mut out) {
            good = bs;
            bs *= 2;
            if bs > 1 << 16 {
                break;
            }
        } else if failed(&out) {
            return out;
        } else {
            bad = Some(bs);
        }
    }
    if let Some(mut hi) = bad {
        let mut lo = good;
        while hi - lo > granularity.max(1) {
            let mid = (lo + hi) / 2 / granularity.max(1) * granularity.max(1);
            let mid = if mid <= lo { lo + granularity.max(1) } else { mid };
            if mid >= hi {
                break;
            }
            if run(mid, &mut out) {
                lo = mid;
            } else if failed(&out) {
                break;
            } else {
                hi = mid;
            }
        }
    }
    out.sort_by_key(|r| r.batch_size);
    out
}

/// Writes sweep.csv.
pub fn write_csv(rows: &[BenchResult], path: &std::path::Path) -> Result<()> {
    let mut s = String::from("arch,dtype,batch_size,img_per_s,step_ms,peak_gib,alloc_gib,reserved_gib,oom,error\n");
    for r in rows {
        let f = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_default();
        s.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},\"{}\"\n",
            r.arch,
            r.dtype,
            r.batch_size,
            f(r.img_per_s),
            f(r.step_ms),
            f(r.peak_gib),
            f(r.alloc_gib),
            f(r.reserved_gib),
            r.oom,
            r.error.clone().unwrap_or_default().replace('"', "'")
        ));
    }
    std::fs::write(path, s).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(bs: usize, host_peak_gib: Option<f64>) -> BenchResult {
        let empty = BenchResult::empty(&Config::default(), Precision::F32, bs);
        BenchResult { img_per_s: host_peak_gib.map(|_| 1.0), host_peak_gib, ..empty }
    }

    /// Out of memory and a tensor past the kernels' 32-bit indexing bound the sweep; other errors do not.
    #[test]
    fn too_large_batches_bound_the_sweep() {
        let failed = |oom: bool, e: &str| BenchResult { oom, error: Some(e.into()), ..row(3072, None) };
        assert!(too_large(&failed(true, "DriverError(CUDA_ERROR_OUT_OF_MEMORY, 'out of memory')")));
        assert!(too_large(&failed(false, "conv2d_nhwc_fwd (cuda): output size = 2466250752 exceeds i32")));
        assert!(!too_large(&failed(false, "unsupported kernel for this GPU")));
        assert!(!too_large(&row(3072, Some(1.0))));
    }

    /// sweep.csv: the allocator's peaks after NVML's, one column each, empty where not measured (the CPU).
    #[test]
    fn csv_has_the_allocator_peaks() {
        let path = std::env::temp_dir().join(format!("bench-csv-{}.csv", std::process::id()));
        let cuda = BenchResult { peak_gib: Some(3.0), alloc_gib: Some(2.5), reserved_gib: Some(2.75), ..row(8, None) };
        write_csv(&[cuda, row(16, Some(1.0))], &path).unwrap();
        let csv = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "arch,dtype,batch_size,img_per_s,step_ms,peak_gib,alloc_gib,reserved_gib,oom,error");
        assert!(lines[1].ends_with(",,3.000,2.500,2.750,false,\"\""), "{csv}");
        assert!(lines[2].ends_with(",1.000,,,,,false,\"\""), "{csv}");
        assert!(lines.iter().all(|l| l.split(',').count() == 10), "{csv}");
    }

    /// The forecast needs two batches that ran on the host; it speaks only of larger batches, and leaves out one
    /// whose straight-line peak exceeds any machine.
    #[test]
    fn host_memory_forecast_extrapolates_two_runs() {
        let rows = [row(1024, Some(2.0)), row(2048, Some(3.75))];
        assert!(host_memory_forecast(&rows[..1], 1 << 40).is_none());
        assert!(host_memory_forecast(&rows, 1536).is_none());
        assert!(host_memory_forecast(&[row(1024, None), row(2048, None)], 1 << 40).is_none());
        let why = host_memory_forecast(&rows, 1 << 40).expect("a petabyte does not fit");
        assert!(
            why.starts_with("out of memory (forecast): batch 1099511627776") && why.contains("batches 1024 and 2048"),
            "{why}"
        );
    }
}
