//! "cifar10": the CIFAR-10 binary version (data_batch_1..5.bin, test_batch.bin), read once into memory.

use super::{DataError, Dataset, Sample, Split, StageNanos, Transform};
use image::{Rgb, RgbImage};
use rand_chacha::ChaCha8Rng;
use std::path::Path;

const RECORD: usize = 1 + 3 * 1024;
const HINT: &str = "; download https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz, extract it and point \
                    data.dir at the cifar-10-batches-bin folder";
pub const CLASSES: [&str; 10] =
    ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"];

pub struct Cifar10 {
    /// Records of all files back to back: 1 label byte, then 1024 R, 1024 G, 1024 B bytes (row-major 32x32).
    data: Vec<u8>,
    /// (file name, first record index) per file.
    files: Vec<(String, usize)>,
    transform: Transform,
}

impl Cifar10 {
    pub fn open(dir: &str, split: Split, transform: Transform) -> Result<Self, DataError> {
        if dir.is_empty() {
            return Err(DataError::config("data.dir", format!("is empty (cifar10 needs the binary batches){HINT}")));
        }
        let root = Path::new(dir);
        if !root.is_dir() {
            return Err(DataError::Missing { path: format!("cifar10 data.dir {dir}"), hint: HINT.into() });
        }
        let names: Vec<String> = match split {
            Split::Train => (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
            Split::Val => vec!["test_batch.bin".into()],
        };
        let (mut data, mut files) = (Vec::new(), Vec::new());
        for name in names {
            let path = root.join(&name);
            if path.is_dir() {
                return Err(DataError::format(&path, "is a folder, not a cifar10 binary batch"));
            }
            if !path.is_file() {
                return Err(DataError::Missing { path: format!("cifar10 file {}", path.display()), hint: HINT.into() });
            }
            let bytes = std::fs::read(&path).map_err(|e| DataError::io(&path, e))?;
            if bytes.is_empty() || bytes.len() % RECORD != 0 {
                let msg = format!(
                    "size {} bytes is not a positive multiple of {RECORD} (truncated, or not the binary version?)",
                    bytes.len()
                );
                return Err(DataError::format(&path, msg));
            }
            if let Some((i, rec)) = bytes.chunks_exact(RECORD).enumerate().find(|(_, r)| r[0] > 9) {
                return Err(DataError::format(
                    &path,
                    format!("record #{i} has label {} (CIFAR-10 labels are 0..=9)", rec[0]),
                ));
            }
            files.push((name, data.len() / RECORD));
            data.extend_from_slice(&bytes);
        }
        Ok(Self { data, files, transform })
    }

    /// The stored 32x32 image and label of record `index`.
    pub fn raw(&self, index: usize) -> Option<(RgbImage, u32)> {
        let rec = self.data.get(index * RECORD..(index + 1) * RECORD)?;
        let (r, g, b) = (&rec[1..1025], &rec[1025..2049], &rec[2049..]);
        let img = RgbImage::from_fn(32, 32, |x, y| {
            let p = (y * 32 + x) as usize;
            Rgb([r[p], g[p], b[p]])
        });
        Some((img, rec[0] as u32))
    }
}

impl Dataset for Cifar10 {
    fn len(&self) -> usize {
        self.data.len() / RECORD
    }

    fn num_classes(&self) -> usize {
        10
    }

    fn image_size(&self) -> usize {
        self.transform.size as usize
    }

    fn get(&self, index: usize, rng: &mut ChaCha8Rng, out: &mut [u8], t: &mut StageNanos) -> Result<Sample, DataError> {
        let t0 = std::time::Instant::now();
        let (img, label) = self
            .raw(index)
            .ok_or_else(|| DataError::Loader(format!("cifar10 index {index} is out of range (len {})", self.len())))?;
        let t1 = std::time::Instant::now();
        let flip = self
            .transform
            .apply_into(&img, rng, out)
            .map_err(|m| DataError::Loader(format!("{}: {m}", self.describe(index))))?;
        t.decode += (t1 - t0).as_nanos() as u64;
        t.augment += t1.elapsed().as_nanos() as u64;
        Ok(Sample { label, flip })
    }

    fn describe(&self, index: usize) -> String {
        match self.files.iter().rev().find(|(_, first)| *first <= index) {
            Some((name, first)) => format!("cifar10 {name} #{}", index - first),
            None => format!("cifar10 #{index}"),
        }
    }

    fn class_names(&self) -> Vec<String> {
        CLASSES.iter().map(|s| s.to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_util::{get_one, planes, TempDir};

    /// Record `i` of a file: label `(i + salt) % 10`, pixel (x, y) of channel c = (c * 80 + y * 3 + x + i + salt) % 256.
    fn record(i: usize, salt: usize) -> Vec<u8> {
        let mut rec = vec![((i + salt) % 10) as u8];
        for c in 0..3 {
            for y in 0..32 {
                for x in 0..32 {
                    rec.push(((c * 80 + y * 3 + x + i + salt) % 256) as u8);
                }
            }
        }
        rec
    }

    fn write_batches(dir: &Path, counts: &[usize; 6]) {
        let names = [
            "data_batch_1.bin",
            "data_batch_2.bin",
            "data_batch_3.bin",
            "data_batch_4.bin",
            "data_batch_5.bin",
            "test_batch.bin",
        ];
        for (f, (name, &n)) in names.iter().zip(counts).enumerate() {
            let bytes: Vec<u8> = (0..n).flat_map(|i| record(i, f * 10)).collect();
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }

    fn transform() -> Transform {
        Transform { size: 32, val_resize: 32, augment: false }
    }

    #[test]
    fn reads_labels_and_planar_pixels_exactly() {
        let tmp = TempDir::new("cifar");
        write_batches(tmp.path(), &[2, 3, 1, 2, 2, 4]);
        let dir = tmp.path().to_str().unwrap();
        let train = Cifar10::open(dir, Split::Train, transform()).unwrap();
        let val = Cifar10::open(dir, Split::Val, transform()).unwrap();
        assert_eq!((train.len(), val.len()), (10, 4));
        assert_eq!(train.describe(0), "cifar10 data_batch_1.bin #0");
        assert_eq!(train.describe(4), "cifar10 data_batch_2.bin #2");
        assert_eq!(train.describe(9), "cifar10 data_batch_5.bin #1");
        assert_eq!(val.describe(3), "cifar10 test_batch.bin #3");
        // Train index 4 is record 2 of data_batch_2 (salt 10).
        let (x, s) = get_one(&train, 4, 0).unwrap();
        assert_eq!((s.label, s.flip), (2, false));
        let want = record(2, 10);
        assert_eq!(planes(&x), want[1..]);
        let (img, _) = train.raw(4).unwrap();
        assert_eq!(img.get_pixel(5, 1).0, [want[1 + 32 + 5], want[1 + 1024 + 32 + 5], want[1 + 2048 + 32 + 5]]);
        let (x, s) = get_one(&val, 3, 0).unwrap();
        assert_eq!((s.label, planes(&x)), (((3 + 50) % 10) as u32, record(3, 50)[1..].to_vec()));
        // Augmented and resized: right shape, label unchanged.
        let big = Cifar10::open(dir, Split::Train, Transform { size: 48, val_resize: 48, augment: true }).unwrap();
        let (x, s) = get_one(&big, 4, 0).unwrap();
        assert_eq!((x.len(), s.label), (3 * 48 * 48, 2));
    }

    #[test]
    fn truncated_file_bad_label_and_missing_file_name_the_file() {
        let tmp = TempDir::new("cifar-bad");
        write_batches(tmp.path(), &[2, 2, 2, 2, 2, 2]);
        let dir = tmp.path().to_str().unwrap();
        let b3 = tmp.path().join("data_batch_3.bin");
        let mut bytes = std::fs::read(&b3).unwrap();
        bytes.truncate(RECORD + 100);
        std::fs::write(&b3, &bytes).unwrap();
        let e = Cifar10::open(dir, Split::Train, transform()).err().unwrap().to_string();
        assert!(e.contains("data_batch_3.bin") && e.contains("3073"), "{e}");

        let tb = tmp.path().join("test_batch.bin");
        let mut bytes = std::fs::read(&tb).unwrap();
        bytes[RECORD] = 12;
        std::fs::write(&tb, &bytes).unwrap();
        let e = Cifar10::open(dir, Split::Val, transform()).err().unwrap().to_string();
        assert!(e.contains("test_batch.bin") && e.contains("label 12"), "{e}");

        std::fs::remove_file(&tb).unwrap();
        let e = Cifar10::open(dir, Split::Val, transform()).err().unwrap().to_string();
        assert!(e.contains("test_batch.bin") && e.contains("cifar-10-binary.tar.gz"), "{e}");
        let e = Cifar10::open("/nonexistent/cifar", Split::Val, transform()).err().unwrap().to_string();
        assert!(e.contains("/nonexistent/cifar") && e.contains("cifar-10-batches-bin"), "{e}");
    }
}
