//! Typed run configuration: nested TOML sections, unknown keys rejected, `--set a.b=value` overrides.
//! Every default lives here, in the `Default` impls.

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Seed of initialisation, data order and augmentation.
    pub seed: u64,
    /// "cpu", "cuda" or "cuda:N".
    pub device: String,
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub optim: OptimSection,
    pub sched: SchedSection,
    pub amp: AmpSection,
    pub checkpoint: CheckpointSection,
    pub log: LogSection,
    pub finetune: FinetuneSection,
    pub kernels: KernelsSection,
    pub telemetry: TelemetrySection,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 0,
            device: "cpu".into(),
            model: Default::default(),
            data: Default::default(),
            train: Default::default(),
            optim: Default::default(),
            sched: Default::default(),
            amp: Default::default(),
            checkpoint: Default::default(),
            log: Default::default(),
            finetune: Default::default(),
            kernels: Default::default(),
            telemetry: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// resnet18 | resnet34 | resnet50 | resnet101 | resnet152
    pub arch: String,
    pub num_classes: usize,
    /// "imagenet" (7x7/2 conv + max-pool) | "cifar" (3x3/1 conv, no pool)
    pub stem: String,
    /// torchvision-format safetensors (or a checkpoint's model.safetensors) to start from; "" for none.
    pub init_from: String,
    pub zero_init_residual: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            arch: "resnet50".into(),
            num_classes: 1000,
            stem: "imagenet".into(),
            init_from: String::new(),
            zero_init_residual: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// "synthetic" | "shapes" (generated, learnable) | "cifar10" | "imagefolder"
    pub kind: String,
    /// cifar10: folder with data_batch_1..5.bin and test_batch.bin
    pub dir: String,
    /// imagefolder: one sub-folder per class
    pub train_dir: String,
    pub val_dir: String,
    /// synthetic / shapes: number of training samples (validation: num_samples / 5)
    pub num_samples: usize,
    pub image_size: usize,
    /// Validation: shorter side resized to this, then center-cropped to image_size.
    pub val_resize: usize,
    /// "none" | "standard"
    pub augment: String,
    /// Loader threads (0: one per core).
    pub workers: usize,
    /// Batches prepared ahead of the training step.
    pub prefetch: usize,
    /// "error" (stop, naming the file) | "skip" (warn, naming the file, and use another sample)
    pub on_corrupt: String,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            kind: "synthetic".into(),
            dir: String::new(),
            train_dir: String::new(),
            val_dir: String::new(),
            num_samples: 1024,
            image_size: 224,
            val_resize: 256,
            augment: "standard".into(),
            workers: 0,
            prefetch: 4,
            on_corrupt: "error".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    pub epochs: usize,
    pub batch_size: usize,
    /// Stop after this many optimizer steps (0: no limit).
    pub max_steps: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Global-norm gradient clipping (0: off).
    pub clip_grad_norm: f64,
    pub label_smoothing: f64,
    /// Validation batch size (0: train.batch_size).
    pub eval_batch_size: usize,
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 32,
            max_steps: 0,
            grad_accum: 1,
            clip_grad_norm: 0.0,
            label_smoothing: 0.0,
            eval_batch_size: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    /// "sgd" | "adamw"
    pub name: String,
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// No weight decay on BatchNorm parameters and biases.
    pub no_decay_bn_bias: bool,
    /// AdamW betas and epsilon.
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

impl Default for OptimSection {
    fn default() -> Self {
        Self {
            name: "sgd".into(),
            lr: 0.1,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 1e-4,
            no_decay_bn_bias: false,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SchedSection {
    /// "cosine" | "step" | "multistep" | "constant"
    pub name: String,
    /// Linear warm-up from warmup_start_factor * lr (fractional epochs allowed).
    pub warmup_epochs: f64,
    pub warmup_start_factor: f64,
    /// step: multiply by gamma every step_epochs epochs.
    pub step_epochs: usize,
    /// multistep: multiply by gamma at each of these epochs.
    pub milestones: Vec<usize>,
    pub gamma: f64,
    /// cosine: final learning rate.
    pub min_lr: f64,
}

impl Default for SchedSection {
    fn default() -> Self {
        Self {
            name: "cosine".into(),
            warmup_epochs: 0.0,
            warmup_start_factor: 0.01,
            step_epochs: 30,
            milestones: vec![],
            gamma: 0.1,
            min_lr: 0.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AmpSection {
    /// "fp32" | "bf16" | "fp16"
    pub dtype: String,
    /// Dynamic loss scaling: "auto" (on for fp16 only) | "on" | "off"
    pub loss_scaling: String,
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// Clamps of the scale (0: none).
    pub min_scale: f64,
    pub max_scale: f64,
}

impl Default for AmpSection {
    fn default() -> Self {
        Self {
            dtype: "fp32".into(),
            loss_scaling: "auto".into(),
            init_scale: 1024.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 0.0,
            max_scale: 0.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save at the end of every N epochs (0: only at the end of training).
    pub every_epochs: usize,
    /// Save every N optimizer steps (0: off).
    pub every_steps: usize,
    /// Keep the newest N step/epoch checkpoints (the best is kept apart).
    pub keep_last: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self { every_epochs: 1, every_steps: 0, keep_last: 3 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// A metrics.jsonl step record every N optimizer steps.
    pub every_steps: usize,
    /// Show the progress bar (off in tests and non-terminals).
    pub progress: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        Self { every_steps: 10, progress: true }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FinetuneSection {
    /// Module-name prefixes whose parameters get no gradient and no optimizer state.
    pub freeze: Vec<String>,
    /// Learning-rate multiplier of the fc head.
    pub head_lr_mult: f64,
    /// BatchNorm layers use and keep their running statistics during training.
    pub bn_frozen: bool,
}

impl Default for FinetuneSection {
    fn default() -> Self {
        Self { freeze: vec![], head_lr_mult: 1.0, bn_frozen: false }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KernelsSection {
    /// "fwdconv" (candle's conv2d forward, backward through forward convs) | "candle" (candle's conv2d and its
    /// conv_transpose2d backward) | "custom" (channels-last implicit-GEMM tensor-core convs on CUDA for bf16/fp16,
    /// candle's conv through permutes on the CPU and in fp32; the whole model then runs NHWC)
    pub conv: String,
    /// "cublas" (candle's built-in matmul) | "custom" (our tensor-core GEMM for `fc` on CUDA in bf16/fp16, with
    /// the bias add fused; candle's matmul otherwise)
    pub matmul: String,
    /// Time every tile variant of the custom kernels on the first launch of each shape and keep the fastest
    /// (false: a fixed heuristic picks the tile)
    pub autotune: bool,
    /// Where autotuned choices persist across runs: "auto" (`$XDG_CACHE_HOME` or `~/.cache`,
    /// `resnet-train/kernels-autotune.tsv`), "off" (memory only), or a file path
    pub autotune_cache: String,
}

impl Default for KernelsSection {
    fn default() -> Self {
        Self { conv: "fwdconv".into(), matmul: "cublas".into(), autotune: true, autotune_cache: "auto".into() }
    }
}

impl KernelsSection {
    /// The autotune file `autotune_cache` names (None for "off", or for "auto" without a home directory).
    pub fn autotune_cache_path(&self) -> Option<std::path::PathBuf> {
        match self.autotune_cache.as_str() {
            "off" => None,
            "auto" => std::env::var_os("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))
                .map(|d| d.join("resnet-train").join("kernels-autotune.tsv")),
            p => Some(std::path::PathBuf::from(p)),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    /// Sample GPU telemetry through NVML (CUDA devices only; missing NVML never stops training).
    pub enabled: bool,
    pub interval_ms: u64,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        Self { enabled: true, interval_ms: 1000 }
    }
}

/// Finds a config: the path as given, else the bare name inside `configs/` (of the working directory, then of
/// the repository this binary was built from).
pub fn resolve_path(name: &str) -> Result<PathBuf> {
    let p = PathBuf::from(name);
    if p.is_file() {
        return Ok(p);
    }
    let mut tried = vec![p.display().to_string()];
    if p.components().count() == 1 {
        for base in [PathBuf::from("configs"), Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")] {
            let c = base.join(name);
            if c.is_file() {
                return Ok(c);
            }
            tried.push(c.display().to_string());
        }
    }
    bail!("config file `{name}` not found (looked at {})", tried.join(", "))
}

/// Parses a device spec: `Some(None)` for "cpu", `Some(Some(n))` for "cuda" (n = 0) or "cuda:n", `None` if invalid.
pub fn parse_device(spec: &str) -> Option<Option<u32>> {
    match spec {
        "cpu" => Some(None),
        "cuda" => Some(Some(0)),
        s => s.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(Some),
    }
}

impl Config {
    /// The CUDA ordinal of `device` (0 for "cpu", which has none).
    pub fn cuda_ordinal(&self) -> u32 {
        parse_device(&self.device).flatten().unwrap_or(0)
    }
}

/// Parses an override value as a TOML value, falling back to a plain string (`resnet18`, `cuda:0`).
fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match doc.parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

/// Applies one `a.b=value` override to a TOML tree; the key must exist in the schema.
fn apply_override(root: &mut toml::Table, schema: &toml::Table, spec: &str) -> Result<()> {
    let (key, raw) = spec.split_once('=').ok_or_else(|| anyhow!("--set `{spec}`: expected key=value"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    let mut sch = schema;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        match sch.get(*part) {
            Some(toml::Value::Table(t)) if !last => sch = t,
            Some(toml::Value::Table(_)) => bail!("--set {key}: `{key}` is a section, not a key"),
            Some(_) if last => {}
            _ => bail!("--set {key}: unknown config key `{key}`"),
        }
    }
    let mut node = root;
    for part in &parts[..parts.len() - 1] {
        node = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .ok_or_else(|| anyhow!("--set {key}: `{part}` is not a section in the config file"))?;
    }
    let mut value = parse_value(raw.trim());
    // A float key given an integer literal (`optim.lr=1`) is still a float.
    if let (Some(toml::Value::Float(_)), toml::Value::Integer(i)) = (lookup(schema, &parts), &value) {
        value = toml::Value::Float(*i as f64);
    }
    node.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn lookup<'a>(t: &'a toml::Table, parts: &[&str]) -> Option<&'a toml::Value> {
    let (first, rest) = parts.split_first()?;
    let v = t.get(*first)?;
    if rest.is_empty() {
        Some(v)
    } else {
        lookup(v.as_table()?, rest)
    }
}

impl Config {
    /// Parses TOML text plus overrides. Errors name the key (and the file, via `origin`).
    pub fn from_str_with(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        let mut table: toml::Table =
            text.parse().map_err(|e: toml::de::Error| anyhow!("{origin}: {}", one_line(&e.to_string())))?;
        let schema = toml::Table::try_from(Config::default()).context("serialising the default config")?;
        // Integers where floats are expected (lr = 1) are accepted in files as well.
        coerce_floats(&mut table, &schema);
        for o in overrides {
            apply_override(&mut table, &schema, o)?;
        }
        let cfg: Config = Config::deserialize(toml::Value::Table(table.clone()))
            .map_err(|e| anyhow!("{origin}: {}", one_line(&e.to_string())))?;
        cfg.validate().with_context(|| origin.to_string())?;
        Ok(cfg)
    }

    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_str_with(&text, &path.display().to_string(), overrides)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot serialise config: {e}"))
    }

    /// Checks values that types alone do not (names from fixed sets, positive sizes).
    pub fn validate(&self) -> Result<()> {
        fn one_of(key: &str, v: &str, allowed: &[&str]) -> Result<()> {
            if allowed.contains(&v) {
                Ok(())
            } else {
                bail!("{key} = \"{v}\" is not one of {}", allowed.join(", "))
            }
        }
        one_of("model.arch", &self.model.arch, &["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"])?;
        one_of("model.stem", &self.model.stem, &["imagenet", "cifar"])?;
        one_of("data.kind", &self.data.kind, &["synthetic", "shapes", "cifar10", "imagefolder"])?;
        one_of("data.augment", &self.data.augment, &["none", "standard"])?;
        one_of("data.on_corrupt", &self.data.on_corrupt, &["error", "skip"])?;
        one_of("optim.name", &self.optim.name, &["sgd", "adamw"])?;
        one_of("sched.name", &self.sched.name, &["cosine", "step", "multistep", "constant"])?;
        one_of("amp.dtype", &self.amp.dtype, &["fp32", "bf16", "fp16"])?;
        one_of("amp.loss_scaling", &self.amp.loss_scaling, &["auto", "on", "off"])?;
        one_of("kernels.conv", &self.kernels.conv, &["fwdconv", "candle", "custom"])?;
        if self.kernels.autotune_cache.is_empty() {
            bail!("kernels.autotune_cache is empty (\"auto\", \"off\" or a file path)");
        }
        one_of("kernels.matmul", &self.kernels.matmul, &["cublas", "custom"])?;
        if parse_device(&self.device).is_none() {
            bail!("device = \"{}\" is not one of cpu, cuda, cuda:N", self.device);
        }
        let positive = [
            ("model.num_classes", self.model.num_classes),
            ("data.image_size", self.data.image_size),
            ("data.num_samples", self.data.num_samples),
            ("data.prefetch", self.data.prefetch),
            ("train.batch_size", self.train.batch_size),
            ("train.grad_accum", self.train.grad_accum),
            ("train.epochs", self.train.epochs),
            ("log.every_steps", self.log.every_steps),
            ("amp.growth_interval", self.amp.growth_interval),
        ];
        for (k, v) in positive {
            if v == 0 {
                bail!("{k} must be at least 1");
            }
        }
        if self.data.val_resize < self.data.image_size {
            bail!(
                "data.val_resize ({}) must be at least data.image_size ({})",
                self.data.val_resize,
                self.data.image_size
            );
        }
        if self.model.stem == "imagenet" && self.data.image_size < 32 {
            bail!(
                "data.image_size = {} is too small for the imagenet stem (at least 32; use model.stem = \"cifar\")",
                self.data.image_size
            );
        }
        for (k, v) in [
            ("optim.lr", self.optim.lr),
            ("amp.init_scale", self.amp.init_scale),
            ("amp.growth_factor", self.amp.growth_factor),
            ("finetune.head_lr_mult", self.finetune.head_lr_mult),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{k} must be a positive number, got {v}");
            }
        }
        for (k, v) in [
            ("optim.momentum", self.optim.momentum),
            ("optim.weight_decay", self.optim.weight_decay),
            ("train.clip_grad_norm", self.train.clip_grad_norm),
            ("sched.warmup_epochs", self.sched.warmup_epochs),
            ("sched.min_lr", self.sched.min_lr),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{k} must be a non-negative number, got {v}");
            }
        }
        if !(0.0..1.0).contains(&self.train.label_smoothing) {
            bail!("train.label_smoothing must be in [0, 1), got {}", self.train.label_smoothing);
        }
        if !(self.amp.backoff_factor > 0.0 && self.amp.backoff_factor < 1.0) {
            bail!("amp.backoff_factor must be in (0, 1), got {}", self.amp.backoff_factor);
        }
        if self.optim.nesterov && self.optim.momentum == 0.0 {
            bail!("optim.nesterov = true needs optim.momentum > 0");
        }
        if self.sched.name == "step" && self.sched.step_epochs == 0 {
            bail!("sched.step_epochs must be at least 1 for sched.name = \"step\"");
        }
        Ok(())
    }
}

fn coerce_floats(t: &mut toml::Table, schema: &toml::Table) {
    for (k, v) in t.iter_mut() {
        match (v, schema.get(k)) {
            (toml::Value::Table(sub), Some(toml::Value::Table(ssub))) => coerce_floats(sub, ssub),
            (v @ toml::Value::Integer(_), Some(toml::Value::Float(_))) => {
                if let toml::Value::Integer(i) = *v {
                    *v = toml::Value::Float(i as f64);
                }
            }
            _ => {}
        }
    }
}

/// TOML errors span several lines (a source excerpt); keep the message on one.
fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('|') && !l.chars().all(|c| c == '^' || c == ' '))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::KernelsSection;
    use std::path::PathBuf;

    #[test]
    fn autotune_cache_paths() {
        let k = |v: &str| KernelsSection { autotune_cache: v.into(), ..Default::default() };
        assert_eq!(k("off").autotune_cache_path(), None);
        assert_eq!(k("/tmp/x.tsv").autotune_cache_path(), Some(PathBuf::from("/tmp/x.tsv")));
        if let Some(p) = k("auto").autotune_cache_path() {
            assert!(p.ends_with("resnet-train/kernels-autotune.tsv"), "{}", p.display());
        }
    }
}
