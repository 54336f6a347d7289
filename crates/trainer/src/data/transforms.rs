//! Image transforms on RGB u8 images: the sample's geometry (RandomResizedCrop, pad + crop, validation resize +
//! centre crop) drawn before decoding, then rendered with a SIMD resizer. Normalisation and the flip happen with
//! the conversion to the network input (`kernels::input`, on the GPU or the CPU).

use super::{DataError, Split};
use crate::config::{Augment, DataSection};
use fast_image_resize as fir;
use image::imageops::{self, FilterType};
use image::RgbImage;
use rand::Rng;

pub use kernels::input::{MEAN, STD};

/// Above this output size training uses RandomResizedCrop; at or below it pad + random crop (CIFAR style).
pub const SMALL_IMAGE_MAX: u32 = 64;

/// Bilinear (antialiased when shrinking) resize to `w` x `h`; the same size returns the pixels untouched.
pub fn resize(img: RgbImage, w: u32, h: u32) -> RgbImage {
    if img.dimensions() == (w, h) {
        return img;
    }
    imageops::resize(&img, w, h, FilterType::Triangle)
}

/// Resizes so that the shorter side is `short`, keeping the aspect ratio (torchvision `Resize(int)`).
pub fn resize_shorter(img: RgbImage, short: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let (s, l) = (w.min(h).max(1) as u64, w.max(h) as u64);
    let long = ((l * short as u64) / s).max(1) as u32;
    if w <= h {
        resize(img, short, long)
    } else {
        resize(img, long, short)
    }
}

/// The `w` x `h` window whose top-left corner is (`x`, `y`); parts outside the image are zero (black).
pub fn crop(img: &RgbImage, x: i64, y: i64, w: u32, h: u32) -> RgbImage {
    let (iw, ih) = (img.width() as i64, img.height() as i64);
    let mut out = RgbImage::new(w, h);
    // Columns of the output that fall inside the image.
    let (ox0, ox1) = ((-x).clamp(0, w as i64), (iw - x).clamp(0, w as i64));
    if ox0 >= ox1 {
        return out;
    }
    let (src, dst) = (img.as_raw(), &mut *out);
    for oy in 0..h as i64 {
        let sy = y + oy;
        if !(0..ih).contains(&sy) {
            continue;
        }
        let s0 = ((sy * iw + x + ox0) * 3) as usize;
        let d0 = ((oy * w as i64 + ox0) * 3) as usize;
        let n = ((ox1 - ox0) * 3) as usize;
        dst[d0..d0 + n].copy_from_slice(&src[s0..s0 + n]);
    }
    out
}

/// Centre `w` x `h` window; an image smaller than the window is zero-padded around it (as torchvision).
pub fn center_crop(img: &RgbImage, w: u32, h: u32) -> RgbImage {
    let x = (img.width() as i64 - w as i64).div_euclid(2);
    let y = (img.height() as i64 - h as i64).div_euclid(2);
    crop(img, x, y, w, h)
}

/// Zero padding of `p` pixels on every side.
pub fn pad(img: &RgbImage, p: u32) -> RgbImage {
    crop(img, -(p as i64), -(p as i64), img.width() + 2 * p, img.height() + 2 * p)
}

pub fn hflip(img: &RgbImage) -> RgbImage {
    imageops::flip_horizontal(img)
}

/// Pads by `p` with zeros and takes a random `w` x `h` crop of the result (without building the padded image).
pub fn pad_random_crop<R: Rng + ?Sized>(img: &RgbImage, p: u32, w: u32, h: u32, rng: &mut R) -> RgbImage {
    let max_x = (img.width() + 2 * p).saturating_sub(w);
    let max_y = (img.height() + 2 * p).saturating_sub(h);
    let x = rng.random_range(0..=max_x) as i64 - p as i64;
    let y = rng.random_range(0..=max_y) as i64 - p as i64;
    crop(img, x, y, w, h)
}

/// torchvision `RandomResizedCrop.get_params`: a window of scale (0.08, 1) of the area and aspect ratio (3/4, 4/3),
/// 10 attempts, then a centre crop clamped to the ratio range. Returns (x, y, w, h).
pub fn random_resized_crop_params<R: Rng + ?Sized>(w: u32, h: u32, rng: &mut R) -> (u32, u32, u32, u32) {
    const SCALE: (f64, f64) = (0.08, 1.0);
    const RATIO: (f64, f64) = (3.0 / 4.0, 4.0 / 3.0);
    let area = w as f64 * h as f64;
    let (log_lo, log_hi) = (RATIO.0.ln(), RATIO.1.ln());
    for _ in 0..10 {
        let target = area * rng.random_range(SCALE.0..SCALE.1);
        let aspect = rng.random_range(log_lo..log_hi).exp();
        let cw = (target * aspect).sqrt().round() as u32;
        let ch = (target / aspect).sqrt().round() as u32;
        if 0 < cw && cw <= w && 0 < ch && ch <= h {
            let x = rng.random_range(0..=w - cw);
            let y = rng.random_range(0..=h - ch);
            return (x, y, cw, ch);
        }
    }
    let in_ratio = w as f64 / h.max(1) as f64;
    let (cw, ch) = if in_ratio < RATIO.0 {
        (w, ((w as f64 / RATIO.0).round() as u32).min(h))
    } else if in_ratio > RATIO.1 {
        (((h as f64 * RATIO.1).round() as u32).min(w), h)
    } else {
        (w, h)
    };
    ((w - cw) / 2, (h - ch) / 2, cw, ch)
}

pub fn random_resized_crop<R: Rng + ?Sized>(img: &RgbImage, size: u32, rng: &mut R) -> RgbImage {
    let (x, y, w, h) = random_resized_crop_params(img.width(), img.height(), rng);
    resize(crop(img, x as i64, y as i64, w, h), size, size)
}

/// Geometry of one sample, drawn from the source dimensions alone (before decoding, so that the decoder can skip
/// what the crop does not need).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Plan {
    /// Resize the source window (x, y, w, h), in source pixels (fractional for validation), to size x size.
    Window { x: f64, y: f64, w: f64, h: f64 },
    /// Small-image augmentation: the source-sized window at (x, y) of the zero-padded image, then shorter side to
    /// size and centre crop.
    PadCrop { x: i64, y: i64 },
}

thread_local! {
    /// One SIMD resizer per loader thread (it keeps its scratch buffers between images).
    static RESIZER: std::cell::RefCell<fir::Resizer> = std::cell::RefCell::new(fir::Resizer::new());
}

/// The source window that `resize_shorter(val_resize)` then `center_crop(size)` show (exact: the same sampling
/// positions as resizing the whole image and cropping it).
fn val_window(w: u32, h: u32, size: u32, val_resize: u32) -> Plan {
    let (s, l) = (w.min(h).max(1) as u64, w.max(h) as u64);
    let long = ((l * val_resize as u64) / s).max(1) as u32;
    let (rw, rh) = if w <= h { (val_resize, long) } else { (long, val_resize) };
    let ox = (rw as i64 - size as i64).div_euclid(2) as f64;
    let oy = (rh as i64 - size as i64).div_euclid(2) as f64;
    let (fx, fy) = (w as f64 / rw as f64, h as f64 / rh as f64);
    Plan::Window { x: ox * fx, y: oy * fy, w: size as f64 * fx, h: size as f64 * fy }
}

/// Copies or resizes `window` of the RGB image `src` (sw x sh) into `out` (size x size x 3): a plain copy when the
/// window is whole pixels of the output size, else the antialiased bilinear filter (PIL's / torchvision's
/// `antialias=True`) on the SIMD resizer.
pub fn resize_window_into(
    src: &[u8],
    (sw, sh): (u32, u32),
    (x, y, w, h): (f64, f64, f64, f64),
    size: u32,
    out: &mut [u8],
) -> Result<(), String> {
    let s = size as usize;
    if src.len() < sw as usize * sh as usize * 3 || out.len() != s * s * 3 {
        return Err(format!("{sw}x{sh} source of {} bytes, {size}x{size} output of {} bytes", src.len(), out.len()));
    }
    // Clamp into the image (a DCT-scaled decode rounds its size up, fractions can overshoot by an ulp).
    let x = x.clamp(0.0, sw as f64 - 1.0);
    let y = y.clamp(0.0, sh as f64 - 1.0);
    let w = w.min(sw as f64 - x).max(1e-3);
    let h = h.min(sh as f64 - y).max(1e-3);
    let whole = |v: f64| v.fract() == 0.0;
    if [x, y].into_iter().all(whole) && w == size as f64 && h == size as f64 {
        let (x, y, sw) = (x as usize, y as usize, sw as usize);
        for (r, row) in out.chunks_exact_mut(s * 3).enumerate() {
            let a = ((y + r) * sw + x) * 3;
            row.copy_from_slice(&src[a..a + s * 3]);
        }
        return Ok(());
    }
    let src_img = fir::images::ImageRef::new(sw, sh, src, fir::PixelType::U8x3).map_err(|e| e.to_string())?;
    let mut dst =
        fir::images::Image::from_slice_u8(size, size, out, fir::PixelType::U8x3).map_err(|e| e.to_string())?;
    let opts =
        fir::ResizeOptions::new().resize_alg(fir::ResizeAlg::Convolution(fir::FilterType::Bilinear)).crop(x, y, w, h);
    RESIZER.with(|r| r.borrow_mut().resize(&src_img, &mut dst, &opts)).map_err(|e| e.to_string())
}

/// The per-split pipeline from a decoded image to the network's (not yet normalised) uint8 input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transform {
    pub size: u32,
    pub val_resize: u32,
    /// Train split with augment = "standard".
    pub augment: bool,
}

impl Transform {
    pub fn new(cfg: &DataSection, split: Split) -> Result<Self, DataError> {
        let dim = |key: &str, v: usize| match u32::try_from(v) {
            Ok(v) if (1..=16384).contains(&v) => Ok(v),
            _ => Err(DataError::config(key, format!("{v} is not an image size in 1..=16384"))),
        };
        let augment = match cfg.augment {
            Augment::Standard => split == Split::Train,
            Augment::None => false,
        };
        Ok(Self {
            size: dim("data.image_size", cfg.image_size)?,
            val_resize: dim("data.val_resize", cfg.val_resize)?,
            augment,
        })
    }

    /// The sample's geometry for a `w` x `h` source and whether it is mirrored, drawn from `rng` as torchvision
    /// draws them (the window first, then the flip):
    ///
    /// * augment, size > 64: RandomResizedCrop(size) + horizontal flip (p = 0.5).
    /// * augment, size <= 64: zero-pad 4 output pixels + random crop at the source resolution + flip, then
    ///   shorter side to `size` and centre crop (the identity for 32x32 CIFAR at 32).
    /// * otherwise: shorter side to `val_resize`, centre crop `size`; no random draw.
    pub fn draw<R: Rng + ?Sized>(&self, w: u32, h: u32, rng: &mut R) -> (Plan, bool) {
        let s = self.size;
        if !self.augment {
            return (val_window(w, h, s, self.val_resize), false);
        }
        let plan = if s > SMALL_IMAGE_MAX {
            let (x, y, cw, ch) = random_resized_crop_params(w, h, rng);
            Plan::Window { x: x as f64, y: y as f64, w: cw as f64, h: ch as f64 }
        } else {
            // 4 pixels at the output resolution, expressed at the source resolution.
            let p = ((4 * w.min(h) as u64 + s as u64 / 2) / s as u64).max(1) as u32;
            let max_x = (w + 2 * p).saturating_sub(w);
            let max_y = (h + 2 * p).saturating_sub(h);
            let x = rng.random_range(0..=max_x) as i64 - p as i64;
            let y = rng.random_range(0..=max_y) as i64 - p as i64;
            Plan::PadCrop { x, y }
        };
        (plan, rng.random_bool(0.5))
    }

    /// The coarsest decoding scale 1/k (k = 1, 2, 4, 8) at which the plan's window still has at least `size`
    /// pixels each way, so that resizing it to `size` never enlarges what full-scale decoding would have kept.
    pub fn dct_scale(&self, plan: &Plan) -> u32 {
        match *plan {
            Plan::Window { w, h, .. } => {
                let need = self.size as f64;
                [8u32, 4, 2].into_iter().find(|&k| w / k as f64 >= need && h / k as f64 >= need).unwrap_or(1)
            }
            Plan::PadCrop { .. } => 1,
        }
    }

    /// Renders `plan` from `src`, an RGB image (sw x sh) decoded at 1/`scale` of the plan's source, into `out`
    /// (size x size x 3 bytes).
    pub fn render(
        &self,
        plan: &Plan,
        src: &[u8],
        (sw, sh): (u32, u32),
        scale: u32,
        out: &mut [u8],
    ) -> Result<(), String> {
        match *plan {
            Plan::Window { x, y, w, h } => {
                let k = scale.max(1) as f64;
                resize_window_into(src, (sw, sh), (x / k, y / k, w / k, h / k), self.size, out)
            }
            Plan::PadCrop { x, y } => {
                let img = RgbImage::from_raw(sw, sh, src[..sw as usize * sh as usize * 3].to_vec())
                    .ok_or_else(|| format!("{sw}x{sh} image of {} bytes", src.len()))?;
                let s = self.size;
                let img = center_crop(&resize_shorter(crop(&img, x, y, sw, sh), s), s, s);
                out.copy_from_slice(img.as_raw());
                Ok(())
            }
        }
    }

    /// Draws and renders in one go from a full-resolution image; returns the flip.
    pub fn apply_into<R: Rng + ?Sized>(&self, img: &RgbImage, rng: &mut R, out: &mut [u8]) -> Result<bool, String> {
        let (plan, flip) = self.draw(img.width(), img.height(), rng);
        self.render(&plan, img.as_raw(), img.dimensions(), 1, out)?;
        Ok(flip)
    }

    /// `apply_into` to a new HWC buffer, mirrored when the flip says so (tests, tools).
    pub fn apply_hwc<R: Rng + ?Sized>(&self, img: &RgbImage, rng: &mut R) -> Result<RgbImage, String> {
        let s = self.size;
        let mut out = vec![0u8; (s * s * 3) as usize];
        let flip = self.apply_into(img, rng, &mut out)?;
        let img = RgbImage::from_raw(s, s, out).ok_or("buffer size")?;
        Ok(if flip { hflip(&img) } else { img })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::Rgb;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn ramp(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| Rgb([(x * 7 + y) as u8, (y * 5) as u8, (x ^ y) as u8]))
    }

    #[test]
    fn resize_to_same_size_is_identity() {
        let img = ramp(33, 20);
        assert_eq!(resize(img.clone(), 33, 20), img);
        assert_eq!(resize_shorter(img.clone(), 20), img);
        let t = Transform { size: 32, val_resize: 32, augment: false };
        let sq = ramp(32, 32);
        assert_eq!(t.apply_hwc(&sq, &mut ChaCha8Rng::seed_from_u64(0)).unwrap(), sq);
    }

    #[test]
    fn resize_shorter_keeps_aspect() {
        assert_eq!(resize_shorter(ramp(40, 20), 10).dimensions(), (20, 10));
        assert_eq!(resize_shorter(ramp(30, 45), 20).dimensions(), (20, 30));
        // A constant image stays constant through bilinear resampling.
        let flat = RgbImage::from_pixel(17, 9, Rgb([10, 200, 77]));
        assert!(resize_shorter(flat, 30).pixels().all(|p| p.0 == [10, 200, 77]));
    }

    #[test]
    fn center_crop_geometry() {
        let img = ramp(10, 8);
        let c = center_crop(&img, 4, 2);
        assert_eq!(c.dimensions(), (4, 2));
        assert_eq!(c.get_pixel(0, 0), img.get_pixel(3, 3));
        assert_eq!(c.get_pixel(3, 1), img.get_pixel(6, 4));
        // Larger than the image: zero padding around it.
        let p = center_crop(&ramp(2, 2), 4, 4);
        assert_eq!(p.get_pixel(0, 0).0, [0, 0, 0]);
        assert_eq!(p.get_pixel(1, 1), ramp(2, 2).get_pixel(0, 0));
    }

    #[test]
    fn flip_mirrors_columns() {
        let img = ramp(5, 3);
        let f = hflip(&img);
        for (x, y, px) in img.enumerate_pixels() {
            assert_eq!(f.get_pixel(4 - x, y), px);
        }
    }

    #[test]
    fn pad_and_pad_random_crop() {
        let img = ramp(6, 5);
        let p = pad(&img, 2);
        assert_eq!(p.dimensions(), (10, 9));
        assert_eq!(p.get_pixel(1, 1).0, [0, 0, 0]);
        assert_eq!(p.get_pixel(2, 2), img.get_pixel(0, 0));
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for _ in 0..20 {
            let c = pad_random_crop(&img, 4, 6, 5, &mut rng);
            assert_eq!(c.dimensions(), (6, 5));
            // The crop is a window of the padded image.
            let found = (0..=8).any(|x| (0..=8).any(|y| crop(&pad(&img, 4), x, y, 6, 5) == c));
            assert!(found);
        }
    }

    #[test]
    fn random_resized_crop_stays_inside() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for (w, h) in [(100, 80), (10, 300), (300, 10), (1, 1)] {
            for _ in 0..50 {
                let (x, y, cw, ch) = random_resized_crop_params(w, h, &mut rng);
                assert!(cw > 0 && ch > 0 && x + cw <= w && y + ch <= h, "{w}x{h}: {x},{y} {cw}x{ch}");
            }
        }
        assert_eq!(random_resized_crop(&ramp(50, 40), 96, &mut rng).dimensions(), (96, 96));
    }

    #[test]
    fn transform_output_sizes() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for (size, augment) in [(32, true), (32, false), (96, true), (96, false)] {
            let t = Transform { size, val_resize: size + 8, augment };
            for (w, h) in [(32, 32), (120, 70), (7, 300)] {
                let mut out = vec![0u8; 3 * (size * size) as usize];
                t.apply_into(&ramp(w, h), &mut rng, &mut out).unwrap();
                assert_eq!(t.apply_hwc(&ramp(w, h), &mut rng).unwrap().dimensions(), (size, size));
            }
        }
    }

    /// The validation window equals resize_shorter + center_crop: same pixels up to the filter's rounding.
    #[test]
    fn validation_window_matches_resize_then_crop() {
        let img = ramp(120, 90);
        let t = Transform { size: 64, val_resize: 72, augment: false };
        let got = t.apply_hwc(&img, &mut ChaCha8Rng::seed_from_u64(0)).unwrap();
        let want = center_crop(&resize_shorter(img, 72), 64, 64);
        let worst = got.as_raw().iter().zip(want.as_raw()).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
        assert!(worst <= 12, "max abs difference {worst}");
        let mean = got.as_raw().iter().zip(want.as_raw()).map(|(a, b)| a.abs_diff(*b) as f64).sum::<f64>()
            / got.as_raw().len() as f64;
        assert!(mean < 1.5, "mean abs difference {mean}");
        // A plan at the output size in whole pixels is a plain copy.
        let sq = ramp(64, 64);
        assert_eq!(t.apply_hwc(&sq, &mut ChaCha8Rng::seed_from_u64(0)).unwrap().dimensions(), (64, 64));
        assert_eq!(
            Transform { size: 64, val_resize: 64, augment: false }
                .apply_hwc(&sq, &mut ChaCha8Rng::seed_from_u64(0))
                .unwrap(),
            sq
        );
    }

    /// RandomResizedCrop as torchvision: the window draws, then the flip; the fallback after 10 misses is the
    /// centre crop clamped to the ratio range; windows stay inside; the DCT scale never goes below the output size.
    #[test]
    fn random_resized_crop_semantics_and_fallback() {
        let t = Transform { size: 224, val_resize: 256, augment: true };
        let mut counts = [0usize; 2];
        for seed in 0..200 {
            let mut a = ChaCha8Rng::seed_from_u64(seed);
            let mut b = ChaCha8Rng::seed_from_u64(seed);
            let (plan, flip) = t.draw(500, 375, &mut a);
            let (x, y, w, h) = random_resized_crop_params(500, 375, &mut b);
            assert_eq!(plan, Plan::Window { x: x as f64, y: y as f64, w: w as f64, h: h as f64 });
            assert_eq!(flip, b.random_bool(0.5), "the flip is drawn after the window");
            counts[usize::from(flip)] += 1;
            let area = (w * h) as f64 / (500.0 * 375.0);
            let ratio = w as f64 / h as f64;
            assert!((0.079..=1.0).contains(&area) && x + w <= 500 && y + h <= 375, "{plan:?}");
            assert!((0.74..=1.34).contains(&ratio), "{plan:?}");
            assert_eq!(t.dct_scale(&plan), 1, "500x375 at 224 never allows a scaled decode");
        }
        assert!(counts[0] > 60 && counts[1] > 60, "{counts:?}");
        // An extreme aspect ratio misses all 10 tries: the centre crop clamped to ratio 4/3 (torchvision's fallback).
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(random_resized_crop_params(1000, 10, &mut rng), (493, 0, 13, 10));
        assert_eq!(random_resized_crop_params(10, 1000, &mut rng), (0, 493, 10, 13));
        // A 1x1 image has one window.
        assert_eq!(random_resized_crop_params(1, 1, &mut rng), (0, 0, 1, 1));
        // Large windows decode at 1/2, 1/4, 1/8 while the window keeps >= 224 pixels each way.
        let w = |s: f64| Plan::Window { x: 0.0, y: 0.0, w: s, h: s };
        assert_eq!(
            [t.dct_scale(&w(447.0)), t.dct_scale(&w(448.0)), t.dct_scale(&w(900.0)), t.dct_scale(&w(1792.0))],
            [1, 2, 4, 8]
        );
        let v = Transform { size: 224, val_resize: 256, augment: false };
        // Validation of a 2048x1536 image: the window is 1344 source pixels, 1/4 scale keeps 336 >= 224.
        let (plan, flip) = v.draw(2048, 1536, &mut rng);
        assert!(!flip);
        assert_eq!(v.dct_scale(&plan), 4, "{plan:?}");
    }
}
