//! `trainer data-bench` and `trainer prepare`: the input pipeline's throughput per stage (decode, augment, collate,
//! host-to-device) and in total, and the conversion of an image folder into packed shards.

use crate::config::{Config, OnCorrupt};
use crate::data::{self, packed, Dataset, Loader, Split};
use crate::train::{loader_options, to_device};
use anyhow::{bail, Context, Result};
#[cfg(feature = "cuda")]
use candle_core::DType;
use candle_core::Device;
use kernels::input::InputLayout;
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Throughput of each stage and of the whole pipeline.
#[derive(Debug, Clone, Serialize)]
pub struct DataBenchResult {
    pub kind: String,
    pub device: String,
    pub images: u64,
    pub batches: usize,
    pub batch_size: usize,
    pub image_size: usize,
    pub workers: usize,
    /// Each stage's rate with all workers on it: images / (stage thread seconds / workers).
    pub decode_img_per_s: f64,
    pub augment_img_per_s: f64,
    pub collate_img_per_s: f64,
    /// CPU device: the normalisation into the network input (on the training thread).
    pub normalize_img_per_s: Option<f64>,
    /// CUDA device: pinned staging + copy + conversion kernel, alone (device synchronised).
    pub h2d_img_per_s: Option<f64>,
    /// The loader's own rate: images per second of its producer's wall time.
    pub loader_img_per_s: f64,
    /// End to end: images per wall second, from the loader's start to the last input tensor ready on the device.
    pub total_img_per_s: f64,
    /// `total_img_per_s` / workers.
    pub per_core_img_per_s: f64,
    /// Images per CPU second of the whole process (Linux /proc/self/stat): the per-core rate whatever else runs on
    /// the machine, the figure to size a machine by.
    pub img_per_cpu_s: Option<f64>,
}

/// CPU seconds (user + system) this process has used, all threads (Linux; None elsewhere).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15 (clock ticks).
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    // USER_HZ is 100 on every Linux architecture's /proc interface.
    Some((utime + stime) / 100.0)
}

fn rate(images: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        images as f64 / secs
    } else {
        0.0
    }
}

/// Runs the training loader (split train, the config's augmentation) over `batches` batches (0: one epoch) and
/// times each stage. `workers` overrides `data.workers`.
pub fn data_bench(cfg: &Config, workers: Option<usize>, batches: usize) -> Result<DataBenchResult> {
    let mut cfg = cfg.clone();
    if let Some(w) = workers {
        cfg.data.workers = w;
        cfg.validate().with_context(|| format!("--workers {w}"))?;
    }
    let device = crate::train::select_device(&cfg.device)?;
    let ds: Arc<dyn Dataset> = data::open(&cfg.data, Split::Train, cfg.seed, cfg.model.num_classes)?;
    if ds.is_empty() {
        bail!("the training set is empty");
    }
    let bs = cfg.train.batch_size;
    let epoch_batches = data::num_batches(ds.len(), bs);
    let want = if batches == 0 { epoch_batches } else { batches };
    // More batches than an epoch holds: the next epochs (new order and augmentation), as training would.
    let epochs = want.div_ceil(epoch_batches);
    let dtype = cfg.amp.dtype.act_dtype();
    // The model's input layout: channels-last under the custom convolutions ("auto" on CUDA in bf16/fp16).
    let cuda = crate::config::parse_device(&cfg.device).is_some_and(|d| d.is_some());
    let channels_last = cfg.kernels.conv.resolve(cuda, dtype) == kernels::ConvImpl::Custom;
    let layout = if channels_last { InputLayout::Nhwc } else { InputLayout::Nchw };
    eprintln!(
        "data-bench: data.kind = \"{}\" ({} images, {} classes), {} transforms at {}, batch {bs}, {want} batches, \
         device {}, input {dtype:?} {layout:?}",
        cfg.data.kind.name(),
        ds.len(),
        ds.num_classes(),
        if matches!(cfg.data.augment, crate::config::Augment::Standard) { "training" } else { "validation" },
        cfg.data.image_size,
        cfg.device
    );
    let t0 = Instant::now();
    let cpu0 = process_cpu_seconds();
    let (mut stats, mut images, mut done) = (data::LoaderStats::default(), 0u64, 0usize);
    let mut normalize_s = 0.0;
    #[allow(unused_mut)]
    let mut h2d = None;
    for epoch in 0..epochs {
        let take = (want - done).min(epoch_batches);
        let loader = Loader::new(ds.clone(), loader_options(&cfg, bs, true, epoch, 0));
        let s = match &device {
            Device::Cpu => {
                let handle = loader.stats_handle();
                let mut last = None;
                for b in loader.take(take) {
                    let b = b?;
                    let t = Instant::now();
                    let x = to_device(&b, &device, dtype, layout)?;
                    normalize_s += t.elapsed().as_secs_f64();
                    images += b.n as u64;
                    last = Some(x);
                }
                drop(last);
                handle.get()
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let handle = loader.stats_handle();
                let mut feed = crate::feed::DeviceFeed::new(loader, &device, bs, ds.image_size(), dtype, layout)?;
                let mut last = None;
                for b in feed.by_ref().take(take) {
                    let b = b?;
                    images += b.n as u64;
                    last = Some(b);
                }
                device.synchronize()?;
                if epoch + 1 == epochs {
                    h2d = Some(h2d_alone(&ds, &cfg, &device, dtype, layout)?);
                }
                drop((last, feed));
                handle.get()
            }
            #[allow(unreachable_patterns)]
            _ => bail!("data-bench: device {} is not supported", cfg.device),
        };
        stats.images += s.images;
        stats.wall_s += s.wall_s;
        stats.decode_s += s.decode_s;
        stats.augment_s += s.augment_s;
        stats.collate_s += s.collate_s;
        stats.workers = s.workers;
        done += take;
    }
    let wall = t0.elapsed().as_secs_f64() - h2d.map_or(0.0, |(_, t)| t);
    // CPU time of the pipeline (the host-to-device micro-benchmark, on CUDA, is not counted).
    let cpu = match (cpu0, process_cpu_seconds()) {
        (Some(a), Some(b)) if b > a && h2d.is_none() => Some(b - a),
        _ => None,
    };
    let w = stats.workers.max(1);
    let per_worker = |secs: f64| rate(stats.images, secs / w as f64);
    let total = rate(images, wall);
    Ok(DataBenchResult {
        kind: cfg.data.kind.name().into(),
        device: cfg.device.clone(),
        images,
        batches: done,
        batch_size: bs,
        image_size: cfg.data.image_size,
        workers: w,
        decode_img_per_s: per_worker(stats.decode_s),
        augment_img_per_s: per_worker(stats.augment_s),
        collate_img_per_s: rate(stats.images, stats.collate_s),
        normalize_img_per_s: device.is_cpu().then(|| rate(images, normalize_s)),
        h2d_img_per_s: h2d.map(|(r, _)| r),
        loader_img_per_s: rate(stats.images, stats.wall_s),
        total_img_per_s: total,
        per_core_img_per_s: total / w as f64,
        img_per_cpu_s: cpu.map(|c| rate(images, c)),
    })
}

/// Host-to-device alone: one batch staged, copied and converted `REPS` times, the device synchronised each time.
/// Returns (img/s, seconds spent).
#[cfg(feature = "cuda")]
fn h2d_alone(
    ds: &Arc<dyn Dataset>,
    cfg: &Config,
    device: &Device,
    dtype: DType,
    layout: InputLayout,
) -> Result<(f64, f64)> {
    const REPS: usize = 20;
    let t_all = Instant::now();
    let mut loader = Loader::new(ds.clone(), loader_options(cfg, cfg.train.batch_size, false, 0, 0));
    let Some(b) = loader.next() else { bail!("no batch") };
    let b = b?;
    drop(loader);
    let Device::Cuda(dev) = device else { bail!("not CUDA") };
    let copy_stream = kernels::input::Slot::copy_stream(dev)?;
    let mut slot = kernels::input::Slot::new(&copy_stream, b.images.len())?;
    let flips = candle_core::Tensor::from_slice(&b.flips, b.n, device)?;
    // The kernel against the CPU reference on this batch (same f32 formula, same rounding: equal values).
    slot.stage(&b.images)?;
    let gpu = slot.convert(dev, &flips, (b.n, b.size, b.size), dtype, layout)?;
    let cpu_src = candle_core::Tensor::from_slice(b.images.as_slice(), (b.n, b.size, b.size, 3), &Device::Cpu)?;
    let cpu_flips = candle_core::Tensor::from_slice(&b.flips, b.n, &Device::Cpu)?;
    let cpu = kernels::input::u8_to_input(&cpu_src, &cpu_flips, dtype, layout)?;
    let as_f32 = |t: &candle_core::Tensor| -> Result<Vec<f32>> {
        Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (g, c) = (as_f32(&gpu)?, as_f32(&cpu)?);
    let worst = g.iter().zip(&c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!(
        "data-bench: u8_to_input on the GPU vs the CPU reference ({} images, {dtype:?} {layout:?}): max |diff| {worst}",
        b.n
    );
    if worst.is_nan() || worst > 1e-6 || g.len() != c.len() {
        bail!(
            "u8_to_input: the CUDA kernel differs from the CPU reference by {worst} ({} vs {} values)",
            g.len(),
            c.len()
        );
    }
    let mut run = || -> Result<()> {
        slot.stage(&b.images)?;
        let x = slot.convert(dev, &flips, (b.n, b.size, b.size), dtype, layout)?;
        device.synchronize()?;
        drop(x);
        Ok(())
    };
    run()?; // warm-up
    let t = Instant::now();
    for _ in 0..REPS {
        run()?;
    }
    let r = rate((REPS * b.n) as u64, t.elapsed().as_secs_f64());
    Ok((r, t_all.elapsed().as_secs_f64()))
}

pub fn print_result(r: &DataBenchResult) {
    let row = |name: &str, v: f64, per_core: Option<f64>| match per_core {
        Some(c) => println!("  {name:<26} {v:>10.0} img/s  {c:>8.0} img/s/core"),
        None => println!("  {name:<26} {v:>10.0} img/s"),
    };
    let w = r.workers as f64;
    println!(
        "{} images in {} batches of {} at {}x{}, {} workers, device {}",
        r.images, r.batches, r.batch_size, r.image_size, r.image_size, r.workers, r.device
    );
    row("decode", r.decode_img_per_s, Some(r.decode_img_per_s / w));
    row("augment (crop + resize)", r.augment_img_per_s, Some(r.augment_img_per_s / w));
    row("collate (producer thread)", r.collate_img_per_s, None);
    if let Some(v) = r.normalize_img_per_s {
        row("normalise (cpu, 1 thread)", v, None);
    }
    if let Some(v) = r.h2d_img_per_s {
        row("host-to-device + convert", v, None);
    }
    row("loader (decode+augment)", r.loader_img_per_s, Some(r.loader_img_per_s / w));
    row("total (end to end)", r.total_img_per_s, Some(r.per_core_img_per_s));
    if let Some(c) = r.img_per_cpu_s {
        println!(
            "  {:<26} {c:>10.0} img per CPU second (all threads; what a core gives without contention)",
            "cpu time"
        );
    }
    let per_core = r.img_per_cpu_s.unwrap_or(r.per_core_img_per_s);
    if per_core > 0.0 {
        let cores = |target: f64| (target / per_core).ceil();
        println!(
            "  at {per_core:.0} img/s per core: 1,000 img/s needs {} cores, 2,000 needs {}, 4,000 needs {}",
            cores(1000.0),
            cores(2000.0),
            cores(4000.0)
        );
    }
}

/// `trainer prepare`: packs data.train_dir (and data.val_dir when set) into `out/train` (and `out/val`).
pub fn prepare(cfg: &Config, out: &Path, opts: &packed::PackOptions) -> Result<Vec<packed::PackReport>> {
    if cfg.data.train_dir.is_empty() {
        bail!("prepare: data.train_dir is empty; set it (and data.val_dir) to the ImageFolder to pack");
    }
    let t = data::Transform::new(&cfg.data, Split::Train)?;
    let mut reports = Vec::new();
    let splits = [(Split::Train, &cfg.data.train_dir), (Split::Val, &cfg.data.val_dir)];
    for (split, dir) in splits {
        if dir.is_empty() && split == Split::Val {
            eprintln!("prepare: data.val_dir is empty; packing the training split only");
            continue;
        }
        let folder = data::ImageFolder::open(&cfg.data.train_dir, &cfg.data.val_dir, split, t.clone())?;
        let dest = out.join(split.name());
        eprintln!(
            "prepare: {} images of {} classes from {dir} -> {}",
            folder.len(),
            folder.num_classes(),
            dest.display()
        );
        let t0 = Instant::now();
        let r = packed::pack_folder(&folder, &dest, opts).with_context(|| format!("packing {dir}"))?;
        eprintln!(
            "prepare: {} images ({} re-encoded at max side {}, {} left out) in {} shard(s), {:.1} MiB, {:.1} s",
            r.samples,
            r.reencoded,
            opts.max_side,
            r.skipped,
            r.shards,
            r.bytes as f64 / (1 << 20) as f64,
            t0.elapsed().as_secs_f64()
        );
        reports.push(r);
    }
    Ok(reports)
}

/// Pack options from the config (`data.pack_max_side`, `data.pack_quality`, `data.workers`, `data.on_corrupt`).
pub fn pack_options(cfg: &Config, shard_mib: u64) -> packed::PackOptions {
    packed::PackOptions {
        max_side: cfg.data.pack_max_side as u32,
        quality: cfg.data.pack_quality.clamp(1, 100) as u8,
        shard_bytes: shard_mib.max(1) << 20,
        workers: cfg.data.workers,
        skip_corrupt: match cfg.data.on_corrupt {
            OnCorrupt::Skip => true,
            OnCorrupt::Error => false,
        },
    }
}
