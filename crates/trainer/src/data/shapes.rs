//! "shapes": a generated, learnable dataset: one striped disc per image, colour and stripe angle set by the class.

use super::{mix_seed, DataError, Dataset, Sample, Split, StageNanos, Transform};
use image::{Rgb, RgbImage};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::f32::consts::PI;

/// Class `c` of `k` is a disc filled with stripes of hue `c / k` (jittered by +-0.35 of the hue spacing) at angle
/// `pi * frac(c * 0.618..)` (+-0.15 rad); disc position and size, stripe period and phase, background colour and
/// per-pixel noise are random. Deterministic from (seed, split, index); labels are `index % k` (balanced).
pub struct Shapes {
    len: usize,
    num_classes: usize,
    transform: Transform,
    seed: u64,
    split: Split,
}

impl Shapes {
    pub fn new(len: usize, num_classes: usize, transform: Transform, seed: u64, split: Split) -> Self {
        Self { len, num_classes: num_classes.max(1), transform, seed, split }
    }

    /// The raw (un-augmented) image of sample `index`, at image_size.
    pub fn render(&self, index: usize) -> RgbImage {
        let s = self.transform.size;
        let k = self.num_classes as f32;
        let c = (index % self.num_classes) as f32;
        let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(&[self.seed, self.split as u64, index as u64, 0x5A]));
        let bg = hsv(rng.random(), rng.random_range(0.0..0.3), rng.random_range(0.15..0.55));
        let fg =
            hsv(c / k + rng.random_range(-0.35..0.35) / k, rng.random_range(0.6..1.0), rng.random_range(0.65..1.0));
        let dark = fg.map(|v| v * 0.45);
        let (cx, cy) = (rng.random_range(0.3..0.7) * s as f32, rng.random_range(0.3..0.7) * s as f32);
        let r = rng.random_range(0.28..0.42) * s as f32;
        let angle = PI * (c * 0.618_034).fract() + rng.random_range(-0.15..0.15);
        let (dx, dy) = (angle.cos(), angle.sin());
        let freq = 2.0 * PI / (rng.random_range(0.16..0.26) * s as f32);
        let phase = rng.random_range(0.0..2.0 * PI);
        RgbImage::from_fn(s, s, |x, y| {
            let (px, py) = (x as f32 + 0.5 - cx, y as f32 + 0.5 - cy);
            let base = if px * px + py * py > r * r {
                bg
            } else if ((px * dx + py * dy) * freq + phase).sin() > 0.0 {
                fg
            } else {
                dark
            };
            Rgb(base.map(|v| (v * 255.0 + rng.random_range(-24.0..24.0)).clamp(0.0, 255.0) as u8))
        })
    }
}

/// HSV (hue wraps, all in [0, 1]) to RGB in [0, 1].
fn hsv(h: f32, s: f32, v: f32) -> [f32; 3] {
    let h6 = h.rem_euclid(1.0) * 6.0;
    let f = |n: f32| {
        let k = (n + h6) % 6.0;
        v - v * s * k.min(4.0 - k).clamp(0.0, 1.0)
    };
    [f(5.0), f(3.0), f(1.0)]
}

impl Dataset for Shapes {
    fn len(&self) -> usize {
        self.len
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }

    fn image_size(&self) -> usize {
        self.transform.size as usize
    }

    fn get(&self, index: usize, rng: &mut ChaCha8Rng, out: &mut [u8], t: &mut StageNanos) -> Result<Sample, DataError> {
        if index >= self.len {
            return Err(DataError::Loader(format!("{} is out of range (len {})", self.describe(index), self.len)));
        }
        let label = (index % self.num_classes) as u32;
        let t0 = std::time::Instant::now();
        let img = self.render(index);
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
        format!("shapes {} #{index}", self.split.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(len: usize, split: Split, augment: bool) -> Shapes {
        Shapes::new(len, 10, Transform { size: 32, val_resize: 32, augment }, 42, split)
    }

    #[test]
    fn hsv_primaries() {
        assert_eq!(hsv(0.0, 1.0, 1.0), [1.0, 0.0, 0.0]);
        assert_eq!(hsv(1.0 / 3.0, 1.0, 1.0).map(f32::round), [0.0, 1.0, 0.0]);
        assert_eq!(hsv(0.5, 0.0, 0.5), [0.5, 0.5, 0.5]);
    }

    #[test]
    fn deterministic_balanced_and_split_dependent() {
        use crate::data::test_util::get_one;
        let ds = shapes(100, Split::Train, true);
        let (a, la) = get_one(&ds, 13, 1).unwrap();
        let (b, lb) = get_one(&ds, 13, 1).unwrap();
        assert_eq!((a.len(), la.label), (3 * 32 * 32, 3));
        assert!(a == b && la == lb);
        assert_eq!(ds.render(13), shapes(100, Split::Train, false).render(13));
        assert_ne!(ds.render(13), shapes(100, Split::Val, false).render(13));
        let mut counts = [0usize; 10];
        for i in 0..ds.len() {
            counts[get_one(&ds, i, 0).unwrap().1.label as usize] += 1;
        }
        assert_eq!(counts, [10; 10]);
    }

    /// Learnability proxy: a nearest-class-mean classifier on 8x8 thumbnails, fit on train, beats chance on val.
    #[test]
    fn nearest_mean_beats_chance() {
        let thumb = |img: RgbImage| {
            image::imageops::resize(&img, 8, 8, image::imageops::FilterType::Triangle)
                .into_raw()
                .into_iter()
                .map(f32::from)
                .collect::<Vec<_>>()
        };
        let (train, val) = (shapes(300, Split::Train, false), shapes(100, Split::Val, false));
        let mut means = vec![vec![0f32; 192]; 10];
        for i in 0..train.len() {
            for (m, v) in means[i % 10].iter_mut().zip(thumb(train.render(i))) {
                *m += v / 30.0;
            }
        }
        let correct = (0..val.len())
            .filter(|&i| {
                let t = thumb(val.render(i));
                let dist = |m: &Vec<f32>| m.iter().zip(&t).map(|(a, b)| (a - b) * (a - b)).sum::<f32>();
                let best = (0..10).min_by(|&a, &b| dist(&means[a]).total_cmp(&dist(&means[b])));
                best == Some(i % 10)
            })
            .count();
        assert!(correct >= 30, "nearest-mean accuracy {correct}/100");
    }
}
