//! Shared helpers of the trainer's integration tests: tiny configs and temporary run folders.
#![allow(dead_code)]

use candle_core::Tensor;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use trainer::config::Config;

/// A tiny run on the generated `shapes` data: ResNet-18, small-image stem, 8x8 inputs.
pub const TINY: &str = r#"
seed = 3
device = "cpu"
[model]
arch = "resnet18"
num_classes = 4
stem = "cifar"
[data]
kind = "shapes"
num_samples = 64
image_size = 8
val_resize = 8
augment = "none"
workers = 2
[train]
epochs = 2
batch_size = 16
[optim]
name = "sgd"
lr = 0.05
momentum = 0.9
weight_decay = 1e-4
[sched]
name = "constant"
[checkpoint]
every_epochs = 1
keep_last = 2
[log]
every_steps = 1
progress = false
"#;

pub fn tiny(overrides: &[&str]) -> Config {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::from_str_with(TINY, "tiny.toml", &o).expect("tiny config")
}

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(
            format!("trainer-test-{}-{tag}-{:?}", std::process::id(), std::thread::current().id())
                .replace(['(', ')'], ""),
        );
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Step losses recorded in a run's metrics.jsonl, in order.
pub fn step_losses(run: &std::path::Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// A test-only stand-in for NCCL's sum all-reduce between ranks that run as threads of one test (the trainer
/// itself uses NCCL): every rank's values are summed on the host in rank order (deterministic) and written back
/// to every rank's tensor. It serves the trainer's gradient all-reduce ([`trainer::dist::Collective`]) and the
/// explicit step's synchronised BatchNorm ([`resnet::step::BnSync`]). A started all-reduce
/// ([`trainer::dist::Collective::start_all_reduce_sum`]) is deferred to the next `join`, the latest NCCL on its
/// own stream may finish it: a trainer that read a bucket before joining would see its own values, not the sum.
pub struct ThreadGroup {
    pub rank: usize,
    pub world: usize,
    shared: Arc<(Mutex<Round>, Condvar)>,
    pending: std::cell::RefCell<Vec<Tensor>>,
}

/// One all-reduce: each rank's values by rank; the sum once all have arrived; how many have taken it.
#[derive(Default)]
struct Round {
    parts: Vec<Option<Vec<f32>>>,
    result: Option<Arc<Vec<f32>>>,
    taken: usize,
}

/// The `world` ranks of one group, rank order.
pub fn thread_group(world: usize) -> Vec<ThreadGroup> {
    let shared = Arc::new((Mutex::new(Round::default()), Condvar::new()));
    (0..world).map(|rank| ThreadGroup { rank, world, shared: shared.clone(), pending: Default::default() }).collect()
}

impl ThreadGroup {
    /// The started all-reduces, in order.
    fn flush(&self) -> anyhow::Result<()> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        pending.iter().try_for_each(|t| self.sum(t))
    }

    fn sum(&self, t: &Tensor) -> anyhow::Result<()> {
        let mine: Vec<f32> = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        let (m, cv) = &*self.shared;
        let mut r = m.lock().unwrap();
        // A rank that skips an all-reduce would leave the others waiting: fail instead of hanging the test.
        let limit = std::time::Duration::from_secs(120);
        let wait = |r, what: &str| {
            let (r, t) = cv.wait_timeout(r, limit).unwrap();
            anyhow::ensure!(!t.timed_out(), "all-reduce: rank {} waited {limit:?} for {what}", self.rank);
            Ok(r)
        };
        // The previous round must be taken by every rank first.
        while r.result.is_some() {
            r = wait(r, "the previous round")?;
        }
        if r.parts.is_empty() {
            r.parts = vec![None; self.world];
        }
        r.parts[self.rank] = Some(mine);
        if r.parts.iter().all(Option::is_some) {
            let parts: Vec<Vec<f32>> = std::mem::take(&mut r.parts).into_iter().flatten().collect();
            let len = parts[0].len();
            anyhow::ensure!(parts.iter().all(|p| p.len() == len), "ranks reduce different lengths");
            let sum = (0..len).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
            r.result = Some(Arc::new(sum));
            cv.notify_all();
        }
        while r.result.is_none() {
            r = wait(r, "the other ranks")?;
        }
        let sum = r.result.clone().unwrap();
        r.taken += 1;
        if r.taken == self.world {
            *r = Round::default();
            cv.notify_all();
        }
        drop(r);
        t.slice_set(&Tensor::from_vec(sum.to_vec(), t.shape(), t.device())?.to_dtype(t.dtype())?, 0, 0)?;
        Ok(())
    }

    /// The trainer's view of this rank.
    pub fn ranks(self) -> trainer::train::Ranks {
        let local_world_size = self.world;
        trainer::train::Ranks { collective: Box::new(self), local_world_size, progress: None }
    }
}

impl trainer::dist::Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, t: &Tensor) -> anyhow::Result<()> {
        self.sum(t)
    }

    fn start_all_reduce_sum(&self, t: &Tensor) -> anyhow::Result<()> {
        self.pending.borrow_mut().push(t.clone());
        Ok(())
    }

    fn join(&self) -> anyhow::Result<()> {
        self.flush()
    }
}

impl resnet::step::BnSync for ThreadGroup {
    fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<()> {
        self.sum(t).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}
