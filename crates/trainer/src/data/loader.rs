//! Batch loader: a producer thread decodes and augments samples on a rayon pool, straight into uint8 HWC batch
//! buffers that are reused across batches, and sends ordered batches ahead.

use super::{mix_seed, DataError, Dataset, Sample, StageNanos};
use crossbeam_channel::{bounded, Receiver};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

/// How much lower than the thread that starts them the loader's workers run ([`lower_priority`]).
pub const WORKER_NICE: i32 = 5;

/// Lowers the calling thread's scheduling priority by [`WORKER_NICE`] (Linux: the nice value is per thread;
/// raising it needs no privilege). The decode workers run at this priority, so that with one worker per core the
/// training thread, which must keep the GPU's queue of kernels full, and the feeder that stages batches for the
/// GPU win the cores whenever they are runnable; with idle cores nothing changes. Elsewhere a no-op.
pub fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: getpriority/setpriority on the calling thread (who = 0) with plain integers.
    unsafe {
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, 0);
        if *libc::__errno_location() == 0 {
            let _ = libc::setpriority(libc::PRIO_PROCESS, 0, (now + WORKER_NICE).min(19));
        }
    }
}

/// Batch buffers waiting to be reused (a batch's buffer comes back here when the batch is dropped).
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    /// Buffers allocated (not reused) so far.
    allocated: AtomicU64,
}

impl BufferPool {
    /// A buffer of exactly `len` bytes (contents unspecified: every byte is overwritten by the samples).
    fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        let reused = self.free.lock().ok().and_then(|mut f| f.pop());
        if reused.as_ref().is_none_or(|b| b.capacity() < len) {
            self.allocated.fetch_add(1, Ordering::Relaxed);
        }
        let mut buf = reused.unwrap_or_default();
        buf.resize(len, 0);
        PooledBuf { buf, pool: Arc::downgrade(self) }
    }
}

/// A batch's pixels; the allocation returns to its loader's pool on drop.
#[derive(Debug, Default)]
pub struct PooledBuf {
    buf: Vec<u8>,
    pool: Weak<BufferPool>,
}

impl PooledBuf {
    pub fn from_vec(buf: Vec<u8>) -> Self {
        Self { buf, pool: Weak::new() }
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

impl Clone for PooledBuf {
    fn clone(&self) -> Self {
        Self::from_vec(self.buf.clone())
    }
}

impl PartialEq for PooledBuf {
    fn eq(&self, other: &Self) -> bool {
        self.buf == other.buf
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            if let Ok(mut free) = pool.free.lock() {
                free.push(std::mem::take(&mut self.buf));
            }
        }
    }
}

/// One batch on the host: `images` is (n, size, size, 3) uint8 RGB, not normalised; `flips[i] != 0` means image i
/// is seen mirrored (applied with the normalisation, `kernels::input`).
#[derive(Clone, Debug, PartialEq)]
pub struct HostBatch {
    pub images: PooledBuf,
    pub flips: Vec<u8>,
    pub labels: Vec<u32>,
    pub n: usize,
    pub size: usize,
}

impl HostBatch {
    /// The normalised network input as f32 in `layout` order (the CPU reference of the GPU conversion).
    pub fn normalized(&self, layout: kernels::input::InputLayout) -> Vec<f32> {
        kernels::input::u8_to_input_ref(&self.images, &self.flips, self.n, self.size, self.size, layout)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoaderOptions {
    pub batch_size: usize,
    pub shuffle: bool,
    /// With `epoch`, fixes the order and every sample's augmentation.
    pub seed: u64,
    pub epoch: usize,
    /// Decoding threads (0: one per core).
    pub workers: usize,
    /// Finished batches buffered ahead of the consumer.
    pub prefetch: usize,
    /// Warn and substitute the next loadable sample instead of failing on an unreadable one.
    pub skip_corrupt: bool,
    /// Batches at the start of the epoch to leave out, undecoded (resuming mid-epoch).
    pub skip_batches: usize,
    /// Data-parallel training: this process's (rank, world size). The epoch order stays the global one (seed,
    /// epoch) and the rank takes its share of every global batch of `batch_size x world` samples
    /// ([`crate::dist::shard`]); the rank's last batch may be short or empty. None: the whole epoch.
    pub shard: Option<(usize, usize)>,
}

/// Number of batches per epoch: the last partial batch is kept.
pub fn num_batches(len: usize, batch_size: usize) -> usize {
    len.div_ceil(batch_size.max(1))
}

/// Sample order of an epoch: the identity, or a Fisher-Yates permutation determined by (seed, epoch) alone.
pub fn epoch_order(len: usize, shuffle: bool, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(mix_seed(&[seed, epoch as u64, 0x5348_5546])));
    }
    order
}

/// The augmentation RNG of the sample in slot `index`, independent of threads and batch boundaries.
pub fn sample_rng(seed: u64, epoch: usize, index: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(mix_seed(&[seed, epoch as u64, index as u64, 0x4155_4721]))
}

#[derive(Default)]
struct Stats {
    images: AtomicU64,
    /// Producer wall time building batches.
    nanos: AtomicU64,
    /// Worker thread time per stage, summed over threads.
    decode: AtomicU64,
    augment: AtomicU64,
    /// Producer time outside the parallel part: taking a buffer, gathering labels and flips.
    collate: AtomicU64,
    workers: AtomicU64,
    buffers: AtomicU64,
}

/// What the loader has done so far: images, the producer's wall time and each stage's thread time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoaderStats {
    pub images: u64,
    pub wall_s: f64,
    pub decode_s: f64,
    pub augment_s: f64,
    pub collate_s: f64,
    pub workers: usize,
    /// Batch buffers allocated (the rest were reused).
    pub buffers: u64,
}

type Message = Result<HostBatch, DataError>;

/// Iterator over one epoch's batches, in order. Dropping it stops the producer and joins it.
pub struct Loader {
    rx: Option<Receiver<Message>>,
    producer: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
    num_batches: usize,
    remaining: usize,
    done: bool,
}

impl Loader {
    pub fn new(ds: Arc<dyn Dataset>, opts: LoaderOptions) -> Self {
        let len = ds.len();
        let bs = opts.batch_size.max(1);
        let order = epoch_order(len, opts.shuffle, opts.seed, opts.epoch);
        // Each batch's slots in the epoch order: consecutive chunks, or this rank's share of each global batch.
        let ranges: Vec<(usize, usize)> = match opts.shard {
            Some((rank, world)) if world > 0 && rank < world => {
                (0..crate::dist::shard::steps_per_epoch(len, world, bs))
                    .map(|step| crate::dist::shard::batch_range(len, rank, world, bs, step))
                    .collect()
            }
            _ => (0..num_batches(len, bs)).map(|b| (b * bs, ((b + 1) * bs).min(len))).collect(),
        };
        let num_batches = ranges.len();
        let first = opts.skip_batches.min(num_batches);
        let (tx, rx) = bounded::<Message>(opts.prefetch.min(num_batches - first));
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Stats::default());
        let (stop2, stats2) = (stop.clone(), stats.clone());
        let work = move || {
            let pool = match rayon::ThreadPoolBuilder::new()
                .num_threads(opts.workers)
                .thread_name(|i| format!("data-worker-{i}"))
                .start_handler(|_| lower_priority())
                .build()
            {
                Ok(pool) => pool,
                Err(e) => {
                    let _ =
                        tx.send(Err(DataError::Loader(format!("cannot start {} worker threads: {e}", opts.workers))));
                    return;
                }
            };
            stats2.workers.store(pool.current_num_threads() as u64, Ordering::Relaxed);
            let buffers = Arc::new(BufferPool::default());
            for &(start, end) in &ranges[first..] {
                if stop2.load(Ordering::Relaxed) {
                    return;
                }
                let slots = &order[start..end];
                let t0 = Instant::now();
                let batch = pool.install(|| load_batch(&*ds, slots, &opts, &stop2, &buffers, &stats2));
                stats2.images.fetch_add(slots.len() as u64, Ordering::Relaxed);
                stats2.nanos.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let failed = batch.is_err();
                if tx.send(batch).is_err() || failed {
                    return;
                }
            }
        };
        let (rx, producer) = match std::thread::Builder::new().name("data-loader".into()).spawn(work) {
            Ok(h) => (Some(rx), Some(h)),
            // The closure (and the sender) is gone: the iterator reports the failure below.
            Err(_) => (None, None),
        };
        Self { rx, producer, stop, stats, num_batches, remaining: num_batches - first, done: false }
    }

    /// Batches of the whole epoch, including skipped ones.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// Images decoded and augmented per second of the producer's batch-building time.
    pub fn images_per_sec(&self) -> f64 {
        let s = self.stats();
        if s.wall_s > 0.0 {
            s.images as f64 / s.wall_s
        } else {
            0.0
        }
    }

    pub fn stats(&self) -> LoaderStats {
        self.stats_handle().get()
    }

    /// A handle that reads the statistics while the loader itself has moved to another thread.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(self.stats.clone())
    }
}

/// Shared view of a loader's statistics.
#[derive(Clone)]
pub struct StatsHandle(Arc<Stats>);

impl StatsHandle {
    pub fn get(&self) -> LoaderStats {
        let st = &self.0;
        let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        LoaderStats {
            images: st.images.load(Ordering::Relaxed),
            wall_s: secs(&st.nanos),
            decode_s: secs(&st.decode),
            augment_s: secs(&st.augment),
            collate_s: secs(&st.collate),
            workers: st.workers.load(Ordering::Relaxed) as usize,
            buffers: st.buffers.load(Ordering::Relaxed),
        }
    }
}

impl Iterator for Loader {
    type Item = Result<HostBatch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done || self.remaining == 0 {
            return None;
        }
        let received = match &self.rx {
            Some(rx) => rx.recv().ok(),
            None => None,
        };
        match received {
            Some(Ok(batch)) => {
                self.remaining -= 1;
                Some(Ok(batch))
            }
            Some(Err(e)) => {
                self.done = true;
                Some(Err(e))
            }
            None => {
                self.done = true;
                let msg =
                    format!("producer thread stopped with {} of {} batches left", self.remaining, self.num_batches);
                Some(Err(DataError::Loader(msg)))
            }
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Unblocks a producer waiting on a full channel: its send fails and it returns.
        drop(self.rx.take());
        if let Some(h) = self.producer.take() {
            let _ = h.join();
        }
    }
}

fn load_batch(
    ds: &dyn Dataset,
    slots: &[usize],
    opts: &LoaderOptions,
    stop: &AtomicBool,
    buffers: &Arc<BufferPool>,
    stats: &Stats,
) -> Message {
    let t0 = Instant::now();
    let size = ds.image_size();
    let per = size * size * 3;
    if per == 0 {
        return Err(DataError::Loader("image size 0".into()));
    }
    let mut images = buffers.take(slots.len() * per);
    let t1 = Instant::now();
    let samples: Vec<Result<(Sample, StageNanos), DataError>> = images
        .par_chunks_mut(per)
        .zip(slots.par_iter())
        .map(|(out, &i)| {
            if stop.load(Ordering::Relaxed) {
                return Err(DataError::Loader("stopped".into()));
            }
            load_sample(ds, i, opts, out)
        })
        .collect();
    let t2 = Instant::now();
    let mut labels = Vec::with_capacity(slots.len());
    let mut flips = Vec::with_capacity(slots.len());
    let (mut decode, mut augment) = (0, 0);
    for sample in samples {
        let (s, t) = sample?;
        labels.push(s.label);
        flips.push(u8::from(s.flip));
        decode += t.decode;
        augment += t.augment;
    }
    stats.decode.fetch_add(decode, Ordering::Relaxed);
    stats.augment.fetch_add(augment, Ordering::Relaxed);
    stats.collate.fetch_add(((t1 - t0) + t2.elapsed()).as_nanos() as u64, Ordering::Relaxed);
    stats.buffers.store(buffers.allocated.load(Ordering::Relaxed), Ordering::Relaxed);
    Ok(HostBatch { images, flips, n: labels.len(), labels, size })
}

/// Sample `index` with the slot's own RNG into `out`; when skipping, the next loadable index (wrapping) stands in.
fn load_sample(
    ds: &dyn Dataset,
    index: usize,
    opts: &LoaderOptions,
    out: &mut [u8],
) -> Result<(Sample, StageNanos), DataError> {
    let len = ds.len();
    let mut first_error = None;
    for k in 0..len {
        let j = (index + k) % len;
        let desc = opts.skip_corrupt.then(|| ds.describe(j));
        if desc.as_ref().is_some_and(|d| is_known_bad(d)) {
            continue;
        }
        let mut t = StageNanos::default();
        match ds.get(j, &mut sample_rng(opts.seed, opts.epoch, index), out, &mut t) {
            Ok(sample) => return Ok((sample, t)),
            Err(e) => match desc {
                Some(desc) => {
                    warn_once(desc, &e);
                    first_error.get_or_insert(e);
                }
                None => return Err(e),
            },
        }
    }
    let first = first_error.map_or_else(|| "all are known to be unreadable".to_string(), |e| e.to_string());
    Err(DataError::Loader(format!("no sample of the {len} in the dataset could be loaded (first error: {first})")))
}

fn bad_samples() -> &'static Mutex<HashSet<String>> {
    static BAD: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    BAD.get_or_init(Default::default)
}

fn is_known_bad(desc: &str) -> bool {
    bad_samples().lock().is_ok_and(|s| s.contains(desc))
}

/// One warning per unreadable sample per process.
fn warn_once(desc: String, e: &DataError) {
    let first = bad_samples().lock().map(|mut s| s.insert(desc.clone())).unwrap_or(true);
    if first {
        let msg = e.to_string();
        let what = if msg.contains(&desc) { String::new() } else { format!("{desc}: ") };
        eprintln!("warning: {what}{msg}; using the next readable sample instead (data.on_corrupt = \"skip\")");
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[test]
    fn workers_run_below_the_training_thread() {
        let get = || unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let (mine, worker) = std::thread::spawn(move || {
            let before = get();
            super::lower_priority();
            (before, get())
        })
        .join()
        .unwrap();
        assert_eq!(worker, (mine + super::WORKER_NICE).min(19));
        // Only that thread: this one keeps its priority.
        assert_eq!(get(), mine);
    }

    use super::*;
    use crate::data::{Shapes, Split, Transform};
    use std::time::Duration;

    /// Sample i is a 2x2 image filled with i, label i, flipped when odd; optionally slow.
    struct Indexed {
        len: usize,
        delay: Duration,
    }

    impl Dataset for Indexed {
        fn len(&self) -> usize {
            self.len
        }
        fn num_classes(&self) -> usize {
            self.len
        }
        fn image_size(&self) -> usize {
            2
        }
        fn get(
            &self,
            index: usize,
            _rng: &mut ChaCha8Rng,
            out: &mut [u8],
            _t: &mut StageNanos,
        ) -> Result<Sample, DataError> {
            std::thread::sleep(self.delay);
            out.fill(index as u8);
            Ok(Sample { label: index as u32, flip: index % 2 == 1 })
        }
        fn describe(&self, index: usize) -> String {
            format!("indexed #{index}")
        }
    }

    fn opts(batch_size: usize, seed: u64, epoch: usize, workers: usize) -> LoaderOptions {
        LoaderOptions {
            batch_size,
            shuffle: true,
            seed,
            epoch,
            workers,
            prefetch: 2,
            skip_corrupt: false,
            skip_batches: 0,
            shard: None,
        }
    }

    fn labels(ds: &Arc<dyn Dataset>, o: LoaderOptions) -> Vec<u32> {
        Loader::new(ds.clone(), o).flat_map(|b| b.unwrap().labels).collect()
    }

    #[test]
    fn every_index_once_and_last_partial_batch_kept() {
        let ds: Arc<dyn Dataset> = Arc::new(Indexed { len: 23, delay: Duration::ZERO });
        let loader = Loader::new(ds.clone(), opts(5, 0, 0, 2));
        assert_eq!(loader.num_batches(), 5);
        let batches: Vec<HostBatch> = loader.map(Result::unwrap).collect();
        assert_eq!(batches.iter().map(|b| b.n).collect::<Vec<_>>(), [5, 5, 5, 5, 3]);
        for b in &batches {
            assert_eq!((b.size, b.images.len(), b.labels.len(), b.flips.len()), (2, b.n * 12, b.n, b.n));
            // Image j of the batch belongs to its label, and so does its flip.
            for (j, &l) in b.labels.iter().enumerate() {
                assert!(b.images[j * 12..(j + 1) * 12].iter().all(|&v| v == l as u8));
                assert_eq!(b.flips[j], (l % 2) as u8);
            }
        }
        let mut seen: Vec<u32> = batches.iter().flat_map(|b| b.labels.clone()).collect();
        assert_ne!(seen, (0..23).collect::<Vec<_>>(), "shuffled");
        seen.sort();
        assert_eq!(seen, (0..23).collect::<Vec<_>>());
        assert_eq!(num_batches(23, 5), 5);
        assert_eq!(num_batches(20, 5), 4);
        assert_eq!(num_batches(0, 5), 0);
        let plain = LoaderOptions { shuffle: false, ..opts(5, 0, 0, 2) };
        assert_eq!(labels(&ds, plain), (0..23).collect::<Vec<_>>());
    }

    #[test]
    fn order_depends_on_seed_and_epoch_only() {
        let ds: Arc<dyn Dataset> = Arc::new(Indexed { len: 40, delay: Duration::ZERO });
        let base = labels(&ds, opts(7, 1, 0, 1));
        assert_eq!(labels(&ds, opts(7, 1, 0, 3)), base);
        assert_eq!(labels(&ds, opts(4, 1, 0, 2)), base, "batch size does not change the order");
        assert_ne!(labels(&ds, opts(7, 1, 1, 1)), base);
        assert_ne!(labels(&ds, opts(7, 2, 0, 1)), base);
    }

    #[test]
    fn augmented_batches_identical_across_worker_counts() {
        // Small (pad + crop) and large (RandomResizedCrop) augmentation.
        for size in [16, 72] {
            let t = Transform { size, val_resize: size, augment: true };
            let ds: Arc<dyn Dataset> = Arc::new(Shapes::new(30, 10, t, 5, Split::Train));
            let run = |workers, bs| -> (Vec<u8>, Vec<u8>) {
                let batches: Vec<HostBatch> =
                    Loader::new(ds.clone(), opts(bs, 3, 2, workers)).map(Result::unwrap).collect();
                (
                    batches.iter().flat_map(|b| b.images.to_vec()).collect(),
                    batches.iter().flat_map(|b| b.flips.clone()).collect(),
                )
            };
            let one = run(1, 8);
            assert_eq!(one.0.len(), 30 * 3 * (size * size) as usize);
            assert_eq!(run(3, 8), one);
            assert_eq!(run(2, 5), one, "nor with the batch size");
            assert!(one.1.contains(&0) && one.1.contains(&1), "some flipped, some not");
            let mut other_epoch = opts(8, 3, 3, 1);
            other_epoch.shuffle = false;
            let mut same_order = opts(8, 3, 2, 1);
            same_order.shuffle = false;
            let imgs = |o| Loader::new(ds.clone(), o).flat_map(|b| b.unwrap().images.to_vec()).collect::<Vec<_>>();
            assert_ne!(imgs(other_epoch), imgs(same_order), "augmentation changes with the epoch");
        }
    }

    #[test]
    fn batch_buffers_are_reused() {
        let ds: Arc<dyn Dataset> = Arc::new(Indexed { len: 64, delay: Duration::ZERO });
        let mut loader = Loader::new(ds, LoaderOptions { prefetch: 1, ..opts(8, 0, 0, 1) });
        // Each batch dropped at once: the producer (one batch queued, one being built) needs at most 3 buffers.
        for _ in 0..8 {
            drop(loader.next().unwrap().unwrap());
        }
        let s = loader.stats();
        assert!(s.images == 64 && s.workers == 1 && s.wall_s > 0.0, "{s:?}");
        assert!((1..=3).contains(&s.buffers), "{} buffers allocated for 8 batches", s.buffers);
    }

    /// Sharded loaders: rank r's batch s is its part of global batch s, the ranks together see every sample of
    /// the single-process order exactly once, in order, and each rank's order depends only on (seed, epoch, rank,
    /// world, batch size); resuming skips the rank's own batches.
    #[test]
    fn shards_split_every_global_batch() {
        let ds: Arc<dyn Dataset> = Arc::new(Indexed { len: 23, delay: Duration::ZERO });
        let single = labels(&ds, opts(8, 5, 1, 2));
        for world in [1, 2, 3, 4] {
            let batches: Vec<Vec<Vec<u32>>> = (0..world)
                .map(|rank| {
                    Loader::new(ds.clone(), LoaderOptions { shard: Some((rank, world)), ..opts(2, 5, 1, 2) })
                        .map(|b| b.unwrap().labels)
                        .collect()
                })
                .collect();
            let steps = 23usize.div_ceil(2 * world);
            assert!(batches.iter().all(|b| b.len() == steps), "world {world}: every rank runs {steps} steps");
            // Step by step, rank by rank: the single-process order.
            let joined: Vec<u32> = (0..steps).flat_map(|s| batches.iter().flat_map(move |b| b[s].clone())).collect();
            assert_eq!(joined, single, "world {world}");
            let again: Vec<u32> =
                Loader::new(ds.clone(), LoaderOptions { shard: Some((world - 1, world)), ..opts(2, 5, 1, 1) })
                    .flat_map(|b| b.unwrap().labels)
                    .collect();
            assert_eq!(again, batches[world - 1].concat(), "world {world}: deterministic for any worker count");
            let resumed: Vec<Vec<u32>> =
                Loader::new(ds.clone(), LoaderOptions { shard: Some((0, world)), skip_batches: 1, ..opts(2, 5, 1, 2) })
                    .map(|b| b.unwrap().labels)
                    .collect();
            assert_eq!(resumed, batches[0][1..], "world {world}: resume skips the rank's own batches");
        }
        // 23 samples, 4 ranks of 5: the last global batch holds 3, so rank 3's last batch is empty (it still
        // takes part in the step).
        let sizes: Vec<usize> =
            Loader::new(ds, LoaderOptions { shard: Some((3, 4)), ..opts(5, 5, 1, 2) }).map(|b| b.unwrap().n).collect();
        assert_eq!(sizes, [5, 0]);
    }

    #[test]
    fn skip_batches_resumes_mid_epoch() {
        let ds: Arc<dyn Dataset> = Arc::new(Indexed { len: 23, delay: Duration::ZERO });
        let full = labels(&ds, opts(5, 9, 4, 2));
        let loader = Loader::new(ds.clone(), LoaderOptions { skip_batches: 3, ..opts(5, 9, 4, 2) });
        assert_eq!(loader.num_batches(), 5);
        let rest: Vec<u32> = loader.flat_map(|b| b.unwrap().labels).collect();
        assert_eq!(rest, full[15..]);
        assert_eq!(Loader::new(ds, LoaderOptions { skip_batches: 9, ..opts(5, 9, 4, 2) }).count(), 0);
    }

    #[test]
    fn dropping_mid_epoch_does_not_hang() {
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let ds: Arc<dyn Dataset> = Arc::new(Indexed { len: 10_000, delay: Duration::from_millis(1) });
            let mut loader = Loader::new(ds, LoaderOptions { prefetch: 1, ..opts(16, 0, 0, 2) });
            assert!(loader.next().unwrap().is_ok());
            assert!(loader.images_per_sec() > 0.0);
            drop(loader);
            let _ = done_tx.send(());
        });
        assert!(done_rx.recv_timeout(Duration::from_secs(10)).is_ok(), "drop hung or panicked");
    }

    struct Flaky;

    impl Dataset for Flaky {
        fn len(&self) -> usize {
            6
        }
        fn num_classes(&self) -> usize {
            6
        }
        fn image_size(&self) -> usize {
            1
        }
        fn get(
            &self,
            index: usize,
            _rng: &mut ChaCha8Rng,
            _out: &mut [u8],
            _t: &mut StageNanos,
        ) -> Result<Sample, DataError> {
            match index {
                2 | 3 => Err(DataError::Decode { path: format!("/flaky/{index}.jpg"), msg: "bad".into() }),
                _ => Ok(Sample { label: index as u32, flip: false }),
            }
        }
        fn describe(&self, index: usize) -> String {
            format!("/flaky/{index}.jpg")
        }
    }

    #[test]
    fn corrupt_samples_error_or_are_replaced_deterministically() {
        let ds: Arc<dyn Dataset> = Arc::new(Flaky);
        let plain = LoaderOptions { shuffle: false, ..opts(4, 0, 0, 2) };
        let first: Vec<_> = Loader::new(ds.clone(), plain.clone()).collect();
        assert_eq!(first.len(), 1);
        let e = first[0].as_ref().unwrap_err().to_string();
        assert_eq!(e, "cannot decode image /flaky/2.jpg: bad");
        let skip = LoaderOptions { skip_corrupt: true, ..plain };
        assert_eq!(labels(&ds, skip.clone()), [0, 1, 4, 4, 4, 5]);
        assert_eq!(labels(&ds, skip), [0, 1, 4, 4, 4, 5]);
    }
}
