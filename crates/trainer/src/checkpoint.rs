//! Checkpoints: model + optimizer tensors and the trainer state (epoch/step, scheduler, loss scaler, data order,
//! meters) in one safetensors file, written atomically (temporary file, then rename); keep the last N and the best.

use crate::scaler::LossScaler;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "resnet-trainer-checkpoint/1";
const STATE_KEY: &str = "trainer_state";

/// Running sums of the epoch in progress (so a resumed epoch reports what an uninterrupted one would).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochMeters {
    pub loss_sum: f64,
    pub correct: u64,
    pub seen: u64,
    pub steps: u64,
}

/// Everything besides tensors that a resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub format: String,
    pub arch: String,
    pub num_classes: usize,
    /// Epoch in progress (0-based) and micro-batches of it already consumed.
    pub epoch: usize,
    pub batch_in_epoch: usize,
    /// Optimizer steps attempted (the schedule's clock; skipped steps included).
    pub step: usize,
    /// Updates actually applied (AdamW's bias correction).
    pub optimizer_steps: u64,
    pub scaler: LossScaler,
    /// Seed of data order and augmentation; order is a function of (seed, epoch).
    pub seed: u64,
    pub meters: EpochMeters,
    pub best_top1: Option<f64>,
    /// Lines of metrics.jsonl written when this checkpoint was taken (a resume truncates to it).
    pub metrics_lines: usize,
    /// Data-parallel ranks and per-rank batch size of the run that wrote it (absent in older checkpoints: one
    /// rank, the config's batch size): with them a resume at another world size finds its place in the epoch.
    #[serde(default = "one")]
    pub world_size: usize,
    #[serde(default)]
    pub batch_size: usize,
}

fn one() -> usize {
    1
}

/// Bounds of a trainer state no run reaches (a resume refuses a checkpoint beyond them as damaged).
const MAX_EPOCH: usize = 10_000_000;
const MAX_STEP: usize = 1 << 48;
const MAX_BATCH: usize = 1 << 24;
const MAX_WORLD: usize = 1 << 20;

impl TrainState {
    /// The state's own consistency: counts within what a run can reach, updates at most the steps attempted,
    /// a positive loss scale; the resume checks the rest against the data and config.
    pub fn check(&self) -> std::result::Result<(), String> {
        let bad = |what: &str, v: &dyn std::fmt::Display| Err(format!("has {what} = {v}, which no run reaches"));
        if self.epoch > MAX_EPOCH {
            return bad("epoch", &self.epoch);
        }
        if self.step > MAX_STEP {
            return bad("step", &self.step);
        }
        if self.optimizer_steps > self.step as u64 {
            return Err(format!("has {} optimizer updates in {} steps", self.optimizer_steps, self.step));
        }
        if self.world_size == 0 || self.world_size > MAX_WORLD {
            return bad("world_size", &self.world_size);
        }
        if self.batch_size > MAX_BATCH {
            return bad("batch_size", &self.batch_size);
        }
        if self.batch_in_epoch > MAX_STEP {
            return bad("batch_in_epoch", &self.batch_in_epoch);
        }
        if self.metrics_lines > MAX_STEP {
            return bad("metrics_lines", &self.metrics_lines);
        }
        self.scaler.check()
    }
}

pub struct Loaded {
    pub model: HashMap<String, Tensor>,
    pub optim: BTreeMap<String, Tensor>,
    pub state: TrainState,
}

impl Loaded {
    /// The checkpoint at `path` holds the model `cfg` asks for (architecture and class count), as a resume and
    /// `eval` require.
    pub fn check_model(&self, path: &Path, cfg: &crate::config::Config) -> Result<()> {
        if self.state.arch != cfg.model.arch.name() || self.state.num_classes != cfg.model.num_classes {
            bail!(
                "{}: checkpoint is {} with {} classes, the config asks for {} with {}",
                path.display(),
                self.state.arch,
                self.state.num_classes,
                cfg.model.arch,
                cfg.model.num_classes
            );
        }
        Ok(())
    }
}

/// Writes a checkpoint atomically: `path` either holds the previous complete file or the new complete file.
pub fn save(
    path: &Path,
    model: &BTreeMap<String, Tensor>,
    optim: &BTreeMap<String, Tensor>,
    state: &TrainState,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = Vec::with_capacity(model.len() + optim.len());
    for (k, v) in model {
        tensors.push((format!("model.{k}"), v.to_device(&Device::Cpu)?));
    }
    for (k, v) in optim {
        tensors.push((format!("optim.{k}"), v.to_device(&Device::Cpu)?));
    }
    let meta = HashMap::from([(STATE_KEY.to_string(), serde_json::to_string(state)?)]);
    let tmp = path.with_extension("tmp");
    safetensors::serialize_to_file(tensors.iter().map(|(k, v)| (k.as_str(), v)), Some(meta), &tmp)
        .with_context(|| format!("cannot write checkpoint {}", tmp.display()))?;
    // Flush to disk before the rename so a crash cannot leave a renamed but empty file.
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).with_context(|| format!("cannot sync {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot move checkpoint into place at {}", path.display()))?;
    Ok(())
}

/// Reads a checkpoint; a truncated, foreign or unreadable file is an error naming it.
pub fn load(path: &Path) -> Result<Loaded> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read checkpoint {}", path.display()))?;
    let bad = |why: String| anyhow!("{} is not a usable checkpoint: {why}", path.display());
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad(format!("{e:?} (truncated or not safetensors)")))?;
    let state_json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(STATE_KEY))
        .ok_or_else(|| bad("no trainer state in it (model weights alone? use model.init_from for those)".into()))?;
    let state: TrainState =
        serde_json::from_str(state_json).map_err(|e| bad(format!("trainer state unreadable ({e})")))?;
    if state.format != FORMAT {
        bail!("{}: checkpoint format `{}`, this trainer reads `{FORMAT}`", path.display(), state.format);
    }
    state.check().map_err(|why| bad(format!("trainer state {why}")))?;
    let all =
        candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| bad(format!("{e} (truncated?)")))?;
    let mut model = HashMap::new();
    let mut optim = BTreeMap::new();
    for (k, v) in all {
        if let Some(n) = k.strip_prefix("model.") {
            model.insert(n.to_string(), v);
        } else if let Some(n) = k.strip_prefix("optim.") {
            optim.insert(n.to_string(), v);
        } else {
            return Err(bad(format!("unexpected tensor {k}")));
        }
    }
    Ok(Loaded { model, optim, state })
}

/// Whether a safetensors file is a trainer checkpoint (trainer state in its metadata, or `model.` / `optim.`
/// tensors), judged from its header alone; false for plain weights and for files whose header does not parse
/// (their loader names the problem).
pub fn is_checkpoint(path: &Path) -> bool {
    use std::io::Read;
    let header = || -> Option<serde_json::Value> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).ok()?;
        let n = u64::from_le_bytes(len);
        if n > 100 << 20 {
            return None;
        }
        let mut buf = vec![0u8; n as usize];
        f.read_exact(&mut buf).ok()?;
        serde_json::from_slice(&buf).ok()
    };
    let Some(serde_json::Value::Object(h)) = header() else { return false };
    h.get("__metadata__").and_then(|m| m.get(STATE_KEY)).is_some()
        || h.keys().any(|k| k.starts_with("model.") || k.starts_with("optim."))
}

/// The model tensors of a trainer checkpoint (those named `model.*`, the prefix stripped), whatever its trainer
/// state: what `model.init_from` starts from.
pub fn load_model_tensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    let all = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| anyhow!("{} is not a readable safetensors file ({e})", path.display()))?;
    Ok(all.into_iter().filter_map(|(k, v)| k.strip_prefix("model.").map(|n| (n.to_string(), v))).collect())
}

/// Name of a periodic checkpoint; names sort in training order.
pub fn step_name(step: usize) -> String {
    format!("step-{step:09}.safetensors")
}

/// Periodic checkpoints in `dir`, oldest first (`best.safetensors` excluded).
pub fn list(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step-") && n.ends_with(".safetensors"))
        })
        .collect();
    v.sort();
    v
}

pub fn latest(dir: &Path) -> Option<PathBuf> {
    list(dir).pop()
}

/// Name of the best-validation checkpoint in a run's checkpoint directory.
pub const BEST: &str = "best.safetensors";

/// The checkpoint a resume continues from: the newest periodic one, else `best.safetensors` (a run that kept no
/// periodic checkpoints, `checkpoint.every_epochs = 0`, or was stopped before its first one).
pub fn resume_point(dir: &Path) -> Option<PathBuf> {
    latest(dir).or_else(|| Some(dir.join(BEST)).filter(|p| p.is_file()))
}

/// What a new run into `run_dir` would overwrite: a checkpoint (periodic or best) or a finished model
/// (`model.safetensors`); None when the directory holds neither.
pub fn finished_work(run_dir: &Path) -> Option<PathBuf> {
    resume_point(&run_dir.join("checkpoints"))
        .or_else(|| Some(run_dir.join("model.safetensors")).filter(|p| p.is_file()))
}

/// Deletes all but the newest `keep` periodic checkpoints.
pub fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = list(dir);
    let n = all.len().saturating_sub(keep.max(1));
    for p in &all[..n] {
        std::fs::remove_file(p).with_context(|| format!("cannot remove old checkpoint {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> TrainState {
        TrainState {
            format: FORMAT.into(),
            arch: "resnet18".into(),
            num_classes: 10,
            epoch: 2,
            batch_in_epoch: 3,
            step: 40,
            optimizer_steps: 38,
            scaler: LossScaler::new(&crate::config::AmpSection::default(), true),
            seed: 0,
            meters: EpochMeters::default(),
            best_top1: None,
            metrics_lines: 50,
            world_size: 1,
            batch_size: 32,
        }
    }

    /// A trainer state no run reaches is refused by what it names; the checkpoint loader says so with its path.
    #[test]
    fn impossible_states_are_named() {
        assert!(state().check().is_ok());
        let cases: Vec<(TrainState, &str)> = vec![
            (TrainState { epoch: 1_000_000_000_000, ..state() }, "epoch = 1000000000000"),
            (TrainState { step: usize::MAX, ..state() }, "step = "),
            (TrainState { optimizer_steps: 41, ..state() }, "41 optimizer updates in 40 steps"),
            (TrainState { world_size: 0, ..state() }, "world_size = 0"),
            (TrainState { batch_size: usize::MAX, ..state() }, "batch_size = "),
            (TrainState { batch_in_epoch: usize::MAX, ..state() }, "batch_in_epoch = "),
            (TrainState { metrics_lines: usize::MAX, ..state() }, "metrics_lines = "),
            (TrainState { scaler: LossScaler { scale: f64::INFINITY, ..state().scaler }, ..state() }, "loss scaler"),
        ];
        for (s, want) in cases {
            let e = s.check().unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let dir = std::env::temp_dir().join(format!("ckpt-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("odd.safetensors");
        save(&p, &BTreeMap::new(), &BTreeMap::new(), &TrainState { world_size: 0, ..state() }).unwrap();
        let e = load(&p).err().unwrap().to_string();
        assert!(e.contains("odd.safetensors") && e.contains("world_size = 0"), "{e}");
        std::fs::remove_dir_all(dir).ok();
    }
}
