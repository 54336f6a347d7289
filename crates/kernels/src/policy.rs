//! Kernel choice as a value. A [`KernelPolicy`] says which convolution and matmul run and how the tensor-core
//! kernels pick their tile; it travels with the model's config into every forward (the way the activation layout
//! does), so two models, tests or benchmarks in one process can run different choices side by side.

use crate::variants::{tile_by_name, Tile};
use candle_core::DType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Which convolution the model runs, as configured (`kernels.conv`); [`ConvChoice::resolve`] turns "auto" into
/// an implementation for a device and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConvChoice {
    /// The custom kernels where they apply (CUDA, bf16/fp16), else [`ConvImpl::FwdConv`].
    Auto,
    FwdConv,
    Candle,
    Custom,
}

/// The convolution a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvImpl {
    /// candle's conv2d with a backward through forward convs only (`ops::conv`).
    FwdConv,
    /// candle's conv2d with candle's own backward (conv_transpose2d for grad-input): the baseline.
    Candle,
    /// Our implicit-GEMM tensor-core kernels over channels-last activations (`ops::conv_nhwc`); the model runs
    /// NHWC end to end. On the CPU and in FP32 the same op is computed by candle's conv through permutes.
    Custom,
}

impl ConvImpl {
    pub fn name(self) -> &'static str {
        match self {
            ConvImpl::FwdConv => "fwdconv",
            ConvImpl::Candle => "candle",
            ConvImpl::Custom => "custom",
        }
    }
}

impl ConvChoice {
    /// The implementation for a model on a CUDA device (`cuda`) or the CPU, computing in `dtype`.
    pub fn resolve(self, cuda: bool, dtype: DType) -> ConvImpl {
        match self {
            ConvChoice::Auto if cuda && low_precision(dtype) => ConvImpl::Custom,
            ConvChoice::Auto => ConvImpl::FwdConv,
            ConvChoice::FwdConv => ConvImpl::FwdConv,
            ConvChoice::Candle => ConvImpl::Candle,
            ConvChoice::Custom => ConvImpl::Custom,
        }
    }
}

/// Which matmul `fc` runs, as configured (`kernels.matmul`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulChoice {
    /// Our GEMM where it applies (CUDA, bf16/fp16), else cuBLAS / candle's matmul.
    Auto,
    Cublas,
    Custom,
}

/// The matmul of `fc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulImpl {
    /// candle's matmul (cuBLAS on CUDA, gemm on the CPU).
    Cublas,
    /// Our tensor-core GEMM with the bias add fused into its epilogue (CUDA, BF16/FP16; candle's matmul
    /// otherwise).
    Custom,
}

impl MatmulImpl {
    pub fn name(self) -> &'static str {
        match self {
            MatmulImpl::Cublas => "cublas",
            MatmulImpl::Custom => "custom",
        }
    }
}

impl MatmulChoice {
    pub fn resolve(self, cuda: bool, dtype: DType) -> MatmulImpl {
        match self {
            MatmulChoice::Auto if cuda && low_precision(dtype) => MatmulImpl::Custom,
            MatmulChoice::Auto => MatmulImpl::Cublas,
            MatmulChoice::Cublas => MatmulImpl::Cublas,
            MatmulChoice::Custom => MatmulImpl::Custom,
        }
    }
}

fn low_precision(dt: DType) -> bool {
    matches!(dt, DType::BF16 | DType::F16)
}

/// Where the explicit step's bottleneck conv3 takes its input relu(bn2(z2)) from ([`KernelPolicy::bn_apply_in_conv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BnApplyInConv {
    /// bn2 writes the activation, which is kept for conv3's grad-weight.
    #[default]
    Off,
    /// bn2 writes the activation for the forward conv3, which does not keep it: conv3's grad-weight normalises
    /// z2 itself ([`crate::conv2d_nhwc_grad_weight_bn_relu`]).
    Backward,
    /// Also the forward conv3 normalises z2 itself ([`crate::conv2d_nhwc_forward_bn_relu`]): bn2's forward keeps
    /// its statistics only, and the activation is never written.
    Both,
}

impl BnApplyInConv {
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Backward => "backward",
            Self::Both => "both",
        }
    }
}

/// How a tensor-core launch picks its tile.
#[derive(Debug, Clone)]
pub enum Tuning {
    /// A fixed rule of shape and SM count (no timing).
    Heuristic,
    /// The first launch of each (op, shape, dtype) on a GPU model times every tile and keeps the fastest.
    Autotune(Arc<Autotuner>),
    /// One tile for every launch that can take it (benchmarks and tests); scalar (unaligned) shapes still run
    /// `t64`, and a TMA tile falls back to `w256` / `w128` on the passes the TMA kernels do not run.
    Forced(Tile),
}

/// Default byte budget of the explicit-im2col buffer of few-channel convolutions (the RGB stem).
pub const IM2COL_BUDGET: usize = 1 << 30;

/// Which kernels run, passed with every op call that has a choice.
#[derive(Debug, Clone)]
pub struct KernelPolicy {
    pub conv: ConvImpl,
    pub matmul: MatmulImpl,
    pub tuning: Tuning,
    /// Byte budget of the im2col buffer of the few-channel path (whole images per chunk, at least one).
    pub im2col_budget: usize,
    /// Testing aid: channels-last training-mode BatchNorm runs the fused op on the CPU too (its reference
    /// implementation) instead of composing candle ops.
    pub fused_batchnorm_on_cpu: bool,
    /// The explicit training step takes a BatchNorm's moments from the epilogue of the convolution before it
    /// when that runs on a TMA tile (CUDA, sm_90a), instead of a pass over the convolution's output.
    pub bn_stats_in_conv: bool,
    /// The explicit training step takes a BatchNorm's backward sums from the kernel that makes its output
    /// gradient (the block output's ReLU-gradient pass; the grad-input epilogue of the 1x1 or stride-1 conv
    /// after it, on a TMA tile) instead of a pass over that gradient.
    pub bn_sums_in_backward: bool,
    /// With the two above: each convolution shape keeps its BatchNorm reduction in the epilogue only where that
    /// is faster than the plain convolution and the pass, timed on first use under [`Tuning::Autotune`] and
    /// remembered by the autotuner (`kernels.bn_stats = "auto"`).
    pub bn_epilogue_by_timing: bool,
    /// The explicit training step runs each BatchNorm whose statistics take the pass as one cooperative launch
    /// forward (moments, finaliser, normalisation + ReLU) and one backward (sums, finaliser, grad-input), with
    /// grid-wide barriers between the phases, instead of three launches each (CUDA; the results are the same bit
    /// for bit; `kernels.bn_cooperative`).
    pub bn_cooperative: bool,
    /// The explicit training step runs the ImageNet stem's BatchNorm + ReLU + max-pool forward as one launch
    /// (`bn_nhwc_train_pool_v8` on CUDA: the full-resolution activation is never written; on the CPU the same op
    /// composes the separate passes). The saved state (pre-BatchNorm output, statistics, pool offsets) is the
    /// separate passes', so either backward follows it. Default: on, unless `KERNELS_STEM_POOL_FUSED=0` in the
    /// environment (H100, 2026-12-06: 608 us against 1,045 us for the three launches it replaces).
    pub stem_pool_fused: bool,
    /// The explicit training step runs the stem pool's backward inside the stem BatchNorm's backward, one
    /// launch (`bn_nhwc_train_bwd_pool_v8`) instead of the pool's backward + the BatchNorm's. Default: off, unless
    /// `KERNELS_STEM_POOL_BWD_FUSED=1` in the environment (H100, 2026-12-06: 1,777 us against 972 us for the two
    /// launches it replaces, though it moves fewer bytes).
    pub stem_pool_bwd_fused: bool,
    /// The explicit training step keeps each residual block output's ReLU mask (1 bit an element, written by the
    /// cooperative forward with the output) and its cooperative join backward reads the mask instead of the
    /// output: 15/16 of a bf16 output's bytes fewer per block backward, for rows * c / 8 bytes more memory per
    /// block (ResNet-152, batch 256: 0.39 GiB). The same gradients bit for bit. Default: on, unless
    /// `KERNELS_JOIN_MASK=0` in the environment.
    pub join_relu_mask: bool,
    /// The explicit training step keeps a 1x1 stride-2 downsample's grad-input on the conv's own grid (a stride-1
    /// grad-input there) and the cooperative join of the block before reads it so: the full-size tensor, zero off
    /// the even cells, is neither memset nor read (ResNet-152 at batch 256: 411 + 205 + 103 MB each way a step).
    /// The grad-input is summed by another kernel (the plain GEMM): equal to rounding, not bit for bit. Default: on,
    /// unless `KERNELS_COMPACT_SHORTCUT=0` in the environment.
    pub compact_shortcut_grad: bool,
    /// The explicit training step normalises a bottleneck's conv3 input (relu(bn2(z2))) inside that 1x1
    /// convolution's grad-weight ([`BnApplyInConv::Backward`]: the activation is not kept for the backward), or
    /// its forward too ([`BnApplyInConv::Both`]: bn2's forward is its statistics alone, the activation never
    /// written), as the TMA GEMM's operand ([`crate::conv2d_nhwc_forward_bn_relu`]). The same values bit for
    /// bit. Default: off, unless `KERNELS_BN_APPLY_IN_CONV=backward` or `both` (or 1) in the environment.
    pub bn_apply_in_conv: BnApplyInConv,
    /// The explicit training step folds the block-output join into the grad-input of the next bottleneck's conv1
    /// (1x1, stride 1, identity shortcut): that grad-input's store adds the shortcut gradient and applies the
    /// block output's ReLU mask ([`crate::conv2d_nhwc_grad_input_join`]), so the block's last BatchNorm backward
    /// reads the joined gradient instead of the two gradients and the mask. Needs `join_relu_mask` and the
    /// cooperative BatchNorm backward. The same values bit for bit. Default: on, unless `KERNELS_JOIN_IN_CONV=0`
    /// in the environment.
    pub join_in_conv: bool,
    /// With `join_in_conv` and `bn_sums_in_backward` (not `bn_epilogue_by_timing`): the conv1 grad-input that
    /// joins also takes the backward sums of the block before's last BatchNorm from the joined values
    /// (`gemm_nn_joinsw_*`, [`crate::conv2d_nhwc_grad_input_join_sums`]), so that BatchNorm's cooperative backward
    /// reduces those partials instead of reading its input and gradient for its own sums. Default: on, unless
    /// `KERNELS_JOIN_SUMS=0` in the environment.
    pub join_sums_in_conv: bool,
}

impl Default for KernelPolicy {
    /// candle's convolution with the forward-conv backward, candle's matmul, heuristic tiles.
    fn default() -> Self {
        Self {
            conv: ConvImpl::FwdConv,
            matmul: MatmulImpl::Cublas,
            tuning: Tuning::Heuristic,
            im2col_budget: IM2COL_BUDGET,
            fused_batchnorm_on_cpu: false,
            bn_stats_in_conv: false,
            bn_sums_in_backward: false,
            bn_epilogue_by_timing: false,
            bn_cooperative: false,
            stem_pool_fused: crate::ops::batchnorm::stem_pool_fused(),
            stem_pool_bwd_fused: crate::ops::batchnorm::stem_pool_bwd_fused(),
            join_relu_mask: crate::ops::batchnorm::join_relu_mask(),
            compact_shortcut_grad: crate::ops::batchnorm::compact_shortcut_grad(),
            bn_apply_in_conv: crate::ops::batchnorm::bn_apply_in_conv(),
            join_in_conv: crate::ops::batchnorm::join_in_conv(),
            join_sums_in_conv: crate::ops::batchnorm::join_sums_in_conv(),
        }
    }
}

impl KernelPolicy {
    /// Our convolutions and GEMM (channels-last), tiles by heuristic.
    pub fn custom() -> Self {
        Self { conv: ConvImpl::Custom, matmul: MatmulImpl::Custom, ..Self::default() }
    }
    /// The same policy with another tuning.
    pub fn with_tuning(self, tuning: Tuning) -> Self {
        Self { tuning, ..self }
    }
    /// The same policy with every fused BatchNorm reduction on (`kernels.bn_stats = "fused"`) or off.
    pub fn with_fused_bn_reductions(self, on: bool) -> Self {
        Self { bn_stats_in_conv: on, bn_sums_in_backward: on, ..self }
    }
    /// Whether a joining conv1 grad-input also takes the sums of the BatchNorm before
    /// ([`Self::join_sums_in_conv`]'s conditions).
    pub fn join_sums(&self) -> bool {
        self.join_sums_in_conv && self.bn_sums_in_backward && !self.bn_epilogue_by_timing
    }
    /// Whether models under this policy run channels-last (the custom convolutions are NHWC).
    pub fn channels_last(&self) -> bool {
        self.conv == ConvImpl::Custom
    }
    /// One line for logs: `conv custom, matmul custom, tiles autotuned (cache: PATH)`.
    pub fn describe(&self) -> String {
        let tiles = match &self.tuning {
            Tuning::Heuristic => "tiles by heuristic".to_string(),
            Tuning::Forced(t) => format!("tile {} forced", t.name),
            Tuning::Autotune(a) => match a.file() {
                Some(p) => format!("tiles autotuned (cache {})", p.display()),
                None => "tiles autotuned (in memory)".to_string(),
            },
        };
        let timed = if self.bn_epilogue_by_timing { " where timed faster" } else { "" };
        let stats = if self.bn_stats_in_conv { ", BatchNorm moments in the conv epilogues" } else { "" };
        let sums = if self.bn_sums_in_backward { ", BatchNorm backward sums fused" } else { "" };
        let timed = if self.bn_stats_in_conv || self.bn_sums_in_backward { timed } else { "" };
        let coop = if self.bn_cooperative { ", one cooperative launch a BatchNorm pass" } else { "" };
        let bnin = match self.bn_apply_in_conv {
            BnApplyInConv::Off => "",
            BnApplyInConv::Backward => ", bottleneck conv3 inputs normalised in the grad-weight",
            BnApplyInConv::Both => ", bottleneck conv3 inputs normalised in the conv and its grad-weight",
        };
        // Named only where it can apply: the join folds into the cooperative BatchNorm's backward.
        let join = if self.join_in_conv && self.bn_cooperative && self.join_relu_mask {
            ", block-output joins in the conv1 grad-inputs"
        } else {
            ""
        };
        let join_sums = if !join.is_empty() && self.join_sums() { " (with the last BatchNorm's sums)" } else { "" };
        format!(
            "conv {}, matmul {}, {tiles}{stats}{sums}{timed}{coop}{bnin}{join}{join_sums}",
            self.conv.name(),
            self.matmul.name()
        )
    }
}

/// The autotune cache's values for an epilogue choice ([`Autotuner::insert_epilogue`]).
const EPILOGUE: &str = "epilogue";
const PASS: &str = "pass";

/// Errors of the autotune cache file.
#[derive(Debug, thiserror::Error)]
pub enum TuneCacheError {
    #[error(
        "autotune cache {path}: line {line} is not `GPU<TAB>op and shape<TAB>tile` with a known tile (or `epilogue` / `pass`); delete the file to time the shapes again"
    )]
    Malformed { path: String, line: usize },
    #[error("autotune cache {path}: {msg}")]
    Io { path: String, msg: String },
}

/// The autotuner's memory: the chosen tile per (GPU name, op and shape), and per convolution shape whether its
/// BatchNorm reduction runs in the epilogue (`epilogue`) or as a pass (`pass`) ([`KernelPolicy::bn_epilogue_by_timing`]),
/// optionally persisted to a tab-separated file so that a shape is timed once per GPU model, not once per process.
#[derive(Debug, Default)]
pub struct Autotuner {
    file: Option<PathBuf>,
    choices: Mutex<HashMap<String, Tile>>,
    epilogues: Mutex<HashMap<String, bool>>,
    warned: AtomicBool,
}

impl Autotuner {
    /// Choices in memory only.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Choices kept in `path` (`GPU name<TAB>op and shape<TAB>tile` per line): read now (choices for other GPUs
    /// are kept but unused), and every new choice appended. A missing file is created on the first append; an
    /// unreadable or malformed one is an error naming it.
    pub fn with_file(path: &Path) -> Result<Self, TuneCacheError> {
        let (mut choices, mut epilogues) = (HashMap::new(), HashMap::new());
        match std::fs::read_to_string(path) {
            Ok(text) => {
                // A last line without its newline is another process's append under way: left for it.
                for (i, line) in text.split_inclusive('\n').enumerate().filter(|(_, l)| l.ends_with('\n')) {
                    let line = line.trim_end_matches(['\n', '\r']);
                    let f: Vec<&str> = line.split('\t').collect();
                    let [gpu, key, value] = f.as_slice() else {
                        return Err(TuneCacheError::Malformed { path: path.display().to_string(), line: i + 1 });
                    };
                    let key = format!("{gpu}\t{key}");
                    match (*value, tile_by_name(value)) {
                        (_, Some(tile)) => _ = choices.insert(key, tile),
                        (EPILOGUE | PASS, None) => _ = epilogues.insert(key, *value == EPILOGUE),
                        _ => return Err(TuneCacheError::Malformed { path: path.display().to_string(), line: i + 1 }),
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(TuneCacheError::Io { path: path.display().to_string(), msg: e.to_string() }),
        }
        Ok(Self {
            file: Some(path.to_path_buf()),
            choices: Mutex::new(choices),
            epilogues: Mutex::new(epilogues),
            warned: AtomicBool::new(false),
        })
    }

    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The remembered tile of `key` (`GPU name<TAB>op and shape`).
    pub fn get(&self, key: &str) -> Option<Tile> {
        self.choices.lock().unwrap_or_else(|e| e.into_inner()).get(key).copied()
    }

    /// Remembers a choice and appends it to the file (best effort: a failure is reported once and tuning goes on
    /// in memory).
    pub fn insert(&self, key: String, tile: Tile) {
        self.append(&key, tile.name);
        self.choices.lock().unwrap_or_else(|e| e.into_inner()).insert(key, tile);
    }

    /// The remembered epilogue choice of `key` (`GPU name<TAB>epilogue op and shape`): true for the epilogue.
    pub fn epilogue(&self, key: &str) -> Option<bool> {
        self.epilogues.lock().unwrap_or_else(|e| e.into_inner()).get(key).copied()
    }

    /// Remembers an epilogue choice (true: the epilogue, false: the pass), as [`Self::insert`] a tile.
    pub fn insert_epilogue(&self, key: String, epilogue: bool) {
        self.append(&key, if epilogue { EPILOGUE } else { PASS });
        self.epilogues.lock().unwrap_or_else(|e| e.into_inner()).insert(key, epilogue);
    }

    fn append(&self, key: &str, value: &str) {
        if let Some(path) = &self.file {
            let res = (|| -> std::io::Result<()> {
                use std::io::Write;
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
                // The whole line in one write: an O_APPEND write lands at the end as one piece, so lines that
                // several threads or processes (data-parallel ranks) append at once do not interleave. (`writeln!`
                // on a File writes each formatted piece on its own: four ranks tuning at once left lines mixed.)
                f.write_all(format!("{key}\t{value}\n").as_bytes())
            })();
            if let Err(e) = res {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    eprintln!("warning: autotune cache {}: {e}; choices stay in memory", path.display());
                }
            }
        }
    }

    /// The choices so far: (GPU and op and shape, tile name or `epilogue` / `pass`), sorted.
    pub fn choices(&self) -> Vec<(String, &'static str)> {
        let mut v: Vec<_> =
            self.choices.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, t)| (k.clone(), t.name)).collect();
        let e = self.epilogues.lock().unwrap_or_else(|e| e.into_inner());
        v.extend(e.iter().map(|(k, &on)| (k.clone(), if on { EPILOGUE } else { PASS })));
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::variants::{X256, X64};

    #[test]
    fn auto_resolves_by_device_and_dtype() {
        for dt in [DType::BF16, DType::F16] {
            assert_eq!(ConvChoice::Auto.resolve(true, dt), ConvImpl::Custom);
            assert_eq!(MatmulChoice::Auto.resolve(true, dt), MatmulImpl::Custom);
            assert_eq!(ConvChoice::Auto.resolve(false, dt), ConvImpl::FwdConv);
            assert_eq!(MatmulChoice::Auto.resolve(false, dt), MatmulImpl::Cublas);
        }
        assert_eq!(ConvChoice::Auto.resolve(true, DType::F32), ConvImpl::FwdConv);
        assert_eq!(MatmulChoice::Auto.resolve(true, DType::F32), MatmulImpl::Cublas);
        assert_eq!(ConvChoice::Candle.resolve(true, DType::BF16), ConvImpl::Candle);
        assert_eq!(ConvChoice::Custom.resolve(false, DType::F32), ConvImpl::Custom);
        assert_eq!(MatmulChoice::Custom.resolve(false, DType::F32), MatmulImpl::Custom);
        assert!(KernelPolicy::custom().channels_last() && !KernelPolicy::default().channels_last());
    }

    #[test]
    fn autotune_cache_round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("kernels-tune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub").join("tune.tsv");
        let a = Autotuner::with_file(&path).unwrap();
        assert!(a.choices().is_empty());
        a.insert("H200\tconv fwd 1".into(), X256);
        a.insert("H200\tmatmul nt 2".into(), X64);
        a.insert_epilogue("H200\tepilogue moments 3".into(), false);
        a.insert_epilogue("H200\tepilogue sums 4".into(), true);
        let b = Autotuner::with_file(&path).unwrap();
        assert_eq!(b.get("H200\tconv fwd 1"), Some(X256));
        assert_eq!(b.epilogue("H200\tepilogue moments 3"), Some(false));
        assert_eq!(b.epilogue("H200\tepilogue sums 4"), Some(true));
        assert_eq!((b.epilogue("H200\tconv fwd 1"), b.get("H200\tepilogue sums 4")), (None, None));
        assert_eq!(b.choices().len(), 4);
        assert!(b.choices().contains(&("H200\tepilogue moments 3".to_string(), "pass")));
        std::fs::write(&path, "H200\tepilogue x\tmaybe\n").unwrap();
        let e = Autotuner::with_file(&path).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("`epilogue` / `pass`"), "{e}");
        std::fs::write(&path, "H200\tconv\tt999\n").unwrap();
        let e = Autotuner::with_file(&path).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains(&path.display().to_string()), "{e}");
        let e = Autotuner::with_file(&dir).unwrap_err().to_string();
        assert!(e.contains("autotune cache"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        let policy = KernelPolicy::custom().with_tuning(Tuning::Autotune(Arc::new(Autotuner::in_memory())));
        assert_eq!(policy.describe(), "conv custom, matmul custom, tiles autotuned (in memory)");
    }

    /// Ranks (here threads, each with a tuner of its own on one file) append at once: every line stays whole.
    #[test]
    fn concurrent_appends_keep_the_cache_readable() {
        let dir = std::env::temp_dir().join(format!("kernels-tune-mt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("tune.tsv");
        let (threads, each) = (8, 300);
        std::thread::scope(|s| {
            for t in 0..threads {
                let path = path.clone();
                s.spawn(move || {
                    let tuner = Autotuner::with_file(&path).unwrap();
                    for i in 0..each {
                        let key = format!("NVIDIA H100 80GB HBM3\tconv2d_nhwc_fwd ConvGeom {{ n: {t}, i: {i} }} bf16");
                        match i % 3 {
                            0 => tuner.insert_epilogue(key, i % 2 == 0),
                            _ => tuner.insert(key, if i % 2 == 0 { X256 } else { X64 }),
                        }
                    }
                });
            }
        });
        let read = Autotuner::with_file(&path).unwrap();
        assert_eq!(read.choices().len(), threads * each);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
