//! CUDA input feed: a thread takes the loader's uint8 batches, stages each into one of a few pinned host buffers
//! and queues its copy to the GPU on a copy stream (`kernels::input::Slot`); the training thread turns a staged
//! batch into the model's input with one kernel on the compute stream. Up to `SLOTS - 1` batches are on their way
//! to the GPU while a step runs, so the copies overlap the step and the GPU does not wait on the host. The slots
//! are lent from a process-wide [`Spares`]: a feed that runs dry or is dropped hands them back without waiting for
//! the GPU, and the next feed on the device (the next epoch's, validation's) takes them again.

use crate::data::{HostBatch, Loader, StatsHandle};
use crate::spares::{Lent, Spares};
use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor};
use crossbeam_channel::{bounded, Receiver, Sender};
use kernels::input::{InputLayout, Slot};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

/// Batch buffers in flight: one being converted, the others staged or being staged.
pub const SLOTS: usize = 3;

/// The staging slots of every feed of the process, kept for reuse (see the module's note).
fn spare_slots() -> &'static Arc<Spares<Slot>> {
    static SLOTS_KEPT: OnceLock<Arc<Spares<Slot>>> = OnceLock::new();
    SLOTS_KEPT.get_or_init(Default::default)
}

/// A batch whose pixels are on their way to the GPU.
struct Staged {
    /// None for an empty batch (a data-parallel rank's last batch of an epoch may hold no samples).
    slot: Option<Lent<Slot>>,
    n: usize,
    size: usize,
    flips: Vec<u8>,
    labels: Vec<u32>,
}

/// The loader's batches as device tensors, staged ahead by a feeder thread.
pub struct DeviceFeed {
    rx: Option<Receiver<Result<Staged, String>>>,
    back: Option<Sender<Lent<Slot>>>,
    thread: Option<JoinHandle<()>>,
    device: Device,
    dtype: DType,
    layout: InputLayout,
    stats: StatsHandle,
    /// Feeder thread time spent staging (pinned copy + queueing), nanoseconds.
    stage_nanos: Arc<AtomicU64>,
    staged_images: Arc<AtomicU64>,
}

impl DeviceFeed {
    /// Feeds `loader`'s batches (of at most `max_batch` images of `size`) to `device` as `dtype` in `layout`.
    pub fn new(
        loader: Loader,
        device: &Device,
        max_batch: usize,
        size: usize,
        dtype: DType,
        layout: InputLayout,
    ) -> Result<Self> {
        let Device::Cuda(dev) = device else { return Err(anyhow!("the device feed needs a CUDA device")) };
        let bytes = max_batch * size * size * 3;
        let (back, free) = bounded::<Lent<Slot>>(SLOTS);
        // One copy stream for the slots made here (a kept slot brings its own).
        let mut copy_stream = None;
        for _ in 0..SLOTS {
            let slot = spare_slots().lend(
                |s| s.serves(dev) && s.capacity() >= bytes,
                || match &copy_stream {
                    Some(cs) => Slot::new(cs, bytes),
                    None => Slot::new(copy_stream.insert(Slot::copy_stream(dev)?), bytes),
                },
            )?;
            back.send(slot).map_err(|_| anyhow!("slot channel"))?;
        }
        let (tx, rx) = bounded::<Result<Staged, String>>(SLOTS);
        let stats = loader.stats_handle();
        let stage_nanos = Arc::new(AtomicU64::new(0));
        let staged_images = Arc::new(AtomicU64::new(0));
        let (sn, si) = (stage_nanos.clone(), staged_images.clone());
        let work = move || {
            for batch in loader {
                let b: HostBatch = match batch {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                };
                if b.n == 0 {
                    let HostBatch { size, flips, labels, .. } = b;
                    if tx.send(Ok(Staged { slot: None, n: 0, size, flips, labels })).is_err() {
                        return;
                    }
                    continue;
                }
                // Blocks while every slot is in use: the feed stays at most SLOTS batches ahead.
                let Ok(mut slot) = free.recv() else { return };
                let t0 = Instant::now();
                if let Err(e) = slot.stage(&b.images) {
                    let _ = tx.send(Err(format!("staging a batch for the GPU: {e}")));
                    return;
                }
                sn.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                si.fetch_add(b.n as u64, Ordering::Relaxed);
                let HostBatch { n, size, flips, labels, .. } = b;
                if tx.send(Ok(Staged { slot: Some(slot), n, size, flips, labels })).is_err() {
                    return;
                }
            }
        };
        let thread = std::thread::Builder::new().name("device-feed".into()).spawn(work)?;
        Ok(Self {
            rx: Some(rx),
            back: Some(back),
            thread: Some(thread),
            device: device.clone(),
            dtype,
            layout,
            stats,
            stage_nanos,
            staged_images,
        })
    }

    /// The loader's own rate (see `Loader::images_per_sec`).
    pub fn loader_images_per_sec(&self) -> f64 {
        let s = self.stats.get();
        if s.wall_s > 0.0 {
            s.images as f64 / s.wall_s
        } else {
            0.0
        }
    }

    pub fn loader_stats(&self) -> crate::data::LoaderStats {
        self.stats.get()
    }

    /// Images staged and the feeder's seconds spent staging them (host copy into pinned memory + queueing).
    pub fn staging(&self) -> (u64, f64) {
        (self.staged_images.load(Ordering::Relaxed), self.stage_nanos.load(Ordering::Relaxed) as f64 * 1e-9)
    }
}

impl Iterator for DeviceFeed {
    type Item = Result<crate::train::Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        let staged = self.rx.as_ref()?.recv().ok()?;
        Some((|| {
            let mut s = staged.map_err(|e| anyhow!(e))?;
            let Some(mut slot) = s.slot.take() else {
                return crate::train::Batch::empty(&self.device, s.size, self.dtype, self.layout);
            };
            let Device::Cuda(dev) = &self.device else { return Err(anyhow!("not a CUDA device")) };
            let flips = Tensor::from_slice(&s.flips, s.n, &self.device)?;
            let images = slot.convert(dev, &flips, (s.n, s.size, s.size), self.dtype, self.layout)?;
            let labels = Tensor::from_vec(std::mem::take(&mut s.labels), s.n, &self.device)?;
            // The slot is free for the host once the conversion just queued has run (its event says when). Once the
            // feeder has staged the last batch nothing takes it back: it goes to the spares (no wait for the GPU).
            if let Some(back) = &self.back {
                let _ = back.send(slot);
            }
            Ok(crate::train::Batch { images, labels, n: s.n })
        })())
    }
}

impl Drop for DeviceFeed {
    fn drop(&mut self) {
        // Closing both channels wakes the feeder wherever it waits; the slots go back to the spares, where the
        // next use waits for their GPU work (`Slot::stage`).
        drop(self.back.take());
        drop(self.rx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
