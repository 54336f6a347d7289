//! Image transforms on RGB u8 images (resize, crops, flip, padding) and ImageNet normalisation to CHW f32.

use super::{DataError, Split};
use crate::config::DataSection;
use image::imageops::{self, FilterType};
use image::RgbImage;
use rand::Rng;

pub const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
pub const STD: [f32; 3] = [0.229, 0.224, 0.225];

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

/// CHW f32: pixels scaled to [0, 1], minus the ImageNet mean, over the ImageNet std.
pub fn normalize(img: &RgbImage) -> Vec<f32> {
    let n = img.width() as usize * img.height() as usize;
    let mut out = vec![0f32; 3 * n];
    for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = (px[c] as f32 / 255.0 - MEAN[c]) / STD[c];
        }
    }
    out
}

/// The per-split pipeline from a decoded image to the network's input.
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
        let augment = match cfg.augment.as_str() {
            "standard" => split == Split::Train,
            "none" => false,
            other => {
                return Err(DataError::config("data.augment", format!("\"{other}\" is not one of none, standard")))
            }
        };
        Ok(Self {
            size: dim("data.image_size", cfg.image_size)?,
            val_resize: dim("data.val_resize", cfg.val_resize)?,
            augment,
        })
    }

    /// Geometry only (the image before normalisation).
    ///
    /// * augment, size > 64: RandomResizedCrop(size) + horizontal flip (p = 0.5).
    /// * augment, size <= 64: zero-pad 4 output pixels + random crop at the source resolution + flip, then
    ///   shorter side to `size` and centre crop (the identity for 32x32 CIFAR at 32).
    /// * otherwise: shorter side to `val_resize`, centre crop `size`.
    pub fn geometry<R: Rng + ?Sized>(&self, img: RgbImage, rng: &mut R) -> RgbImage {
        let s = self.size;
        if !self.augment {
            return center_crop(&resize_shorter(img, self.val_resize), s, s);
        }
        let out = if s > SMALL_IMAGE_MAX {
            random_resized_crop(&img, s, rng)
        } else {
            let (w, h) = img.dimensions();
            // 4 pixels at the output resolution, expressed at the source resolution.
            let p = ((4 * w.min(h) as u64 + s as u64 / 2) / s as u64).max(1) as u32;
            let cropped = pad_random_crop(&img, p, w, h, rng);
            center_crop(&resize_shorter(cropped, s), s, s)
        };
        if rng.random_bool(0.5) {
            hflip(&out)
        } else {
            out
        }
    }

    pub fn apply<R: Rng + ?Sized>(&self, img: RgbImage, rng: &mut R) -> Vec<f32> {
        normalize(&self.geometry(img, rng))
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
        assert_eq!(t.geometry(sq.clone(), &mut ChaCha8Rng::seed_from_u64(0)), sq);
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
            for (w, h) in [(32, 32), (120, 70)] {
                let out = t.apply(ramp(w, h), &mut rng);
                assert_eq!(out.len(), 3 * (size * size) as usize);
            }
        }
    }

    #[test]
    fn normalisation_values() {
        let img = RgbImage::from_fn(2, 1, |x, _| if x == 0 { Rgb([0, 255, 51]) } else { Rgb([255, 0, 102]) });
        let v = normalize(&img);
        let expect = |p: f32, c: usize| (p / 255.0 - MEAN[c]) / STD[c];
        let want =
            [expect(0.0, 0), expect(255.0, 0), expect(255.0, 1), expect(0.0, 1), expect(51.0, 2), expect(102.0, 2)];
        for (a, b) in v.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{v:?}");
        }
        assert!((v[0] + 0.485 / 0.229).abs() < 1e-6);
        assert!((v[2] - (1.0 - 0.456) / 0.224).abs() < 1e-6);
    }
}
