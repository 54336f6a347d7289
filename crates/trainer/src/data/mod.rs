//! Datasets (synthetic, shapes, CIFAR-10, image folders, packed shards), their transforms and the multi-threaded
//! batch loader, which emits uint8 HWC batches (normalisation happens with the upload: `kernels::input`).

pub mod cifar;
pub mod decode;
pub mod imagefolder;
pub mod loader;
pub mod packed;
pub mod shapes;
pub mod synthetic;
pub mod transforms;

use crate::config::{DataKind, DataSection};
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::sync::Arc;

pub use cifar::Cifar10;
pub use imagefolder::ImageFolder;
pub use loader::{epoch_order, num_batches, sample_rng, HostBatch, Loader, LoaderOptions, LoaderStats, StatsHandle};
pub use packed::Packed;
pub use shapes::Shapes;
pub use synthetic::Synthetic;
pub use transforms::Transform;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }
}

/// Errors of the data pipeline; each message is one line naming the file, folder or config key at fault.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{key}: {msg}")]
    Config { key: String, msg: String },
    #[error("{path} does not exist{hint}")]
    Missing { path: String, hint: String },
    #[error("cannot read {path}: {msg}")]
    Io { path: String, msg: String },
    #[error("cannot decode image {path}: {msg}")]
    Decode { path: String, msg: String },
    /// A file or folder that exists but is laid out wrongly (truncated CIFAR file, empty class folder, ...).
    #[error("{path}: {msg}")]
    Format { path: String, msg: String },
    #[error("data loader: {0}")]
    Loader(String),
}

impl DataError {
    pub(crate) fn io(path: &Path, e: std::io::Error) -> Self {
        DataError::Io { path: path.display().to_string(), msg: one_line(&e.to_string()) }
    }

    pub(crate) fn format(path: &Path, msg: impl Into<String>) -> Self {
        DataError::Format { path: path.display().to_string(), msg: msg.into() }
    }

    pub(crate) fn config(key: &str, msg: impl Into<String>) -> Self {
        DataError::Config { key: key.to_string(), msg: msg.into() }
    }
}

pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Thread time a sample spent per stage, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageNanos {
    /// Reading and decoding (generating, for generated datasets).
    pub decode: u64,
    /// Crop and resize into the batch buffer.
    pub augment: u64,
}

/// What a loaded sample says besides its pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub label: u32,
    /// The network sees the image mirrored horizontally (applied with the normalisation).
    pub flip: bool,
}

/// A random-access dataset of labelled images, shared by the loader's worker threads.
pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn num_classes(&self) -> usize;

    /// Side of the square images `get` writes.
    fn image_size(&self) -> usize;

    /// Writes sample `index` into `out` (image_size x image_size x 3 bytes: HWC RGB, not normalised) and returns
    /// its label and flip. `rng` drives augmentation (only Split::Train with augment = "standard" augments); `t`
    /// collects the time spent decoding and augmenting.
    fn get(&self, index: usize, rng: &mut ChaCha8Rng, out: &mut [u8], t: &mut StageNanos) -> Result<Sample, DataError>;

    /// Human-readable name of sample `index` (file path, or "cifar10 data_batch_3.bin #17"), for messages.
    fn describe(&self, index: usize) -> String;

    /// Class names in label order (folder names for image folders).
    fn class_names(&self) -> Vec<String> {
        (0..self.num_classes()).map(|c| c.to_string()).collect()
    }
}

/// Opens the dataset of `cfg.kind` for `split`. `num_classes` sets the classes of "synthetic" and "shapes"; CIFAR-10
/// always has 10 and an image folder one per sub-folder (the caller checks them against the model's head).
/// `seed` fixes the generated datasets' contents.
pub fn open(cfg: &DataSection, split: Split, seed: u64, num_classes: usize) -> Result<Arc<dyn Dataset>, DataError> {
    let transform = Transform::new(cfg, split)?;
    let generated_len = match split {
        Split::Train => cfg.num_samples,
        Split::Val => (cfg.num_samples / 5).max(1),
    };
    let generated = matches!(cfg.kind, DataKind::Synthetic | DataKind::Shapes);
    if generated && num_classes == 0 {
        return Err(DataError::config("model.num_classes", "must be at least 1"));
    }
    Ok(match cfg.kind {
        DataKind::Synthetic => Arc::new(Synthetic::new(generated_len, num_classes, cfg.image_size, seed, split)),
        DataKind::Shapes => Arc::new(Shapes::new(generated_len, num_classes, transform, seed, split)),
        DataKind::Cifar10 => Arc::new(Cifar10::open(&cfg.dir, split, transform)?),
        DataKind::Imagefolder => Arc::new(ImageFolder::open(&cfg.train_dir, &cfg.val_dir, split, transform)?),
        DataKind::Packed => Arc::new(Packed::open_split(&cfg.dir, split, transform)?),
    })
}

/// Mixes integers into one well-spread 64-bit seed (splitmix64 rounds).
pub(crate) fn mix_seed(parts: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for &p in parts {
        let mut z = (h ^ p).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h = z ^ (z >> 31);
    }
    h
}

#[cfg(test)]
pub(crate) mod test_util {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh, empty temp folder removed on drop.
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("trainer-data-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// HWC u8 pixels as per-channel planes (CHW), the layout CIFAR-10 stores.
    pub fn planes(x: &[u8]) -> Vec<u8> {
        (0..3).flat_map(|c| x.iter().skip(c).step_by(3).copied()).collect()
    }

    /// Sample `index` of `ds` into a fresh buffer, with a fixed RNG.
    pub fn get_one(
        ds: &dyn super::Dataset,
        index: usize,
        seed: u64,
    ) -> Result<(Vec<u8>, super::Sample), super::DataError> {
        use rand::SeedableRng;
        let s = ds.image_size();
        let mut out = vec![0u8; s * s * 3];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let sample = ds.get(index, &mut rng, &mut out, &mut Default::default())?;
        Ok((out, sample))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_generated_sizes() {
        let cfg = DataSection {
            kind: DataKind::Shapes,
            num_samples: 50,
            image_size: 16,
            val_resize: 16,
            ..Default::default()
        };
        assert_eq!(open(&cfg, Split::Train, 0, 10).unwrap().len(), 50);
        assert_eq!(open(&cfg, Split::Val, 0, 10).unwrap().len(), 10);
        let tiny = DataSection { num_samples: 3, ..cfg.clone() };
        assert_eq!(open(&tiny, Split::Val, 0, 10).unwrap().len(), 1);
        assert_eq!(open(&tiny, Split::Val, 0, 10).unwrap().image_size(), 16);
    }
}
