//! Shared helpers of the trainer's integration tests: tiny configs and temporary run folders.
#![allow(dead_code)]

use std::path::PathBuf;
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
