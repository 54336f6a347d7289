//! "packed": an image folder converted by `trainer prepare` into a few large shard files plus an index (FFCV-style),
//! images re-encoded as JPEG at a maximum side, read through mmap. Access is by sample index, so the loader's
//! order, resume position and (later) sharding across ranks work as for any dataset.
//!
//! Layout of `<dir>/<split>/` (all integers little-endian):
//!
//! * `index.bin`: magic `RSNPKIDX`, version u32, shards u32, samples u64, classes u32, max_side u32, names bytes
//!   u64 (= 40-byte header); one 24-byte record per sample (shard u32, label u32, offset u64, length u32, width
//!   u16, height u16); the class names and then each sample's source path (relative to its class folder's parent),
//!   each as a u32 length and UTF-8 bytes.
//! * `shard-NNNNN.bin`: magic `RSNPKSHD`, version u32, shard number u32, data bytes u64 (= 24-byte header), then
//!   the encoded images back to back (offsets are relative to the data).

use super::imagefolder::ImageFolder;
use super::{decode, DataError, Dataset, Sample, Split, StageNanos, Transform};
use fast_image_resize as fir;
use memmap2::Mmap;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const INDEX_MAGIC: &[u8; 8] = b"RSNPKIDX";
pub const SHARD_MAGIC: &[u8; 8] = b"RSNPKSHD";
pub const VERSION: u32 = 1;
const INDEX_HEADER: usize = 40;
const RECORD: usize = 24;
const SHARD_HEADER: usize = 24;
const HINT: &str = "; write it with `trainer prepare --config F --out DIR` and set data.dir to DIR";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    shard: u32,
    label: u32,
    offset: u64,
    len: u32,
    width: u16,
    height: u16,
}

pub struct Packed {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    records: Vec<Record>,
    classes: Vec<String>,
    names: Vec<String>,
    max_side: u32,
    transform: Transform,
}

/// A little-endian reader over a byte slice that reports what was cut short.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|s| u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|s| u32::from_le_bytes(s.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|s| u64::from_le_bytes(s.try_into().unwrap_or_default()))
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        self.take(n).map(|s| String::from_utf8_lossy(s).into_owned())
    }
}

pub fn shard_name(i: usize) -> String {
    format!("shard-{i:05}.bin")
}

impl Packed {
    /// Opens `<root>/train` or `<root>/val` (`root` is `data.dir`).
    pub fn open_split(root: &str, split: Split, transform: Transform) -> Result<Self, DataError> {
        if root.is_empty() {
            return Err(DataError::config("data.dir", format!("is empty (packed needs the folder of shards){HINT}")));
        }
        if !Path::new(root).is_dir() {
            return Err(DataError::Missing {
                path: format!("packed data.dir {root}"),
                hint: format!(" (or is not a folder){HINT}"),
            });
        }
        Self::open(&Path::new(root).join(split.name()), transform)
    }

    /// Opens one packed split folder, checking the index and every shard (magic, version, sizes, record bounds).
    pub fn open(dir: &Path, transform: Transform) -> Result<Self, DataError> {
        let index_path = dir.join("index.bin");
        if !index_path.is_file() {
            return Err(DataError::Missing {
                path: format!("packed index {}", index_path.display()),
                hint: HINT.into(),
            });
        }
        let bytes = std::fs::read(&index_path).map_err(|e| DataError::io(&index_path, e))?;
        let bad = |msg: String| DataError::format(&index_path, msg);
        let mut c = Cursor { b: &bytes, at: 0 };
        let short = || DataError::format(&index_path, format!("truncated ({} bytes)", bytes.len()));
        let magic = c.take(8).ok_or_else(short)?;
        if magic != INDEX_MAGIC {
            return Err(bad("not a packed index (bad magic; written by `trainer prepare`?)".into()));
        }
        let version = c.u32().ok_or_else(short)?;
        if version != VERSION {
            return Err(bad(format!(
                "format version {version}, this trainer reads version {VERSION} (run `trainer prepare` again)"
            )));
        }
        let num_shards = c.u32().ok_or_else(short)? as usize;
        let num_samples = c.u64().ok_or_else(short)?;
        let num_classes = c.u32().ok_or_else(short)? as usize;
        let max_side = c.u32().ok_or_else(short)?;
        let names_bytes = c.u64().ok_or_else(short)?;
        let expect = (num_samples as u128) * RECORD as u128 + names_bytes as u128 + INDEX_HEADER as u128;
        if expect != bytes.len() as u128 {
            return Err(bad(format!(
                "{} bytes, but its header says {num_samples} samples and {names_bytes} bytes of names ({expect} bytes): \
                 truncated or corrupt",
                bytes.len()
            )));
        }
        let num_samples = num_samples as usize;
        let mut records = Vec::with_capacity(num_samples);
        for _ in 0..num_samples {
            let r = (|| {
                Some(Record {
                    shard: c.u32()?,
                    label: c.u32()?,
                    offset: c.u64()?,
                    len: c.u32()?,
                    width: c.u16()?,
                    height: c.u16()?,
                })
            })()
            .ok_or_else(short)?;
            records.push(r);
        }
        let classes: Vec<String> = (0..num_classes).map(|_| c.string()).collect::<Option<_>>().ok_or_else(short)?;
        let names: Vec<String> = (0..num_samples).map(|_| c.string()).collect::<Option<_>>().ok_or_else(short)?;
        if c.at != bytes.len() {
            return Err(bad(format!("{} bytes left over after the names", bytes.len() - c.at)));
        }
        if num_classes == 0 || num_samples == 0 {
            return Err(bad("holds no samples or no classes".into()));
        }
        if num_shards == 0 || num_shards > num_samples {
            return Err(bad(format!("its header says {num_shards} shards for {num_samples} samples (corrupt)")));
        }
        let mut shards = Vec::with_capacity(num_shards);
        for i in 0..num_shards {
            let path = dir.join(shard_name(i));
            if path.is_dir() {
                return Err(DataError::format(&path, "is a folder, not a packed shard"));
            }
            let file = std::fs::File::open(&path).map_err(|e| DataError::io(&path, e))?;
            // SAFETY: the shard is only read; `trainer prepare` never rewrites a shard a reader has open (it
            // writes a new set), and a file truncated under a reader is outside what this format guards.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(&path, e))?;
            let sbad = |msg: String| DataError::format(&path, msg);
            let mut sc = Cursor { b: &map, at: 0 };
            let hdr = (|| Some((sc.take(8)?, sc.u32()?, sc.u32()?, sc.u64()?)))();
            let Some((magic, version, number, data_len)) = hdr else {
                return Err(sbad(format!(
                    "truncated: {} bytes, shorter than the {SHARD_HEADER}-byte header",
                    map.len()
                )));
            };
            if magic != SHARD_MAGIC {
                return Err(sbad("not a packed shard (bad magic)".into()));
            }
            if version != VERSION {
                return Err(sbad(format!("format version {version}, this trainer reads version {VERSION}")));
            }
            if number as usize != i {
                return Err(sbad(format!("is shard {number}, expected {i} (shards mixed up between packs?)")));
            }
            if data_len as u128 + SHARD_HEADER as u128 != map.len() as u128 {
                return Err(sbad(format!(
                    "{} bytes, its header says {} (truncated or corrupt)",
                    map.len(),
                    data_len as u128 + SHARD_HEADER as u128
                )));
            }
            shards.push((path, map));
        }
        for (i, r) in records.iter().enumerate() {
            let Some((path, map)) = shards.get(r.shard as usize) else {
                return Err(bad(format!("sample #{i} is in shard {} of {num_shards}", r.shard)));
            };
            if r.offset as u128 + r.len as u128 + SHARD_HEADER as u128 > map.len() as u128 {
                return Err(DataError::format(
                    path,
                    format!("sample #{i} ({}) ends past the end of the shard (truncated?)", names[i]),
                ));
            }
            if r.label as usize >= num_classes {
                return Err(bad(format!("sample #{i} has label {} of {num_classes} classes", r.label)));
            }
        }
        Ok(Self { dir: dir.to_path_buf(), shards, records, classes, names, max_side, transform })
    }

    /// The longest side images were re-encoded at.
    pub fn max_side(&self) -> u32 {
        self.max_side
    }

    /// The stored (encoded) bytes of sample `index`.
    pub fn bytes(&self, index: usize) -> Option<&[u8]> {
        let r = self.records.get(index)?;
        let (_, map) = self.shards.get(r.shard as usize)?;
        let a = SHARD_HEADER + r.offset as usize;
        map.get(a..a + r.len as usize)
    }

    /// Source image dimensions as packed (after the max-side resize).
    pub fn dims(&self, index: usize) -> Option<(u32, u32)> {
        self.records.get(index).map(|r| (r.width as u32, r.height as u32))
    }
}

impl Dataset for Packed {
    fn len(&self) -> usize {
        self.records.len()
    }

    fn num_classes(&self) -> usize {
        self.classes.len()
    }

    fn image_size(&self) -> usize {
        self.transform.size as usize
    }

    fn get(&self, index: usize, rng: &mut ChaCha8Rng, out: &mut [u8], t: &mut StageNanos) -> Result<Sample, DataError> {
        let bytes = self
            .bytes(index)
            .ok_or_else(|| DataError::Loader(format!("packed index {index} is out of range (len {})", self.len())))?;
        let label = self.records[index].label;
        let flip = decode::load_into(bytes, &|| self.describe(index), &self.transform, rng, out, t)?;
        Ok(Sample { label, flip })
    }

    fn describe(&self, index: usize) -> String {
        match (self.records.get(index), self.names.get(index)) {
            (Some(r), Some(name)) => {
                format!("{} #{index} ({}, from {name})", self.dir.display(), shard_name(r.shard as usize))
            }
            _ => format!("{} #{index}", self.dir.display()),
        }
    }

    fn class_names(&self) -> Vec<String> {
        self.classes.clone()
    }
}

/// How `trainer prepare` packs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackOptions {
    /// Longest side of the stored images; larger images are shrunk (aspect kept) and re-encoded.
    pub max_side: u32,
    /// JPEG quality of re-encoded images.
    pub quality: u8,
    /// A new shard starts once a shard holds this many bytes.
    pub shard_bytes: u64,
    /// Encoding threads (0: one per core).
    pub workers: usize,
    /// Leave out (with a warning) images that cannot be decoded instead of stopping.
    pub skip_corrupt: bool,
}

/// What one packed split holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackReport {
    pub dir: PathBuf,
    pub samples: usize,
    pub skipped: usize,
    pub shards: usize,
    pub bytes: u64,
    pub reencoded: usize,
}

/// One image as stored: the original JPEG when it already fits (baseline, 1 or 3 components, decodable), else
/// decoded, shrunk to `max_side` and re-encoded. Returns (bytes, width, height, re-encoded).
pub fn encode_for_pack(bytes: &[u8], opts: &PackOptions) -> Result<(Vec<u8>, u32, u32, bool), String> {
    if let Some(h) = decode::jpeg_header(bytes) {
        let fits = h.width.max(h.height) <= opts.max_side;
        if fits && !h.progressive && matches!(h.components, 1 | 3) {
            // Decode once to be sure it is readable: a corrupt file is reported now, not in the middle of training.
            decode::decode_jpeg_full(bytes)?;
            return Ok((bytes.to_vec(), h.width, h.height, false));
        }
    }
    let (rgb, w, h) = if decode::is_jpeg(bytes) {
        let d = decode::decode_jpeg_full(bytes)?;
        (d.rgb, d.width, d.height)
    } else {
        let img = image::load_from_memory(bytes).map_err(|e| e.to_string())?.into_rgb8();
        let (w, h) = img.dimensions();
        (img.into_raw(), w, h)
    };
    let long = w.max(h);
    let (nw, nh) = if long > opts.max_side {
        let f = opts.max_side as f64 / long as f64;
        (((w as f64 * f).round() as u32).max(1), ((h as f64 * f).round() as u32).max(1))
    } else {
        (w, h)
    };
    let pixels = if (nw, nh) == (w, h) {
        rgb
    } else {
        let src = fir::images::ImageRef::new(w, h, &rgb, fir::PixelType::U8x3).map_err(|e| e.to_string())?;
        let mut dst = fir::images::Image::new(nw, nh, fir::PixelType::U8x3);
        let o = fir::ResizeOptions::new().resize_alg(fir::ResizeAlg::Convolution(fir::FilterType::Bilinear));
        fir::Resizer::new().resize(&src, &mut dst, &o).map_err(|e| e.to_string())?;
        dst.into_vec()
    };
    if nw > u16::MAX as u32 || nh > u16::MAX as u32 {
        return Err(format!("{nw}x{nh} is larger than the packed format's 65535 pixels a side"));
    }
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, opts.quality)
        .encode(&pixels, nw, nh, image::ExtendedColorType::Rgb8)
        .map_err(|e| e.to_string())?;
    Ok((out, nw, nh, true))
}

struct ShardWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    number: u32,
    len: u64,
}

impl ShardWriter {
    fn create(dir: &Path, number: u32) -> Result<Self, DataError> {
        let path = dir.join(shard_name(number as usize));
        let file = std::fs::File::create(&path).map_err(|e| DataError::io(&path, e))?;
        let mut w = Self { file: std::io::BufWriter::with_capacity(1 << 20, file), path, number, len: 0 };
        w.header()?;
        Ok(w)
    }

    fn header(&mut self) -> Result<(), DataError> {
        let mut h = Vec::with_capacity(SHARD_HEADER);
        h.extend_from_slice(SHARD_MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&self.number.to_le_bytes());
        h.extend_from_slice(&self.len.to_le_bytes());
        self.file.write_all(&h).map_err(|e| DataError::io(&self.path, e))
    }

    fn append(&mut self, bytes: &[u8]) -> Result<u64, DataError> {
        let at = self.len;
        self.file.write_all(bytes).map_err(|e| DataError::io(&self.path, e))?;
        self.len += bytes.len() as u64;
        Ok(at)
    }

    /// Rewrites the header with the final data length, flushes and syncs.
    fn finish(mut self) -> Result<u64, DataError> {
        use std::io::Seek;
        let io = |e| DataError::io(&self.path, e);
        self.file.flush().map_err(io)?;
        self.file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        self.header()?;
        self.file.flush().map_err(|e| DataError::io(&self.path, e))?;
        self.file.get_ref().sync_all().map_err(|e| DataError::io(&self.path, e))?;
        Ok(self.len)
    }
}

/// Packs one image folder split into `dir` (created; an earlier pack there is replaced). The index is written
/// last, to a temporary file renamed into place, so an interrupted run leaves no index that names missing data.
pub fn pack_folder(folder: &ImageFolder, dir: &Path, opts: &PackOptions) -> Result<PackReport, DataError> {
    std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
    let index_path = dir.join("index.bin");
    if index_path.exists() {
        std::fs::remove_file(&index_path).map_err(|e| DataError::io(&index_path, e))?;
    }
    for entry in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let p = entry.map_err(|e| DataError::io(dir, e))?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.starts_with("shard-") && name.ends_with(".bin") {
            std::fs::remove_file(&p).map_err(|e| DataError::io(&p, e))?;
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.workers)
        .build()
        .map_err(|e| DataError::Loader(format!("cannot start {} threads: {e}", opts.workers)))?;
    let mut records = Vec::with_capacity(folder.len());
    let mut names = Vec::with_capacity(folder.len());
    let mut shard = ShardWriter::create(dir, 0)?;
    let (mut skipped, mut reencoded, mut total) = (0, 0, 0u64);
    const CHUNK: usize = 256;
    for start in (0..folder.len()).step_by(CHUNK) {
        let ids: Vec<usize> = (start..(start + CHUNK).min(folder.len())).collect();
        let encoded: Vec<_> = pool.install(|| {
            ids.par_iter()
                .map(|&i| {
                    let (path, label) = folder.sample(i).ok_or_else(|| DataError::Loader(format!("index {i}")))?;
                    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
                    let enc = encode_for_pack(&bytes, opts)
                        .map_err(|m| DataError::Decode { path: path.display().to_string(), msg: super::one_line(&m) });
                    Ok((i, label, enc))
                })
                .collect::<Result<Vec<_>, DataError>>()
        })?;
        for (i, label, enc) in encoded {
            let (bytes, w, h, re) = match enc {
                Ok(v) => v,
                Err(e) if opts.skip_corrupt => {
                    eprintln!("warning: {e}; left out of the pack (data.on_corrupt = \"skip\")");
                    skipped += 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if shard.len > 0 && shard.len + bytes.len() as u64 > opts.shard_bytes {
                let number = shard.number + 1;
                total += shard.finish()?;
                shard = ShardWriter::create(dir, number)?;
            }
            let offset = shard.append(&bytes)?;
            reencoded += usize::from(re);
            let len = u32::try_from(bytes.len())
                .map_err(|_| DataError::Loader(format!("{} is over 4 GiB encoded", folder.describe(i))))?;
            records.push(Record { shard: shard.number, label, offset, len, width: w as u16, height: h as u16 });
            let (path, _) = folder.sample(i).ok_or_else(|| DataError::Loader(format!("index {i}")))?;
            names.push(relative_name(path));
        }
    }
    let shards = shard.number as usize + 1;
    total += shard.finish()?;
    if records.is_empty() {
        return Err(DataError::Loader(format!("no image of {} could be packed", dir.display())));
    }
    let mut names_blob = Vec::new();
    for s in folder.class_names().iter().chain(&names) {
        names_blob.extend_from_slice(&(s.len() as u32).to_le_bytes());
        names_blob.extend_from_slice(s.as_bytes());
    }
    let mut index = Vec::with_capacity(INDEX_HEADER + records.len() * RECORD + names_blob.len());
    index.extend_from_slice(INDEX_MAGIC);
    index.extend_from_slice(&VERSION.to_le_bytes());
    index.extend_from_slice(&(shards as u32).to_le_bytes());
    index.extend_from_slice(&(records.len() as u64).to_le_bytes());
    index.extend_from_slice(&(folder.num_classes() as u32).to_le_bytes());
    index.extend_from_slice(&opts.max_side.to_le_bytes());
    index.extend_from_slice(&(names_blob.len() as u64).to_le_bytes());
    for r in &records {
        index.extend_from_slice(&r.shard.to_le_bytes());
        index.extend_from_slice(&r.label.to_le_bytes());
        index.extend_from_slice(&r.offset.to_le_bytes());
        index.extend_from_slice(&r.len.to_le_bytes());
        index.extend_from_slice(&r.width.to_le_bytes());
        index.extend_from_slice(&r.height.to_le_bytes());
    }
    index.extend_from_slice(&names_blob);
    let tmp = dir.join("index.bin.tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&index)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &index_path)
    };
    write().map_err(|e| DataError::io(&index_path, e))?;
    Ok(PackReport { dir: dir.to_path_buf(), samples: records.len(), skipped, shards, bytes: total, reencoded })
}

/// `class/file.jpg` (the last two components) for messages.
fn relative_name(path: &Path) -> String {
    let comps: Vec<_> = path.components().rev().take(2).collect();
    comps.iter().rev().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::imagefolder::tests::make_tree;
    use crate::data::loader::{Loader, LoaderOptions};
    use crate::data::test_util::{get_one, TempDir};
    use std::sync::Arc;

    fn transform(augment: bool) -> Transform {
        Transform { size: 8, val_resize: 10, augment }
    }

    fn opts() -> PackOptions {
        PackOptions { max_side: 32, quality: 90, shard_bytes: 1500, workers: 2, skip_corrupt: false }
    }

    fn pack(tmp: &TempDir, o: &PackOptions) -> (ImageFolder, PathBuf) {
        let (train, val) = make_tree(tmp);
        let folder = ImageFolder::open(&train, &val, Split::Train, transform(true)).unwrap();
        let dir = tmp.path().join("packed/train");
        let r = pack_folder(&folder, &dir, o).unwrap();
        assert_eq!((r.samples, r.skipped), (9, 0));
        assert!(r.shards >= 2, "small shards: {r:?}");
        (folder, dir)
    }

    fn loader_opts(skip_batches: usize) -> LoaderOptions {
        LoaderOptions {
            batch_size: 2,
            shuffle: true,
            seed: 4,
            epoch: 1,
            workers: 2,
            prefetch: 2,
            skip_corrupt: false,
            skip_batches,
            shard: None,
        }
    }

    #[test]
    fn round_trip_labels_pixels_and_resume_position() {
        let tmp = TempDir::new("packed");
        let (folder, dir) = pack(&tmp, &opts());
        let p = Packed::open(&dir, transform(true)).unwrap();
        assert_eq!((p.len(), p.num_classes(), p.class_names()), (9, 3, folder.class_names()));
        assert_eq!(p.max_side(), 32);
        for i in 0..p.len() {
            // Same label, and the same training crop as the folder: JPEGs that fit are stored as they are, PNGs
            // re-encoded at quality 90 (close).
            let (a, sa) = get_one(&p, i, 7).unwrap();
            let (b, sb) = get_one(&folder, i, 7).unwrap();
            assert_eq!(sa, sb);
            let path = folder.path(i).unwrap().display().to_string();
            let worst = a.iter().zip(&b).map(|(x, y)| x.abs_diff(*y)).max().unwrap();
            if path.ends_with(".png") {
                assert!(worst <= 40, "{path}: {worst}");
            } else {
                assert_eq!(a, b, "{path}");
            }
            assert!(p.describe(i).contains(&dir.display().to_string()) && p.describe(i).contains("shard-"));
            let (w, h) = p.dims(i).unwrap();
            assert!(w.max(h) <= 32);
        }
        // Resume: skipping the first batches gives exactly the rest of the uninterrupted epoch.
        let ds: Arc<dyn Dataset> = Arc::new(p);
        let full: Vec<_> = Loader::new(ds.clone(), loader_opts(0)).map(Result::unwrap).collect();
        let rest: Vec<_> = Loader::new(ds.clone(), loader_opts(2)).map(Result::unwrap).collect();
        assert_eq!(full.len(), 5);
        assert_eq!(rest, full[2..]);
        // Through the config: data.kind = "packed", data.dir = the prepare output.
        let cfg = crate::config::DataSection {
            kind: crate::config::DataKind::Packed,
            dir: tmp.path().join("packed").display().to_string(),
            image_size: 8,
            val_resize: 10,
            ..Default::default()
        };
        assert_eq!(crate::data::open(&cfg, Split::Train, 0, 3).unwrap().len(), 9);
        let e = crate::data::open(&cfg, Split::Val, 0, 3).err().unwrap().to_string();
        assert!(e.contains("packed/val/index.bin") && e.contains("trainer prepare"), "{e}");
    }

    #[test]
    fn large_images_are_shrunk_and_reencoded() {
        let tmp = TempDir::new("packed-shrink");
        let o = PackOptions { max_side: 16, shard_bytes: 1 << 20, ..opts() };
        let (_, dir) = pack(&tmp, &PackOptions { shard_bytes: 1500, ..o.clone() });
        let p = Packed::open(&dir, transform(false)).unwrap();
        for i in 0..p.len() {
            let (w, h) = p.dims(i).unwrap();
            assert!(w.max(h) <= 16, "{w}x{h}");
            let hdr = decode::jpeg_header(p.bytes(i).unwrap()).unwrap();
            assert_eq!((hdr.width, hdr.height), (w, h));
        }
        // 24x30 -> 13x16 (aspect kept).
        assert!((0..p.len()).any(|i| p.dims(i) == Some((13, 16))));
    }

    #[test]
    fn corrupt_truncated_and_foreign_files_are_named() {
        let tmp = TempDir::new("packed-bad");
        let (_, dir) = pack(&tmp, &opts());
        let open_err = || Packed::open(&dir, transform(false)).err().expect("an error").to_string();
        let shard0 = dir.join("shard-00000.bin");
        let good = std::fs::read(&shard0).unwrap();
        // Truncated shard.
        std::fs::write(&shard0, &good[..good.len() - 10]).unwrap();
        let e = open_err();
        assert!(e.contains("shard-00000.bin") && e.contains("truncated"), "{e}");
        std::fs::write(&shard0, &good[..10]).unwrap();
        let e = open_err();
        assert!(e.contains("shard-00000.bin") && e.contains("header"), "{e}");
        // Foreign file.
        let mut foreign = good.clone();
        foreign[..8].copy_from_slice(b"GIF89a\0\0");
        std::fs::write(&shard0, &foreign).unwrap();
        let e = open_err();
        assert!(e.contains("shard-00000.bin") && e.contains("bad magic"), "{e}");
        // Newer version.
        let mut newer = good.clone();
        newer[8..12].copy_from_slice(&7u32.to_le_bytes());
        std::fs::write(&shard0, &newer).unwrap();
        let e = open_err();
        assert!(e.contains("shard-00000.bin") && e.contains("version 7"), "{e}");
        std::fs::write(&shard0, &good).unwrap();
        assert!(Packed::open(&dir, transform(false)).is_ok());
        // Missing shard.
        let shard1 = dir.join("shard-00001.bin");
        let s1 = std::fs::read(&shard1).unwrap();
        std::fs::remove_file(&shard1).unwrap();
        let e = open_err();
        assert!(e.contains("shard-00001.bin"), "{e}");
        std::fs::write(&shard1, &s1).unwrap();
        // Truncated or foreign index.
        let index = dir.join("index.bin");
        let idx = std::fs::read(&index).unwrap();
        std::fs::write(&index, &idx[..idx.len() - 3]).unwrap();
        let e = open_err();
        assert!(e.contains("index.bin") && e.contains("truncated"), "{e}");
        std::fs::write(&index, &idx[..20]).unwrap();
        let e = open_err();
        assert!(e.contains("index.bin") && e.contains("truncated"), "{e}");
        std::fs::write(&index, b"hello").unwrap();
        let e = open_err();
        assert!(e.contains("index.bin") && e.contains("truncated"), "{e}");
        let mut foreign = idx.clone();
        foreign[0] = b'X';
        std::fs::write(&index, &foreign).unwrap();
        let e = open_err();
        assert!(e.contains("index.bin") && e.contains("magic"), "{e}");
        // A shard count no pack has (the header's third field).
        let mut shards = idx.clone();
        shards[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        std::fs::write(&index, &shards).unwrap();
        let e = open_err();
        assert!(e.contains("index.bin") && e.contains("4294967295 shards for 9 samples"), "{e}");
        std::fs::write(&index, &idx).unwrap();
        // Corrupt image bytes inside a shard: the sample is named at load time (error), or skipped.
        let p = Packed::open(&dir, transform(false)).unwrap();
        let r = p.records[0];
        drop(p);
        let mut bad = std::fs::read(dir.join(shard_name(r.shard as usize))).unwrap();
        let a = SHARD_HEADER + r.offset as usize;
        bad[a..a + r.len as usize].fill(0x55);
        std::fs::write(dir.join(shard_name(r.shard as usize)), &bad).unwrap();
        let p = Packed::open(&dir, transform(false)).unwrap();
        let e = get_one(&p, 0, 0).err().unwrap().to_string();
        assert!(e.contains("cannot decode image") && e.contains("#0") && e.contains("from "), "{e}");
        let ds: Arc<dyn Dataset> = Arc::new(p);
        let skip = LoaderOptions { skip_corrupt: true, ..loader_opts(0) };
        let n: usize = Loader::new(ds, skip).map(|b| b.unwrap().n).sum();
        assert_eq!(n, 9);
    }

    #[test]
    fn corrupt_source_image_is_named_or_left_out_when_packing() {
        let tmp = TempDir::new("packed-src");
        let (train, val) = make_tree(&tmp);
        let bad = tmp.path().join("train/dog/zz.jpg");
        std::fs::write(&bad, b"\xFF\xD8\xFF\xE0 not really a jpeg").unwrap();
        let folder = ImageFolder::open(&train, &val, Split::Train, transform(false)).unwrap();
        let dir = tmp.path().join("p");
        let e = pack_folder(&folder, &dir, &opts()).err().unwrap().to_string();
        assert!(e.contains(&bad.display().to_string()), "{e}");
        assert!(!dir.join("index.bin").exists(), "no index after a failed pack");
        let r = pack_folder(&folder, &dir, &PackOptions { skip_corrupt: true, ..opts() }).unwrap();
        assert_eq!((r.samples, r.skipped), (9, 1));
        assert_eq!(Packed::open(&dir, transform(false)).unwrap().len(), 9);
    }
}
