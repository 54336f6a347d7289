//! "imagefolder": train_dir / val_dir with one sub-folder per class (sorted names give labels) of JPEG/PNG files.

use super::{decode, DataError, Dataset, Sample, Split, StageNanos, Transform};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};

const EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

pub struct ImageFolder {
    classes: Vec<String>,
    /// (file, label), sorted by class then path.
    samples: Vec<(PathBuf, u32)>,
    transform: Transform,
}

/// Sorted names of the class sub-folders of `dir` (hidden folders ignored); `key` is the config key naming it.
pub fn class_names(dir: &str, key: &str) -> Result<Vec<String>, DataError> {
    if dir.is_empty() {
        return Err(DataError::config(key, "is empty; set it to a folder with one sub-folder of images per class"));
    }
    let root = Path::new(dir);
    if !root.is_dir() {
        return Err(DataError::Missing {
            path: format!("{key} {dir}"),
            hint: " (or is not a folder): it must hold one sub-folder of JPEG/PNG images per class, e.g. ImageNet's \
                   ILSVRC2012 train/val images from https://image-net.org arranged as <dir>/<wnid>/*.JPEG (torchvision's \
                   ImageFolder layout); set data.train_dir and data.val_dir to those folders"
                .into(),
        });
    }
    let mut classes = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|e| DataError::io(root, e))? {
        let path = entry.map_err(|e| DataError::io(root, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if path.is_dir() && !name.starts_with('.') {
            classes.push(name);
        }
    }
    if classes.is_empty() {
        return Err(DataError::format(
            root,
            format!("{key} has no class sub-folders (expected one sub-folder of images per class)"),
        ));
    }
    classes.sort();
    Ok(classes)
}

/// Image files under `dir`, recursively, sorted. Symlinked folders are followed (as torchvision's ImageFolder
/// does), except one that leads back to a folder above it (`ancestors`: the canonical paths from the split's root
/// down), which would list images of other classes, or loop: an error naming the link.
fn image_files(dir: &Path, out: &mut Vec<PathBuf>, ancestors: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let canon = dir.canonicalize().map_err(|e| DataError::io(dir, e))?;
    if ancestors.contains(&canon) {
        return Err(DataError::format(dir, format!("leads back to {} (a symlink loop)", canon.display())));
    }
    ancestors.push(canon);
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        entries.push(entry.map_err(|e| DataError::io(dir, e))?.path());
    }
    entries.sort();
    for path in entries {
        let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
        if path.is_dir() {
            image_files(&path, out, ancestors)?;
        } else if ext.is_some_and(|e| EXTENSIONS.contains(&e.as_str())) {
            out.push(path);
        }
    }
    ancestors.pop();
    Ok(())
}

impl ImageFolder {
    /// Opens `train_dir` or `val_dir` for `split`; when both are set their class folders must match.
    pub fn open(train_dir: &str, val_dir: &str, split: Split, transform: Transform) -> Result<Self, DataError> {
        let (dir, key, other, other_key) = match split {
            Split::Train => (train_dir, "data.train_dir", val_dir, "data.val_dir"),
            Split::Val => (val_dir, "data.val_dir", train_dir, "data.train_dir"),
        };
        let classes = class_names(dir, key)?;
        if !other.is_empty() && Path::new(other).is_dir() {
            let others = class_names(other, other_key)?;
            if others != classes {
                let only = |a: &[String], b: &[String]| {
                    let v: Vec<&str> = a.iter().filter(|c| !b.contains(c)).map(String::as_str).take(5).collect();
                    if v.is_empty() {
                        "-".to_string()
                    } else {
                        v.join(", ")
                    }
                };
                return Err(DataError::Format {
                    path: format!("{key} {dir} vs {other_key} {other}"),
                    msg: format!(
                        "class folders differ ({} vs {}; only in {key}: {}; only in {other_key}: {})",
                        classes.len(),
                        others.len(),
                        only(&classes, &others),
                        only(&others, &classes)
                    ),
                });
            }
        }
        let mut samples = Vec::new();
        let root = Path::new(dir).canonicalize().map_err(|e| DataError::io(Path::new(dir), e))?;
        for (label, class) in classes.iter().enumerate() {
            let class_dir = Path::new(dir).join(class);
            let mut files = Vec::new();
            image_files(&class_dir, &mut files, &mut vec![root.clone()])?;
            if files.is_empty() {
                return Err(DataError::format(&class_dir, "class folder has no .jpg/.jpeg/.png files"));
            }
            samples.extend(files.into_iter().map(|f| (f, label as u32)));
        }
        Ok(Self { classes, samples, transform })
    }

    pub fn path(&self, index: usize) -> Option<&Path> {
        self.samples.get(index).map(|(p, _)| p.as_path())
    }

    /// File and label of sample `index`.
    pub fn sample(&self, index: usize) -> Option<(&Path, u32)> {
        self.samples.get(index).map(|(p, l)| (p.as_path(), *l))
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.samples.len()
    }

    fn num_classes(&self) -> usize {
        self.classes.len()
    }

    fn image_size(&self) -> usize {
        self.transform.size as usize
    }

    fn get(&self, index: usize, rng: &mut ChaCha8Rng, out: &mut [u8], t: &mut StageNanos) -> Result<Sample, DataError> {
        let (path, label) = self.samples.get(index).ok_or_else(|| {
            DataError::Loader(format!("imagefolder index {index} is out of range (len {})", self.len()))
        })?;
        let t0 = std::time::Instant::now();
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        t.decode += t0.elapsed().as_nanos() as u64;
        let flip = decode::load_into(&bytes, &|| path.display().to_string(), &self.transform, rng, out, t)?;
        Ok(Sample { label: *label, flip })
    }

    fn describe(&self, index: usize) -> String {
        match self.path(index) {
            Some(p) => p.display().to_string(),
            None => format!("imagefolder #{index}"),
        }
    }

    fn class_names(&self) -> Vec<String> {
        self.classes.clone()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::data::loader::{Loader, LoaderOptions};
    use crate::data::test_util::TempDir;
    use image::{Rgb, RgbImage};
    use rand::{RngCore, SeedableRng};
    use std::sync::Arc;

    fn solid(w: u32, h: u32, v: u8) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| Rgb([v, (x * 10) as u8, (y * 10) as u8]))
    }

    /// root/{train,val}/{cat,dog,emu}: PNG and JPEG files of several sizes (plus files to ignore).
    pub(crate) fn make_tree(tmp: &TempDir) -> (String, String) {
        for split in ["train", "val"] {
            for (c, class) in ["dog", "cat", "emu"].iter().enumerate() {
                let d = tmp.path().join(split).join(class);
                std::fs::create_dir_all(d.join("nested")).unwrap();
                solid(20 + c as u32, 16, 40 * c as u8).save(d.join("a.png")).unwrap();
                solid(24, 30, 40 * c as u8).save(d.join("b.JPG")).unwrap();
                solid(12, 12, 40 * c as u8).save(d.join("nested/c.jpeg")).unwrap();
                std::fs::write(d.join("notes.txt"), "not an image").unwrap();
            }
        }
        std::fs::create_dir_all(tmp.path().join("train/.hidden")).unwrap();
        let s = |p: &str| tmp.path().join(p).to_str().unwrap().to_string();
        (s("train"), s("val"))
    }

    fn transform() -> Transform {
        Transform { size: 8, val_resize: 10, augment: false }
    }

    #[test]
    fn classes_labels_and_decoding() {
        let tmp = TempDir::new("imgfolder");
        let (train, val) = make_tree(&tmp);
        let ds = ImageFolder::open(&train, &val, Split::Train, transform()).unwrap();
        assert_eq!(ds.class_names(), ["cat", "dog", "emu"]);
        assert_eq!(ds.len(), 9);
        for i in 0..ds.len() {
            let (x, s) = crate::data::test_util::get_one(&ds, i, 0).unwrap();
            assert_eq!(x.len(), 3 * 8 * 8);
            let name = ["cat", "dog", "emu"][s.label as usize];
            assert!(ds.describe(i).contains(&format!("/train/{name}/")), "{}", ds.describe(i));
        }
        assert!(ds.describe(2).ends_with("nested/c.jpeg"));
        let v = ImageFolder::open(&train, &val, Split::Val, transform()).unwrap();
        assert_eq!((v.len(), v.num_classes()), (9, 3));
    }

    #[test]
    fn layout_errors_name_the_folder() {
        let tmp = TempDir::new("imgfolder-bad");
        let (train, val) = make_tree(&tmp);
        std::fs::create_dir_all(tmp.path().join("val/fox")).unwrap();
        let e = ImageFolder::open(&train, &val, Split::Train, transform()).err().unwrap().to_string();
        assert!(e.contains("class folders differ") && e.contains("fox") && e.contains(&val), "{e}");
        let e = ImageFolder::open(&train, &val, Split::Val, transform()).err().unwrap().to_string();
        assert!(e.contains("fox"), "{e}");
        let e = ImageFolder::open(&train, "", Split::Val, transform()).err().unwrap().to_string();
        assert!(e.contains("data.val_dir"), "{e}");
        let e = ImageFolder::open("/nonexistent/imgs", "", Split::Train, transform()).err().unwrap().to_string();
        assert!(e.contains("/nonexistent/imgs"), "{e}");
        let empty = tmp.path().join("empty");
        std::fs::create_dir_all(empty.join("cls")).unwrap();
        let e = ImageFolder::open(empty.to_str().unwrap(), "", Split::Train, transform()).err().unwrap().to_string();
        assert!(e.contains("empty/cls") && e.contains("no .jpg"), "{e}");
        std::fs::write(empty.join("loose.png"), b"x").unwrap();
        std::fs::remove_dir(empty.join("cls")).unwrap();
        let e = ImageFolder::open(empty.to_str().unwrap(), "", Split::Train, transform()).err().unwrap().to_string();
        assert!(e.contains("no class sub-folders") && e.contains("empty"), "{e}");
        // A symlinked folder is followed, unless it leads back above itself (it would list other classes' images).
        #[cfg(unix)]
        {
            let elsewhere = tmp.path().join("more");
            std::fs::create_dir_all(&elsewhere).unwrap();
            solid(9, 9, 7).save(elsewhere.join("d.png")).unwrap();
            std::os::unix::fs::symlink(&elsewhere, tmp.path().join("train/dog/more")).unwrap();
            std::fs::remove_dir_all(tmp.path().join("val/fox")).unwrap();
            let ds = ImageFolder::open(&train, &val, Split::Train, transform()).unwrap();
            assert_eq!(ds.len(), 10);
            std::os::unix::fs::symlink("..", tmp.path().join("train/dog/loop")).unwrap();
            let e = ImageFolder::open(&train, &val, Split::Train, transform()).err().unwrap().to_string();
            assert!(e.contains("train/dog/loop") && e.contains("symlink loop"), "{e}");
        }
    }

    #[test]
    fn corrupt_jpeg_errors_or_is_skipped() {
        let tmp = TempDir::new("imgfolder-corrupt");
        let (train, val) = make_tree(&tmp);
        let bad = tmp.path().join("train/dog/bad.jpg");
        let mut junk = vec![0u8; 500];
        ChaCha8Rng::seed_from_u64(9).fill_bytes(&mut junk);
        std::fs::write(&bad, junk).unwrap();
        let ds: Arc<dyn Dataset> = Arc::new(ImageFolder::open(&train, &val, Split::Train, transform()).unwrap());
        assert_eq!(ds.len(), 10);
        let opts = |skip_corrupt| LoaderOptions {
            batch_size: 4,
            shuffle: true,
            seed: 1,
            epoch: 0,
            workers: 2,
            prefetch: 2,
            skip_corrupt,
            skip_batches: 0,
            shard: None,
        };
        let results: Vec<_> = Loader::new(ds.clone(), opts(false)).collect();
        let e = results.iter().find_map(|r| r.as_ref().err()).expect("an error").to_string();
        assert!(e.contains("cannot decode image") && e.contains(&bad.display().to_string()), "{e}");
        assert!(results.last().unwrap().is_err(), "iteration stops at the error");

        let batches: Vec<_> = Loader::new(ds, opts(true)).map(|b| b.unwrap()).collect();
        assert_eq!(batches.iter().map(|b| b.n).collect::<Vec<_>>(), [4, 4, 2]);
        assert!(batches.iter().flat_map(|b| &b.labels).all(|&l| l < 3));
    }
}
